"""Every composition of the scheduler's memory in the loop, on the real engine, through one driver:
{dense (tiny Qwen3), hybrid (tiny Qwen3-Next: attention + Mamba layers)} x {device, host, L3}.

A conversation's prefix comes back from the device, from the host pool (KV pages and, for the
hybrid model, the Mamba state at a checkpoint) or from a real kvstore (L3), and every output equals
transformers. The faster tiers are emptied and scribbled over between turns, so a turn can only
reuse its prefix through the tier under test, and each tier must serve exactly as many tokens as
the device alone serves. The same driver runs every write policy (write_through, the default;
write_back: pages reach the host only when the device evicts them; write_through_selective: only
once a match hits them a second time), LFU eviction, prefetches that do not wait, and tiny pools
where every tier evicts and jobs are refused."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

from services.kvstore.config import KVStoreConfig
from services.kvstore.server import build_server
from services.kvstore.sharded import ShardedKVStore
from services.scheduler.l3_lookup import leading_pages
from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.memory import HiConfig, Memory
from services.scheduler.memory.host_policy import StopPolicy, WritePolicy
from services.scheduler.memory.host_tier import HostTierPlanner
from services.scheduler.speculative import SpecConfig, Speculator
from services.worker.engine import Engine, EngineConfig
from services.worker.l3_port import KVStorePort
from tests import sched_harness as h
from tests.reference import hf_greedy

OUT = 5
PAGE = 4  # tokens per host page (and per page of the device tree): short prompts span several
Turns = list[tuple[list[int], h.Outcome]]
KINDS = ["dense", "hybrid"]
Flush = Callable[[SchedulerLoop, Engine], object]


@pytest.fixture(params=KINDS)
def model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue("tiny_qwen3" if request.param == "dense" else "tiny_qwen3_next")


def _hybrid(model: Path) -> bool:
    return "next" in model.name


def _engine(model: Path, port: KVStorePort | None = None, mtp: bool = False) -> Engine:
    if _hybrid(model):
        cfg = EngineConfig(kv_cache_bytes=1 << 20, max_rows=4, mamba_slots=12, host_cache_bytes=1 << 21,
                           host_page_tokens=PAGE, mtp=mtp)
    else:
        cfg = EngineConfig(kv_cache_bytes=1 << 21, max_rows=8, host_cache_bytes=1 << 22, host_page_tokens=PAGE)
    return Engine(model, cfg, port)


def _mem(loop: SchedulerLoop) -> Memory:
    assert loop.batcher is not None
    return loop.batcher.mem


def _tier(loop: SchedulerLoop) -> HostTierPlanner:
    host = _mem(loop).host
    assert isinstance(host, HostTierPlanner)
    return host


async def settle(loop: SchedulerLoop, timeout_s: float = 20.0) -> None:
    """Wait until the loop is idle and every job it queued has been acknowledged (a test's own
    eviction queues write-back copies while the loop sleeps: wake it)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        b = loop.batcher
        assert b is not None
        if b.idle and not b.mem.pending:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not settled: {_tier(loop).inflight} jobs in flight")
        loop._wake.set()
        await asyncio.sleep(0.01)


def evict_device(loop: SchedulerLoop) -> None:
    """Drop every cached prefix (and state) from the device tree (write_back copies them to the
    host with the next step: let it run before scribbling)."""
    mem, tree = _mem(loop), _tier(loop).tree
    tree.evict(tree.evictable_size)
    tree.evict_states(tree.state_evictable)
    assert tree.evictable_size == tree.state_evictable == tree.state_protected == 0
    assert mem.slots.available == mem.size
    assert mem.states is None or mem.states.pool.available == mem.states.pool.size


def flush_device(loop: SchedulerLoop, eng: Engine) -> None:
    """``evict_device`` and scribble over the device pools, so a prefix can only come back
    through a load."""
    evict_device(loop)
    for t in (*eng.kv.k, *eng.kv.v, *((*eng.mamba.conv, *eng.mamba.ssm) if eng.mamba is not None else ())):
        t.normal_()


