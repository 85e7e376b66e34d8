"""The hierarchical KV cache end to end (issue #7): real etcd, kvstore shards, worker, scheduler
and tokenizer processes talking gRPC; token-id prompts; greedy outputs compared with transformers.

1. Pages outlive restarts: a file-backed kvstore keeps a prompt's pages across its own restart,
   and a restarted worker (empty device and host pools) serves that prompt again from them
   (looked up at submission, prefetched, loaded): ``usage.cached_tokens`` counts them and the
   output is unchanged.
2. A shard killed mid-run is a miss, never an error: with two shards holding the pages of a first
   run, a restarted worker serves the same prompts again (through L3) and one shard is SIGKILLed
   while they run and more arrive; every request completes with the first run's output
   (== transformers), and so do new turns, before and after the dead shard leaves discovery.

Each test starts its own stack (about 20 s of its time on two cores) and stops every process on
the way out, passed or failed.
"""

from __future__ import annotations

import random
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import grpc
import pytest

from services.common.page_hash import HashNamespace, page_hashes
from services.common.step import WorkerInfo
from services.kvstore.sharded import rendezvous_owner
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc
from tests.hicache_stack import (
    PAGE_TOKENS,
    MiB,
    Reply,
    add_kvstore,
    generate,
    hicache_stack,
    kv_stats,
    l3_pages,
    members,
    random_ids,
    restart,
    restart_worker,
    wait_l3_pages,
    wait_members,
    worker_info,
)
from tests.reference import hf_greedy

pytestmark = pytest.mark.timeout(300)  # a hang fails here, and the stack is still stopped


def _hf(model: Path, prompts: list[list[int]], outs: list[int]) -> list[list[int]]:
    return [hf_greedy(model, p, n, stop_at_eos=False) for p, n in zip(prompts, outs, strict=True)]


def _run_all(api: pgrpc.StrataStub, prompts: list[list[int]], outs: list[int]) -> list[Reply]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda po: generate(api, *po), zip(prompts, outs, strict=True)))


def _check(replies: list[Reply], want: list[list[int]], what: str) -> None:
    for i, (r, w) in enumerate(zip(replies, want, strict=True)):
        assert r.finish_reason == pb.FINISH_REASON_LENGTH and not r.error, f"{what} request {i}: {r}"
        assert r.ids == w, f"{what} request {i}: output differs from the reference"


# -- 1. restarts ---------------------------------------------------------------------------------

OUT = 8


def test_pages_survive_kvstore_restart_and_serve_a_restarted_worker(tiny_qwen3: Path, tmp_path: Path) -> None:
    rng = random.Random(7)
    kv_args = ("--backend", "file", "--path", str(tmp_path / "pages"), "--capacity-bytes", str(64 * MiB))
    with hicache_stack(tiny_qwen3, tmp_path / "run", kv_args) as stack:
        info = worker_info(stack)
        prompt = random_ids(rng, 300, info.vocab_size)  # 4 whole pages and a partial one
        pages = len(prompt) // PAGE_TOKENS
        want = hf_greedy(tiny_qwen3, prompt, OUT, stop_at_eos=False)
        with grpc.insecure_channel(stack.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)
            first = generate(api, prompt, OUT)
            assert first.ids == want and first.cached_tokens == 0

            # write_through: the pages reach the host pool, then the kvstore.
            kv = stack.child("kvstore")
            wait_l3_pages([kv.address], [prompt], info)
            before = kv_stats(kv.address)
            assert before.backend == "file" and before.pages >= pages

            old = kv.address
            address = restart(kv)  # SIGTERM, then a new process on the same directory
            wait_members(stack, "kvstore", {address})  # the old registration is gone
            after = kv_stats(address)
            assert (after.pages, after.used_bytes) == (before.pages, before.used_bytes), (old, address)
            assert l3_pages([address], [prompt], info) == [pages]

            restart_worker(stack)
            # The scheduler's admission lookup has a short deadline; a first request of a prompt
            # that L3 does not hold opens its channel to the new shard address.
            generate(api, random_ids(rng, PAGE_TOKENS + 6, info.vocab_size), 1)
            hits = kv_stats(address).hits

            again = generate(api, prompt, OUT)
            assert again.ids == want == first.ids
            # Nothing is on the new worker's device or host: every whole page came from L3.
            assert again.cached_tokens == pages * PAGE_TOKENS
            assert kv_stats(address).hits - hits == pages


def test_a_hybrid_prefix_and_its_state_come_back_from_l3_after_a_worker_restart(
    tiny_qwen3_next: Path, tmp_path: Path
) -> None:
    """Qwen3-Next: the pages *and* the Mamba state at the prompt's last whole page reach L3
    (write_through); a restarted worker, with nothing on its device or host, serves the prompt
    again from them: the state is usable, so every whole page counts as cached."""
    rng = random.Random(8)
    with hicache_stack(tiny_qwen3_next, tmp_path / "run") as stack:
        info = worker_info(stack)
        assert info.hybrid and info.host_states > 0 and info.state_layout
        prompt = random_ids(rng, 300, info.vocab_size)  # a checkpoint at 256 tokens (4 pages)
        pages = len(prompt) // PAGE_TOKENS
        want = hf_greedy(tiny_qwen3_next, prompt, OUT, stop_at_eos=False)
        with grpc.insecure_channel(stack.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)
            first = generate(api, prompt, OUT)
            assert first.ids == want and first.cached_tokens == 0
            kv = stack.child("kvstore")
            wait_l3_pages([kv.address], [prompt], info)  # usable pages: each with the state after the last

            restart_worker(stack)
            generate(api, random_ids(rng, PAGE_TOKENS + 6, info.vocab_size), 1)
            hits = kv_stats(kv.address).hits
            again = generate(api, prompt, OUT)
            assert again.ids == want
            assert again.cached_tokens == pages * PAGE_TOKENS
            assert kv_stats(kv.address).hits - hits == pages + 1  # the pages and one state


