"""The hierarchical cache in the scheduler loop, on the real engine (tiny Qwen3, in-process):
prefixes come back from the device, from the host pool and from a real kvstore (L3), and every
output equals transformers. Tiers are flushed between turns to force each source."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from services.kvstore.config import KVStoreConfig
from services.kvstore.server import build_server
from services.kvstore.sharded import ShardedKVStore
from services.scheduler.cache.hiradix_policy import StopPolicy
from services.scheduler.l3_lookup import leading_pages
from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.memory import HiConfig, Memory
from services.scheduler.memory.tree_tier import TreeHostTier
from services.worker.engine import Engine, EngineConfig
from services.worker.l3_port import KVStorePort
from tests import sched_harness as h
from tests.reference import hf_greedy

OUT = 5
PAGE = 4  # tokens per host page: small, so short prompts span several pages


def _engine(model: Path, port: KVStorePort | None = None, host_bytes: int = 1 << 22) -> Engine:
    cfg = EngineConfig(kv_cache_bytes=1 << 21, max_rows=8, host_cache_bytes=host_bytes, host_page_tokens=PAGE)
    return Engine(model, cfg, port)


def _mem(loop: SchedulerLoop) -> Memory:
    assert loop.batcher is not None and isinstance(loop.batcher.mem.host, TreeHostTier)
    return loop.batcher.mem


def _tier(mem: Memory) -> TreeHostTier:
    assert isinstance(mem.host, TreeHostTier)
    return mem.host


async def settle(loop: SchedulerLoop, timeout_s: float = 20.0) -> None:
    """Wait until the loop is idle and every backup / put it queued has been acknowledged."""
    mem = _mem(loop)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        b = loop.batcher
        assert b is not None
        if b.idle and _tier(mem).inflight == 0 and not _tier(mem).hi.queued_writes:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not settled: {_tier(mem).inflight} jobs in flight")
        await asyncio.sleep(0.01)


def flush_device(mem: Memory, eng: Engine) -> None:
    """Drop every device copy (write_through: each is on the host already) and scribble over the
    whole device pool, so a prefix can only come back through a load."""
    hi = _tier(mem).hi
    ev = hi.evict_device(hi.evictable_size)
    assert ev.pending == 0 and hi.evictable_size == 0
    assert mem.slots.available == mem.size  # idle: nothing else holds a slot
    for t in (*eng.kv.k, *eng.kv.v):
        t.normal_()


def flush_host(mem: Memory, eng: Engine) -> None:
    """``flush_device``, then drop every host page and scribble over the host pool."""
    flush_device(mem, eng)
    tier = _tier(mem)
    tier.hi.evict_host(tier.hi.host_evictable_size)
    assert tier.pages.available == tier.pages.num_pages
    assert eng.host is not None
    eng.host.pool.pages.normal_()


def _turns(vocab: int, seed: int, n: int) -> list[list[int]]:
    """Growing prompts of one conversation (the answer is appended by the caller)."""
    r = random.Random(seed)
    return [[r.randrange(3, vocab) for _ in range(r.randrange(9, 20))] for _ in range(n)]


def _conversation(
    eng: Engine, flush: Callable[[Memory, Engine], object], turns: int = 3
) -> Callable[[SchedulerLoop], Awaitable[list[tuple[list[int], h.Outcome]]]]:
    async def body(loop: SchedulerLoop) -> list[tuple[list[int], h.Outcome]]:
        hist: list[int] = []
        res = []
        for t, new in enumerate(_turns(eng.info.vocab_size, 7, turns)):
            hist = hist + new
            o = await h.one(loop, f"t{t}", h.Spec(list(hist), OUT))
            res.append((list(hist), o))
            hist = hist + o.ids
            await settle(loop)
            flush(_mem(loop), eng)
            _tier(_mem(loop)).hi.sanity_check()
        return res

    return body


def _check(model: Path, res: list[tuple[list[int], h.Outcome]]) -> None:
    for i, (prompt, o) in enumerate(res):
        assert o.ids == hf_greedy(model, prompt, OUT, stop_at_eos=False), f"turn {i}"
        if i:
            prev_prompt, prev = res[i - 1]
            # Everything of the previous turn with KV (its last sampled token has none), in whole pages.
            reusable = len(prev_prompt) + len(prev.ids) - 1
            assert o.cached_tokens == reusable - reusable % PAGE, f"turn {i}"


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_from_device_equals_transformers(tiny_qwen3: Path, overlap: bool) -> None:
    eng = _engine(tiny_qwen3)
    res, loop = h.serve(eng, LoopConfig(overlap=overlap), _conversation(eng, lambda m, e: None))
    _check(tiny_qwen3, res)
    mem = _mem(loop)
    assert _tier(mem).counters.load_tokens == 0 and _tier(mem).counters.backup_pages > 0
    mem.check_idle()


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_from_host_equals_transformers(tiny_qwen3: Path, overlap: bool) -> None:
    eng = _engine(tiny_qwen3)
    res, loop = h.serve(eng, LoopConfig(overlap=overlap), _conversation(eng, flush_device))
    _check(tiny_qwen3, res)
    mem = _mem(loop)
    assert _tier(mem).counters.load_tokens == sum(o.cached_tokens for _, o in res)
    assert eng.host is not None and eng.host.pages_loaded * PAGE == _tier(mem).counters.load_tokens
    mem.check_idle()


class _Shards:
    """A membership source the test fills once the kvstore server has a port."""

    def __init__(self) -> None:
        self.addresses: dict[str, _Addr] = {}

    def members(self) -> dict[str, _Addr]:
        return self.addresses


class _Addr:
    def __init__(self, address: str) -> None:
        self.address = address


@asynccontextmanager
async def kvstore(shards: _Shards, capacity: int = 1 << 26) -> AsyncIterator[ShardedKVStore]:
    """A real kvstore server in this event loop, and a client of it (for the lookup)."""
    server, _ = build_server(KVStoreConfig(capacity_bytes=capacity))
    port = await server.start("127.0.0.1:0")
    addr = f"127.0.0.1:{port}"
    shards.addresses = {addr: _Addr(addr)}
    store = ShardedKVStore([addr])
    try:
        yield store
    finally:
        await store.close()
        await server.stop()


def _l3_turns(
    eng: Engine, port: KVStorePort, shards: _Shards
) -> Callable[[SchedulerLoop], Awaitable[list[tuple[list[int], h.Outcome]]]]:
    """A 3-turn conversation; after each turn device and host are flushed and scribbled over, so
    only the kvstore holds the prefix (looked up at submission as the server does)."""

    async def body(loop: SchedulerLoop) -> list[tuple[list[int], h.Outcome]]:
        await port.start()
        try:
            async with kvstore(shards) as store:
                info = loop.info
                assert info is not None and info.l3
                hist: list[int] = []
                res = []
                for t, new in enumerate(_turns(info.vocab_size, 7, 3)):
                    hist = hist + new
                    l3 = await leading_pages(store, hist, "", info, timeout_s=5.0)
                    if t:
                        assert l3 > 0
                    o = await h.one(loop, f"t{t}", h.Spec(list(hist), OUT, l3_pages=l3))
                    res.append((list(hist), o))
                    hist = hist + o.ids
                    await settle(loop)
                    flush_host(_mem(loop), eng)
                return res
        finally:
            await port.close()

    return body


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_from_l3_equals_transformers(tiny_qwen3: Path, overlap: bool) -> None:
    """Every turn's prefix is flushed from device and host: it comes back from the kvstore
    (prefetched into the host pool while the request waits, then loaded)."""
    shards = _Shards()
    port = KVStorePort(shards)
    eng = _engine(tiny_qwen3, port)
    res, loop = h.serve(eng, LoopConfig(overlap=overlap), _l3_turns(eng, port, shards))
    _check(tiny_qwen3, res)
    mem = _mem(loop)
    assert _tier(mem).counters.put_pages > 0 and _tier(mem).counters.prefetched_pages > 0
    assert _tier(mem).counters.load_tokens == sum(o.cached_tokens for _, o in res)
    mem.check_idle()


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_prefetch_that_does_not_wait(tiny_qwen3: Path, policy: StopPolicy) -> None:
    """best_effort (and timeout with a zero wait) admit at once: the request recomputes its
    prefix while the fetch lands in the host pool; outputs are the same."""
    shards = _Shards()
    port = KVStorePort(shards)
    eng = _engine(tiny_qwen3, port)
    cfg = LoopConfig(hicache=HiConfig(prefetch_policy=policy, prefetch_timeout_s=0.0))
    res, loop = h.serve(eng, cfg, _l3_turns(eng, port, shards))
    for prompt, o in res:
        assert o.ids == hf_greedy(tiny_qwen3, prompt, OUT, stop_at_eos=False)
        assert o.cached_tokens == 0  # nothing local, and nobody waited for L3
    mem = _mem(loop)
    assert _tier(mem).counters.prefetched_pages > 0  # the fetches still happened (and were acknowledged)
    mem.check_idle()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_full_pool_waits_for_write_back_evictions(tiny_qwen3: Path, overlap: bool) -> None:
    """write_back: making room means backing pages up first, so the slots free a step later. A
    request that needs them waits for the backups instead of being declared unable to fit."""
    eng = Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=1 << 21, max_rows=4, host_cache_bytes=1 << 22,
                                          host_page_tokens=PAGE))
    size = eng.info.num_slots
    rng = random.Random(3)
    prompts = [[rng.randrange(3, eng.info.vocab_size) for _ in range(size * 2 // 3)] for _ in range(4)]
    cfg = LoopConfig(overlap=overlap, max_prefill_tokens=64, hicache=HiConfig(write_policy="write_back"))

    async def body(loop: SchedulerLoop) -> list[h.Outcome]:
        return [await h.one(loop, f"r{i}", h.Spec(p, OUT)) for i, p in enumerate(prompts)]

    outs, loop = h.serve(eng, cfg, body)
    for p, o in zip(prompts, outs, strict=True):
        assert o.ids == hf_greedy(tiny_qwen3, p, OUT, stop_at_eos=False)
    mem = _mem(loop)
    assert _tier(mem).counters.backup_pages > 0  # evictions went through the host
    mem.check_idle()