def flush_host(loop: SchedulerLoop, eng: Engine) -> None:
    """``flush_device`` (and its write-back copies), then drop every host page and state and
    scribble over the host pools."""
    flush_device(loop, eng)
    tier = _tier(loop)
    assert not tier.memory_pending, "flush_host needs the write-back copies acknowledged first"
    tier.kv_host.evict(len(tier.kv_host))
    tier.state_host.evict(len(tier.state_host))
    assert len(tier.kv_host) == len(tier.state_host) == 0
    assert eng.host is not None
    eng.host.pool.pages.normal_()
    if eng.host.states is not None:
        eng.host.states.states.random_(0, 256)


def _turns(vocab: int, n: int = 3) -> list[list[int]]:
    """Growing prompts of one conversation (the answer is appended by the caller)."""
    r = random.Random(11)
    return [[r.randrange(3, vocab) for _ in range(r.randrange(9, 20))] for _ in range(n)]


def _conversation(
    eng: Engine, flush: Flush | None, l3: tuple[KVStorePort, _Shards] | None = None, repeat: int = 1
) -> Callable[[SchedulerLoop], Awaitable[Turns]]:
    """Three turns; after each (and its ``repeat - 1`` resends; the first send is the turn's
    outcome) the loop settles, its books are checked and ``flush`` empties the faster tiers."""

    async def turns(loop: SchedulerLoop, store: ShardedKVStore | None) -> Turns:
        hist: list[int] = []
        res = []
        for t, new in enumerate(_turns(eng.info.vocab_size)):
            hist = hist + new
            l3_pages = 0
            if store is not None:
                assert loop.info is not None
                l3_pages = await leading_pages(store, hist, "", loop.info, timeout_s=5.0)
                assert (l3_pages > 0) == (t > 0), (t, l3_pages)
            outs = [await h.one(loop, f"t{t}.{r}", h.Spec(list(hist), OUT, l3_pages=l3_pages)) for r in range(repeat)]
            o = outs[0]  # a resend is served by the device
            assert all(x.ids == o.ids for x in outs)
            res.append((list(hist), o))
            hist = hist + o.ids
            await settle(loop)
            _mem(loop).check_idle()
            if flush is not None:
                evict_device(loop)  # write_back copies what the device drops: let them land
                await settle(loop)
                flush(loop, eng)
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


@cache
def _device_turns(model: Path) -> Turns:
    """The reference: the same conversation served from the device alone."""
    eng = _engine(model)
    res, loop = h.serve(eng, LoopConfig(), _conversation(eng, None))
    c = _tier(loop).counters
    assert c.load_tokens == 0 and c.backup_pages > 0 and (c.state_backups > 0) == _hybrid(model)
    return res


def _check(model: Path, res: Turns, exact: bool = True) -> None:
    device = _device_turns(model)
    for i, ((prompt, o), (dprompt, d)) in enumerate(zip(res, device, strict=True)):
        assert prompt == dprompt
        assert o.ids == d.ids == hf_greedy(model, prompt, OUT, stop_at_eos=False), f"turn {i}"
        if exact:
            assert o.cached_tokens == d.cached_tokens, f"turn {i}: served {o.cached_tokens}, device {d.cached_tokens}"
        if i:
            assert o.cached_tokens % PAGE == 0
    if not _hybrid(model):  # a dense model reuses everything of the previous turn with KV
        for i in range(1, len(device)):
            reusable = len(device[i - 1][0]) + len(device[i - 1][1].ids) - 1
            assert device[i][1].cached_tokens == reusable - reusable % PAGE


