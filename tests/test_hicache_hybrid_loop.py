"""The hierarchical cache of a hybrid model (tiny Qwen3-Next: full attention + Mamba layers) in the
scheduler loop, on the real engine: a conversation's prefix comes back from the device, from the
host pool (KV pages *and* the Mamba state at a checkpoint) and from a real kvstore (L3), and every
output equals transformers. The faster tiers are emptied and scribbled over between turns, so a
turn can only reuse its prefix through the tier under test; each tier must serve exactly as many
tokens as the device alone serves."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from services.scheduler.l3_lookup import leading_pages
from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.memory import Memory
from services.scheduler.memory.index_tier import IndexHostTier
from services.worker.engine import Engine, EngineConfig
from services.worker.l3_port import KVStorePort
from tests import sched_harness as h
from tests.reference import hf_greedy
from tests.test_hicache_loop import _Shards, kvstore

OUT = 5
PAGE = 4  # tokens per host page (and per page of the device tree)
Turns = list[tuple[list[int], h.Outcome]]


def _engine(model: Path, port: KVStorePort | None = None) -> Engine:
    cfg = EngineConfig(kv_cache_bytes=1 << 20, max_rows=4, mamba_slots=12, host_cache_bytes=1 << 21,
                       host_page_tokens=PAGE)
    return Engine(model, cfg, port)


def _mem(loop: SchedulerLoop) -> Memory:
    assert loop.batcher is not None and isinstance(loop.batcher.mem.host, IndexHostTier)
    return loop.batcher.mem


def _tier(mem: Memory) -> IndexHostTier:
    assert isinstance(mem.host, IndexHostTier)
    return mem.host


async def settle(loop: SchedulerLoop, timeout_s: float = 20.0) -> None:
    """Wait until the loop is idle and every backup and put it queued has been acknowledged."""
    mem = _mem(loop)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        b = loop.batcher
        assert b is not None
        if b.idle and not mem.pending:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not settled: {_tier(mem).inflight} jobs in flight")
        await asyncio.sleep(0.01)


def flush_device(mem: Memory, eng: Engine) -> None:
    """Drop every cached prefix and state from the device tree and scribble over the device KV
    and Mamba pools, so a prefix can only come back through a load."""
    tree = _tier(mem).tree
    tree.evict(tree.evictable_size)
    tree.evict_states(tree.state_evictable)
    assert tree.evictable_size == tree.state_evictable == tree.state_protected == 0
    assert mem.states is not None
    assert mem.slots.available == mem.size and mem.states.pool.available == mem.states.pool.size
    for t in (*eng.kv.k, *eng.kv.v):
        t.normal_()
    assert eng.mamba is not None
    for t in (*eng.mamba.conv, *eng.mamba.ssm):
        t.normal_()


def flush_host(mem: Memory, eng: Engine) -> None:
    """``flush_device``, then drop every host page and state and scribble over the host pools."""
    flush_device(mem, eng)
    tier = _tier(mem)
    tier.kv_host.evict(len(tier.kv_host))
    tier.state_host.evict(len(tier.state_host))
    assert len(tier.kv_host) == len(tier.state_host) == 0
    assert eng.host is not None and eng.host.states is not None
    eng.host.pool.pages.normal_()
    eng.host.states.states.random_(0, 256)


def _turns(vocab: int, n: int = 3) -> list[list[int]]:
    r = random.Random(11)
    return [[r.randrange(3, vocab) for _ in range(r.randrange(9, 20))] for _ in range(n)]


def _conversation(
    eng: Engine, flush: Callable[[Memory, Engine], object], l3: tuple[KVStorePort, _Shards] | None = None
) -> Callable[[SchedulerLoop], Awaitable[Turns]]:
    async def turns(loop: SchedulerLoop, store: object) -> Turns:
        hist: list[int] = []
        res = []
        for t, new in enumerate(_turns(eng.info.vocab_size)):
            hist = hist + new
            l3_pages = 0
            if store is not None:
                assert loop.info is not None
                l3_pages = await leading_pages(store, hist, "", loop.info, timeout_s=5.0)  # type: ignore[arg-type]
                assert (l3_pages > 0) == (t > 0), (t, l3_pages)
            o = await h.one(loop, f"t{t}", h.Spec(list(hist), OUT, l3_pages=l3_pages))
            res.append((list(hist), o))
            hist = hist + o.ids
            await settle(loop)
            mem = _mem(loop)
            mem.check_idle()
            flush(mem, eng)
        return res

    async def body(loop: SchedulerLoop) -> Turns:
        if l3 is None:
            return await turns(loop, None)
        port, shards = l3
        await port.start()
        try:
            async with kvstore(shards) as store:
                return await turns(loop, store)
        finally:
            await port.close()

    return body


def _device_reference(model: Path) -> Turns:
    eng = _engine(model)
    res, loop = h.serve(eng, LoopConfig(), _conversation(eng, lambda m, e: None))
    mem = _mem(loop)
    assert _tier(mem).counters.state_loads == 0 and _tier(mem).counters.state_backups > 0
    return res


@pytest.fixture(scope="module")
def device_turns(tiny_qwen3_next: Path) -> Turns:
    return _device_reference(tiny_qwen3_next)


def _check(model: Path, res: Turns, device: Turns) -> None:
    for i, ((prompt, o), (dprompt, d)) in enumerate(zip(res, device, strict=True)):
        assert prompt == dprompt
        assert o.ids == d.ids == hf_greedy(model, prompt, OUT, stop_at_eos=False), f"turn {i}"
        assert o.cached_tokens == d.cached_tokens, f"turn {i}: served {o.cached_tokens}, device {d.cached_tokens}"
        if i:
            assert o.cached_tokens > 0 and o.cached_tokens % PAGE == 0


def test_prefix_from_device_equals_transformers(tiny_qwen3_next: Path, device_turns: Turns) -> None:
    prev_reusable = len(device_turns[0][0]) + OUT - 1
    assert device_turns[1][1].cached_tokens >= len(device_turns[0][0]) - len(device_turns[0][0]) % PAGE
    assert device_turns[1][1].cached_tokens <= prev_reusable
    _check(tiny_qwen3_next, device_turns, device_turns)


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_from_host_equals_transformers(tiny_qwen3_next: Path, device_turns: Turns, overlap: bool) -> None:
    eng = _engine(tiny_qwen3_next)
    res, loop = h.serve(eng, LoopConfig(overlap=overlap), _conversation(eng, flush_device))
    _check(tiny_qwen3_next, res, device_turns)
    mem = _mem(loop)
    # Each later turn loaded its whole reused prefix and one state from the host.
    assert _tier(mem).counters.state_loads == len(res) - 1
    assert _tier(mem).counters.load_tokens == sum(o.cached_tokens for _, o in res)
    assert eng.host is not None and eng.host.pages_loaded * PAGE == _tier(mem).counters.load_tokens


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_from_l3_equals_transformers(tiny_qwen3_next: Path, device_turns: Turns, overlap: bool) -> None:
    """Device and host are emptied after every turn: the prefix and its state come back from the
    kvstore (prefetched into the host pool while the request waits, then loaded)."""
    shards = _Shards()
    port = KVStorePort(shards)
    eng = _engine(tiny_qwen3_next, port)
    res, loop = h.serve(eng, LoopConfig(overlap=overlap), _conversation(eng, flush_host, (port, shards)))
    _check(tiny_qwen3_next, res, device_turns)
    c = _tier(_mem(loop)).counters
    assert c.put_pages > 0 and c.state_puts > 0 and c.failed_jobs == 0
    assert c.states_prefetched == c.state_loads == len(res) - 1
    assert c.load_tokens == sum(o.cached_tokens for _, o in res)


@pytest.mark.parametrize("overlap", [True, False])
def test_small_tiers_evict_refuse_and_stay_correct(tiny_qwen3_next: Path, overlap: bool) -> None:
    """Four conversations at once sharing a system prefix, on pools far smaller than their working
    set: device slots and states, host pages and host states all evict, and at most one group of
    jobs may be in flight (the rest are refused). Every output still equals transformers, every
    job is acknowledged, and the accounting of every tier holds when idle."""
    cfg = EngineConfig(kv_cache_bytes=1 << 17, max_rows=4, mamba_slots=6, host_cache_bytes=1 << 16,
                       host_page_tokens=PAGE, host_state_share=0.5)
    eng = Engine(tiny_qwen3_next, cfg)
    rng = random.Random(5)
    vocab = eng.info.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(12)]
    chats = [[[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 16))] for _ in range(3)] for _ in range(4)]

    async def chat(loop: SchedulerLoop, c: int) -> Turns:
        hist, res = list(system), []
        for t, new in enumerate(chats[c]):
            hist = hist + new
            o = await h.one(loop, f"c{c}t{t}", h.Spec(list(hist), OUT))
            res.append((list(hist), o))
            hist = hist + o.ids
        return res

    async def body(loop: SchedulerLoop) -> list[Turns]:
        out = await asyncio.gather(*(chat(loop, c) for c in range(4)))
        await settle(loop)
        return list(out)

    lcfg = LoopConfig(overlap=overlap, max_prefill_tokens=24)
    lcfg = LoopConfig(overlap=overlap, max_prefill_tokens=24, hicache=replace(lcfg.hicache, max_inflight_jobs=1))
    res, loop = h.serve(eng, lcfg, body)
    for turns in res:
        for prompt, o in turns:
            assert o.ids == hf_greedy(tiny_qwen3_next, prompt, OUT, stop_at_eos=False)
    mem = _mem(loop)
    assert _tier(mem).kv_host.evictions > 0 and _tier(mem).state_host.evictions > 0
    # With overlap a commit can bring checkpoints while a backup is still in flight: refused.
    assert _tier(mem).counters.refused > 0 or not overlap
    assert _tier(mem).inflight == 0
    mem.check_idle()