# -- 2. a shard killed mid-run -------------------------------------------------------------------

CONVERSATIONS, TURNS = 6, 3


def _conversations(rng: random.Random, vocab: int) -> list[list[int]]:
    """Prompts sharing prefixes like chat turns: one system prefix, six conversations of three
    growing turns (about 210, 280 and 350 tokens); ``[c * TURNS + t]`` is turn t of conversation c."""
    system = random_ids(rng, 100, vocab)
    prompts = []
    for _ in range(CONVERSATIONS):
        history = system + random_ids(rng, 40, vocab)
        for _ in range(TURNS):
            history = history + random_ids(rng, rng.randrange(50, 90), vocab)
            prompts.append(history)
    return prompts


def _owner_of_first_page(prompt: list[int], shards: list[str], info: WorkerInfo) -> str:
    key = page_hashes(prompt, PAGE_TOKENS, HashNamespace(info.fingerprint, info.kv_layout))[0]
    return rendezvous_owner(key, shards)


def test_killing_one_shard_mid_run_is_a_miss_not_an_error(tiny_qwen3: Path, tmp_path: Path) -> None:
    rng = random.Random(11)
    with hicache_stack(tiny_qwen3, tmp_path / "run") as stack:
        add_kvstore(stack, "kvstore-2")
        kvstores = [c for c in stack.children if c.name == "kvstore"]
        wait_members(stack, "kvstore", {c.address for c in kvstores})
        info = worker_info(stack)
        prompts = _conversations(rng, info.vocab_size)
        outs = [4 + 6 * (i % 4) for i in range(len(prompts))]  # 4..22 tokens: they finish apart
        want = _hf(tiny_qwen3, prompts, outs)
        # Placement depends on the shards' (random) ports. The victim is the shard that does not
        # hold the shared first page, so that after the kill lookups still find a leading run and
        # stop at the victim's first page (a partial hit) instead of missing from the start.
        shards = [c.address for c in kvstores]
        owner = _owner_of_first_page(prompts[0], shards, info)
        survivor = next(c for c in kvstores if c.address == owner)
        victim = next(c for c in kvstores if c.address != owner)
        with grpc.insecure_channel(stack.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)

            # Before: all requests at once; their pages spread over both shards.
            before = _run_all(api, prompts, outs)
            _check(before, want, "before the kill")
            wait_l3_pages(shards, prompts, info)
            assert kv_stats(survivor.address).pages > 0 and kv_stats(victim.address).pages > 0

            # A fresh worker: whatever it reuses now comes through L3 (or from sibling requests).
            restart_worker(stack)
            hits = kv_stats(survivor.address).hits
            first = range(0, 4 * TURNS)  # conversations 0-3, all turns at once
            later = range(4 * TURNS, len(prompts))  # conversations 4-5, after the kill
            with ThreadPoolExecutor(len(prompts)) as pool:
                futures: dict[int, Future[Reply]] = {
                    i: pool.submit(generate, api, prompts[i], outs[i]) for i in first
                }
                wait(futures.values(), return_when=FIRST_COMPLETED)
                assert victim.proc is not None
                victim.proc.kill()  # SIGKILL: no deregistration, its lease lives on for a while
                victim.proc.wait()
                running_at_kill = sum(not f.done() for f in futures.values())
                # More requests while the dead shard is still registered: their lookups, prefetches
                # and puts meet it.
                futures |= {i: pool.submit(generate, api, prompts[i], outs[i]) for i in later}
                during = [futures[i].result() for i in range(len(prompts))]
            assert running_at_kill > 0, "every request had finished before the shard was killed"
            _check(during, [r.ids for r in before], "around the kill")
            assert kv_stats(survivor.address).hits > hits, "the restarted worker never read L3"
            # The dead shard's pages read as gaps, not as an error; the survivor's first page stays.
            held = l3_pages(shards, prompts, info)
            assert all(h >= 1 for h in held) and held != [len(p) // PAGE_TOKENS for p in prompts], held

            # After: next turns, once while the dead shard may still be registered and again after
            # its lease expired (its keys now map to the survivor, where they are misses).
            for convs in (range(0, 3), range(3, 6)):
                if convs.start:
                    wait_members(stack, "kvstore", {survivor.address})
                last = [c * TURNS + TURNS - 1 for c in convs]
                nexts = [prompts[i] + before[i].ids + random_ids(rng, 30, info.vocab_size) for i in last]
                sixes = [6] * len(nexts)
                _check(_run_all(api, nexts, sixes), _hf(tiny_qwen3, nexts, sixes), "after the kill")
            assert members(stack, "worker") == {stack.child("worker").address}
            assert [c for c in stack.children if not c.alive()] == [victim]