def test_prefix_from_the_device_equals_transformers(model: Path) -> None:
    _check(model, _device_turns(model))


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_from_the_host_equals_transformers(model: Path, overlap: bool) -> None:
    eng = _engine(model)
    res, loop = h.serve(eng, LoopConfig(overlap=overlap), _conversation(eng, flush_device))
    _check(model, res)
    c = _tier(loop).counters
    # Each later turn loaded its whole reused prefix (and one state) from the host.
    assert c.load_tokens == sum(o.cached_tokens for _, o in res) > 0
    assert c.state_loads == (len(res) - 1 if _hybrid(model) else 0)
    assert eng.host is not None and eng.host.pages_loaded * PAGE == c.load_tokens


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


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_from_l3_equals_transformers(model: Path, overlap: bool) -> None:
    """Device and host are emptied after every turn: the prefix (and its state) come back from the
    kvstore, prefetched into the host pool while the request waits, then loaded."""
    shards = _Shards()
    port = KVStorePort(shards)
    eng = _engine(model, port)
    res, loop = h.serve(eng, LoopConfig(overlap=overlap), _conversation(eng, flush_host, (port, shards)))
    _check(model, res)
    c = _tier(loop).counters
    assert c.put_pages > 0 and c.prefetched_pages > 0 and c.failed_jobs == 0
    assert c.load_tokens == sum(o.cached_tokens for _, o in res)
    if _hybrid(model):
        assert c.state_puts > 0 and c.states_prefetched == c.state_loads == len(res) - 1


@pytest.mark.parametrize("tier", ["host", "l3"])
def test_speculation_with_every_tier(model: Path, tier: str) -> None:
    """Speculative decoding on, a draft at every decode (the last token again, so some are kept
    where the model repeats and the rest rejected): prefixes still come back exactly from the host
    and from L3, which only ever received accepted tokens' KV (and states)."""
    shards = _Shards()
    port = KVStorePort(shards) if tier == "l3" else None
    eng = _engine(model, port)
    conv = _conversation(eng, flush_device if tier == "host" else flush_host, (port, shards) if port else None)
    spec = Speculator(SpecConfig("ngram", num_draft_tokens=3, max_batch=64, min_accepted=0, adaptive=False),
                      eng.info.context_length, drafter=lambda req, k: [req.seq[-1]] * k)  # fmt: skip

    async def body(loop: SchedulerLoop) -> Turns:
        assert loop.batcher is not None
        loop.batcher.spec = spec
        return await conv(loop)

    res, loop = h.serve(eng, LoopConfig(), body)
    _check(model, res)
    assert spec.counters.verify_steps > 0 and spec.counters.draft_tokens > spec.counters.accepted_tokens
    assert _tier(loop).counters.load_tokens == sum(o.cached_tokens for _, o in res) > 0


@pytest.mark.parametrize("tier", ["host", "l3"])
def test_mtp_with_every_tier(tiny_qwen3_next: Path, tier: str) -> None:
    """Qwen3-Next's MTP head drafting at every decode: prefixes and states come back exactly from
    the host and from L3 (the head's KV of reloaded pages is stale, which costs acceptance only)."""
    shards = _Shards()
    port = KVStorePort(shards) if tier == "l3" else None
    eng = _engine(tiny_qwen3_next, port, mtp=True)
    conv = _conversation(eng, flush_device if tier == "host" else flush_host, (port, shards) if port else None)
    spec = SpecConfig("mtp", num_draft_tokens=3, max_batch=64, min_accepted=0, adaptive=False)
    res, loop = h.serve(eng, LoopConfig(spec=spec), conv)
    _check(tiny_qwen3_next, res)
    assert loop.batcher is not None and loop.batcher.spec is not None
    assert loop.batcher.spec.counters.verify_steps > 0
    assert _tier(loop).counters.load_tokens == sum(o.cached_tokens for _, o in res) > 0


