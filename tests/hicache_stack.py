"""Real-process stacks with the hierarchical cache on, for the end-to-end tests of its tiers.

``hicache_stack`` starts etcd, a kvstore, a worker with a host pool and L3, a scheduler and a
tokenizer (``services.supervisor.start_stack``) with small pools, and stops every process it
started when the block ends, however it ends. The helpers restart a service the way an operator
would (SIGTERM, then start again), add kvstore shards, ask the shards what they hold (as the
scheduler's admission lookup does) and send token-id prompts through the public API.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common import step_codec
from services.common.discovery import Discovery
from services.common.etcd_proc import free_port
from services.common.step import WorkerInfo
from services.kvstore.backends import BackendStats
from services.kvstore.client import KVStoreClient
from services.kvstore.sharded import ShardedKVStore
from services.scheduler.l3_lookup import leading_pages
from services.supervisor import Child, Stack, start_stack
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc
from strata.worker.v1 import worker_pb2 as wpb
from strata.worker.v1 import worker_pb2_grpc as wgrpc

PAGE_TOKENS = 64  # tokens per host / L3 page (the worker's --host-page-tokens)
MiB = 1 << 20
# Small pools (the tiny model's KV is 1 KiB per token): 8192 device slots, 64 host pages.
WORKER_ARGS = (
    "--kv-cache-bytes", str(8 * MiB),
    "--host-cache-bytes", str(4 * MiB),
    "--host-page-tokens", str(PAGE_TOKENS),
    "--l3", "true",
)
LEASE_TTL_S = 5.0  # services register with this etcd lease TTL


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1")


@contextmanager
def hicache_stack(model: Path, run_dir: Path, kvstore_args: tuple[str, ...] = ()) -> Iterator[Stack]:
    """A running stack with the hierarchical cache on; every child (including ones a test appends
    to ``stack.children``) and etcd are stopped on exit."""
    stack = start_stack(
        model, free_port(), run_dir, worker_args=WORKER_ARGS, kvstore_args=kvstore_args, say=lambda _: None,
        grammar_preload=False,
    )
    try:
        yield stack
    finally:
        stack.stop()


def add_kvstore(stack: Stack, name: str, *args: str, timeout_s: float = 60.0) -> Child:
    """Start one more kvstore shard registered in the stack's etcd; ``stack.stop`` stops it too.
    (It is appended after the stack's own, so ``stack.child("kvstore")`` still names the first.)"""
    argv = [sys.executable, "-m", "services.kvstore.server", "--etcd", stack.etcd_endpoint, *args]
    child = Child("kvstore", argv, stack.run_dir / f"{name}.log")
    stack.children.append(child)
    child.start(env())
    child.wait_ready(timeout_s)
    return child


def restart(child: Child, timeout_s: float = 120.0) -> str:
    """SIGTERM ``child``, wait for it to exit and start it again; returns its new address."""
    child.stop()
    child.start(env())
    return child.wait_ready(timeout_s)


# -- discovery ---------------------------------------------------------------------------------


async def _members(etcd: str, kind: str) -> set[str]:
    d = Discovery(etcd, kind)
    await d.start()
    try:
        return {r.address for r in d.members().values()}
    finally:
        await d.stop()


def members(stack: Stack, kind: str) -> set[str]:
    """Addresses registered in etcd under ``kind`` now."""
    return asyncio.run(_members(stack.etcd_endpoint, kind))


def wait_members(stack: Stack, kind: str, want: set[str], timeout_s: float = LEASE_TTL_S + 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := members(stack, kind)) != want:
        assert time.monotonic() < deadline, f"{kind} members {sorted(got)}, expected {sorted(want)}"
        time.sleep(0.1)


def restart_worker(stack: Stack) -> None:
    """Stop the worker (its device and host pools die with it), wait until it has left discovery,
    start it again and wait until the scheduler serves with the new one."""
    worker = stack.child("worker")
    worker.stop()
    wait_members(stack, "worker", set())
    address = restart(worker)  # stop() is a no-op now: it has exited
    wait_members(stack, "worker", {address})
    # The scheduler looks at discovery every 0.5 s: it has dropped the old worker long since (the
    # new one took seconds to load), so an attached worker is the new one.
    deadline = time.monotonic() + 30.0
    while scheduler_load(stack).workers != 1:
        assert time.monotonic() < deadline, "the scheduler did not attach the restarted worker"
        time.sleep(0.1)


def scheduler_load(stack: Stack) -> spb.Load:
    with grpc.insecure_channel(stack.child("scheduler").address) as ch:
        return sgrpc.SchedulerStub(ch).GetLoad(spb.GetLoadRequest(), timeout=5.0)


def worker_info(stack: Stack) -> WorkerInfo:
    with grpc.insecure_channel(stack.child("worker").address) as ch:
        return step_codec.info_from_pb(wgrpc.WorkerStub(ch).GetInfo(wpb.GetInfoRequest(), timeout=5.0))


# -- what the shards hold ----------------------------------------------------------------------


async def _leading(shards: list[str], prompts: list[list[int]], info: WorkerInfo) -> list[int]:
    async with ShardedKVStore(shards, timeout_s=5.0) as store:
        return [await leading_pages(store, p, "", info, timeout_s=5.0) for p in prompts]


def l3_pages(shards: list[str], prompts: list[list[int]], info: WorkerInfo) -> list[int]:
    """For each prompt, how many of its leading pages ``shards`` hold, keyed as the worker keys
    them (the scheduler's admission lookup, with a generous deadline)."""
    return asyncio.run(_leading(shards, prompts, info))


def wait_l3_pages(
    shards: list[str], prompts: list[list[int]], info: WorkerInfo, timeout_s: float = 20.0
) -> None:
    """Wait until every whole page of every prompt is in L3 (the puts are asynchronous)."""
    want = [len(p) // PAGE_TOKENS for p in prompts]
    deadline = time.monotonic() + timeout_s
    while (got := l3_pages(shards, prompts, info)) != want:
        assert time.monotonic() < deadline, f"L3 holds {got} leading pages, expected {want}"
        time.sleep(0.2)


async def _stats(address: str) -> BackendStats:
    async with KVStoreClient(address, timeout_s=5.0) as c:
        return await c.stats()


def kv_stats(address: str) -> BackendStats:
    return asyncio.run(_stats(address))


# -- requests ----------------------------------------------------------------------------------


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` token ids, avoiding the few special ids at the bottom of the tiny vocabulary."""
    return [rng.randrange(3, vocab) for _ in range(n)]


@dataclass(frozen=True, slots=True)
class Reply:
    ids: list[int]
    finish_reason: int
    cached_tokens: int
    error: str


def generate(api: pgrpc.StrataStub, ids: list[int], n: int, timeout_s: float = 60.0) -> Reply:
    """Greedy ``n`` tokens after ``ids`` (ignoring eos, so the length is fixed)."""
    sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    req = pb.GenerateRequest(input_ids=pb.TokenIds(ids=ids), sampling=sampling, stream=True)
    out: list[int] = []
    last = pb.GenerateResponse()
    for r in api.Generate(req, timeout=timeout_s):
        out += r.token_ids
        last = r
    return Reply(out, last.finish_reason, last.usage.cached_tokens, last.error)