@pytest.mark.parametrize("tier", ["device", "host", "l3"])
def test_write_back_serves_every_tier_after_device_evictions(model: Path, tier: str) -> None:
    """write_back: nothing is copied while the device keeps a prefix; flushing the device copies
    it to the host (pages and the state) on its way out, and the next turn loads it back, or
    fetches it from L3 after the host is flushed too."""
    if tier == "device":
        eng = _engine(model)
        res, loop = h.serve(eng, LoopConfig(hicache=HiConfig(write_policy="write_back")), _conversation(eng, None))
        _check(model, res)
        c = _tier(loop).counters
        assert c.backup_pages == c.state_backups == c.load_tokens == 0
        return
    shards = _Shards()
    port = KVStorePort(shards) if tier == "l3" else None
    eng = _engine(model, port)
    cfg = LoopConfig(hicache=HiConfig(write_policy="write_back"))
    l3 = (port, shards) if port is not None else None
    res, loop = h.serve(eng, cfg, _conversation(eng, flush_host if l3 else flush_device, l3))
    _check(model, res)
    c = _tier(loop).counters
    assert c.backup_pages > 0 and c.load_tokens == sum(o.cached_tokens for _, o in res) > 0
    assert (c.state_backups > 0) == _hybrid(model)


def test_write_through_selective_backs_up_on_the_second_hit(model: Path) -> None:
    """write_through_selective: each turn is sent twice before the device is flushed; the resend's
    match is the second hit of what the first send cached, so that much reaches the host and the
    next turn loads it (less than the device alone serves: the answer's pages never had a hit)."""
    eng = _engine(model)
    cfg = LoopConfig(hicache=HiConfig(write_policy="write_through_selective"))
    res, loop = h.serve(eng, cfg, _conversation(eng, flush_device, repeat=2))
    _check(model, res, exact=False)
    c = _tier(loop).counters
    assert c.backup_pages > 0 and c.load_tokens == sum(o.cached_tokens for _, o in res)
    assert all(o.cached_tokens > 0 for _, o in res[1:])


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_prefetch_that_does_not_wait(model: Path, policy: StopPolicy) -> None:
    """best_effort (and timeout with a zero wait) admit at once: the request recomputes its prefix
    while the fetch lands in the host pool; outputs are the same."""
    shards = _Shards()
    port = KVStorePort(shards)
    eng = _engine(model, port)
    cfg = LoopConfig(hicache=HiConfig(prefetch_policy=policy, prefetch_timeout_s=0.0))
    res, loop = h.serve(eng, cfg, _conversation(eng, flush_host, (port, shards)))
    for prompt, o in res:
        assert o.ids == hf_greedy(model, prompt, OUT, stop_at_eos=False)
        assert o.cached_tokens == 0  # nothing local, and nobody waited for L3
    assert _tier(loop).counters.prefetched_pages > 0  # the fetches still happened (and were acknowledged)
    _mem(loop).check_idle()


@pytest.mark.parametrize(("policy", "eviction"), [("write_through", "lru"), ("write_back", "lfu"),
                                                  ("write_through_selective", "lru")])
@pytest.mark.parametrize("overlap", [True, False])
def test_small_tiers_evict_refuse_and_stay_correct(
    model: Path, policy: WritePolicy, eviction: str, overlap: bool
) -> None:
    """Four conversations at once sharing a system prefix, on pools far smaller than their working
    set: device slots (and states) and host pages (and states) all evict, and at most one group of
    jobs may be in flight (the rest are refused). Every output still equals transformers, every
    job is acknowledged, and the accounting of every tier holds when idle."""
    hybrid = _hybrid(model)
    cfg = EngineConfig(kv_cache_bytes=1 << 17, max_rows=4, mamba_slots=6 if hybrid else 0,
                       host_cache_bytes=1 << 16, host_page_tokens=PAGE, host_state_share=0.5)
    eng = Engine(model, cfg)
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

    lcfg = LoopConfig(overlap=overlap, max_prefill_tokens=24, eviction=eviction)
    lcfg = replace(lcfg, hicache=HiConfig(write_policy=policy, max_inflight_jobs=1))
    res, loop = h.serve(eng, lcfg, body)
    for turns in res:
        for prompt, o in turns:
            assert o.ids == hf_greedy(model, prompt, OUT, stop_at_eos=False)
    tier, mem = _tier(loop), _mem(loop)
    assert mem.evicted + (mem.states.counters.evicted if mem.states is not None else 0) > 0  # device
    assert tier.counters.backup_pages > 0 and (tier.kv_host.evictions > 0 or policy != "write_through")  # host
    assert tier.inflight == 0
    _mem(loop).check_idle()
