"""``PoolResize`` through the engine: validation in op order, acknowledgement in ``StepResult``,
greedy outputs unchanged by resizes, resident memory returned, and the non-elastic fallback."""

from __future__ import annotations

import gc
from pathlib import Path

import psutil
import pytest
import torch

from services.common.step import MambaReset, PoolResize, ReqInput, StepError, StepRequest, StepResult
from services.worker import engine as engine_mod
from services.worker.engine import Engine, EngineConfig
from services.worker.pool_backing import fixed_backing

MIB = 1 << 20
PROMPTS = [
    [5, 17, 99, 3, 42, 7, 8, 250, 11],
    [300, 12, 13, 14, 15, 16, 700, 19, 20, 21, 22, 23, 24],
    [7, 6, 5, 4, 3, 1],
]
NEW_TOKENS = 16


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def generate(engine: Engine, resize_every: int = 0) -> tuple[list[list[int]], list[StepResult]]:
    """Greedy decode of ``PROMPTS``, the harness playing the scheduler (slots handed out in order).

    With ``resize_every`` a ``PoolResize`` leads every ``resize_every``-th step, alternating
    between the tightest whole-unit capacity that the next steps need and the full reservation.
    """
    info, n = engine.info, len(PROMPTS)
    outs: list[list[int]] = [[] for _ in PROMPTS]
    lengths = [0] * n
    next_slot, results = 0, []
    for step in range(NEW_TOKENS):
        ops: list = []
        need = sum(map(len, PROMPTS)) if step == 0 else n
        if resize_every and step % resize_every == 0:
            if step // resize_every % 2 == 0:
                kv = min(info.max_slots, _round_up(next_slot + need + resize_every * n, info.slot_granularity))
                ops.append(PoolResize(kv, n if info.hybrid else 0))
            else:
                ops.append(PoolResize(info.max_slots, info.max_mamba_slots))
        reqs = []
        for i, prompt in enumerate(PROMPTS):
            ids = prompt if step == 0 else [outs[i][-1]]
            if step == 0 and info.hybrid:
                ops.append(MambaReset(i))
            slots = list(range(next_slot, next_slot + len(ids)))
            reqs.append(ReqInput(f"r{i}", i, ids, lengths[i], slots, mamba_slot=i if info.hybrid else None))
            next_slot += len(ids)
            lengths[i] += len(ids)
        res = engine.step(StepRequest(step, ops, reqs))
        for o in res.outputs:
            outs[o.row].append(o.token_id)
        results.append(res)
    return outs, results


@pytest.fixture(scope="module")
def dense(tiny_qwen3: Path) -> Engine:
    # 1 KiB per slot: 64 slots at start, a 256-slot reservation.
    return Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=64 << 10, kv_max_bytes=256 << 10, max_rows=4))


@pytest.fixture(scope="module")
def hybrid(tiny_qwen3_next: Path) -> Engine:
    # 512 bytes per KV slot: 64 slots at start, 256 reserved; Mamba 4 slots at start, 48 reserved.
    cfg = EngineConfig(kv_cache_bytes=32 << 10, kv_max_bytes=128 << 10, max_rows=4, mamba_slots=4,
                       mamba_max_slots=48)
    return Engine(tiny_qwen3_next, cfg)


def test_info_reports_capacities_reservations_and_granularity(dense: Engine, hybrid: Engine) -> None:
    d, h = dense.info, hybrid.info
    assert (d.num_slots, d.max_slots, d.slot_granularity, d.max_mamba_slots) == (64, 256, 32, 0)
    assert (h.num_slots, h.max_slots, h.num_mamba_slots, h.max_mamba_slots) == (64, 256, 4, 48)
    assert h.slot_granularity == 32 and h.mamba_slot_granularity >= 1
    assert d.elastic and h.elastic and d.pool_page_bytes == h.pool_page_bytes > 0


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_greedy_outputs_identical_with_resizes_every_few_steps(which: str, request: pytest.FixtureRequest,
                                                               tiny_qwen3: Path, tiny_qwen3_next: Path) -> None:
    engine: Engine = request.getfixturevalue(which)
    model = tiny_qwen3 if which == "dense" else tiny_qwen3_next
    static = Engine(model, EngineConfig(kv_cache_bytes=engine.info.max_slots * engine.info.bytes_per_slot,
                                        max_rows=4, mamba_slots=max(engine.info.max_mamba_slots, 4)))
    expected, _ = generate(static)
    ptrs = [t.data_ptr() for t in (*engine.kv.k, *engine.kv.v)]
    got, results = generate(engine, resize_every=2)
    assert got == expected
    assert [t.data_ptr() for t in (*engine.kv.k, *engine.kv.v)] == ptrs
    kv_caps = [r.num_slots for r in results]
    assert len(set(kv_caps)) > 1 and max(kv_caps) == engine.info.max_slots  # it really shrank and grew
    committed = [r.kv_committed_bytes for r in results]
    assert min(committed) < max(committed)
    if engine.mamba is not None:
        assert {r.num_mamba_slots for r in results} == {len(PROMPTS), engine.info.max_mamba_slots}
        assert min(r.mamba_committed_bytes for r in results) < max(r.mamba_committed_bytes for r in results)
    last = results[-1]
    assert (last.num_slots, last.kv_committed_bytes) == (engine.kv.num_slots, engine.kv.committed_bytes)


def _state(engine: Engine) -> tuple[int, int, int, int, torch.Tensor]:
    m = engine.mamba
    return (engine.kv.num_slots, engine.kv.committed_bytes, m.num_slots if m else 0, m.committed_bytes if m else 0,
            engine.kv.k[0][: engine.kv.num_slots].clone())


def _assert_same(a: tuple[int, int, int, int, torch.Tensor], b: tuple[int, int, int, int, torch.Tensor]) -> None:
    assert a[:4] == b[:4] and torch.equal(a[4], b[4])


@pytest.mark.parametrize(("ops", "message"), [
    ([PoolResize(260, 0)], r"ops\[0\] \(PoolResize\)\.kv_slots: KV capacity 260 outside \[0, 256\] \(max_slots\)"),
    ([PoolResize(-4, 0)], r"ops\[0\] \(PoolResize\)\.kv_slots: KV capacity -4 outside \[0, 256\]"),
    ([PoolResize(80, 0)], r"KV capacity 80 is not a multiple of the slot granularity 32 \(nor max_slots 256\)"),
    ([PoolResize(64, 1)], r"ops\[0\] \(PoolResize\)\.mamba_slots=1: the model has no Mamba state"),
    # A valid resize first: nothing runs, because the whole step is validated before any op.
    ([PoolResize(32, 0), PoolResize(257, 0)], r"ops\[1\] \(PoolResize\)\.kv_slots: KV capacity 257 outside"),
])
def test_bad_resize_is_refused_and_pools_unchanged(dense: Engine, ops: list, message: str) -> None:
    dense.step(StepRequest(0, [PoolResize(64, 0)]))
    before = _state(dense)
    with pytest.raises(StepError, match=message):
        dense.step(StepRequest(1, ops))
    _assert_same(before, _state(dense))


def test_later_ops_and_requests_see_the_capacity_after_a_resize(dense: Engine, hybrid: Engine) -> None:
    dense.step(StepRequest(0, [PoolResize(64, 0)]))
    shrink_then_write = StepRequest(1, [PoolResize(32, 0)], [ReqInput("a", 0, [5, 6], 0, [31, 40])])
    with pytest.raises(StepError, match=r"new_slots has slot 40 outside \[0, 32\)"):
        dense.step(shrink_then_write)
    assert dense.kv.num_slots == 64
    # A grow and a write into the grown range in one step: the op runs before the forward.
    res = dense.step(StepRequest(2, [PoolResize(256, 0)], [ReqInput("a", 0, [5, 6], 0, [200, 255])]))
    assert res.num_slots == 256 and len(res.outputs) == 1

    kv = hybrid.info.num_slots
    with pytest.raises(StepError, match=r"ops\[1\] \(MambaReset\)\.slot=3 out of range \[0, 2\)"):
        hybrid.step(StepRequest(3, [PoolResize(kv, 2), MambaReset(3)]))
    hybrid.step(StepRequest(4, [MambaReset(3), PoolResize(kv, 2)]))  # reset, then shrink: in order
    assert hybrid.mamba is not None and hybrid.mamba.num_slots == 2
    # Capacity 0 on a hybrid model is an empty pool, not a dense model.
    with pytest.raises(StepError, match=r"mamba_slot=0 out of range \[0, 0\)"):
        hybrid.step(StepRequest(5, [PoolResize(kv, 0)], [ReqInput("b", 1, [5], 0, [0], mamba_slot=0)]))
    res = hybrid.step(StepRequest(6, [PoolResize(kv, 48)]))
    assert (res.num_mamba_slots, res.ops_done) == (48, 1)


def test_resize_step_returns_resident_memory(tiny_qwen3: Path) -> None:
    engine = Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=256 * MIB, max_rows=4))
    for t in (*engine.kv.k, *engine.kv.v):
        t.fill_(0.25)  # as if every slot held KV
    gc.collect()
    filled = psutil.Process().memory_info().rss
    keep = engine.info.slot_granularity
    res = engine.step(StepRequest(0, [PoolResize(keep, 0)]))
    gc.collect()
    dropped = filled - psutil.Process().memory_info().rss
    assert res.num_slots == keep and res.kv_committed_bytes == keep * engine.info.bytes_per_slot
    assert dropped >= 0.8 * 255 * MIB, f"RSS fell only {dropped / MIB:.1f} MiB"
    assert bool((engine.kv.k[0][:keep] == 0.25).all())  # the live slots kept their data
    res = engine.step(StepRequest(1, [PoolResize(engine.info.max_slots, 0)]))
    assert not engine.kv.v[-1][keep:].any()  # grown back: released slots read as zero


def test_no_elastic_backing_keeps_the_starting_size(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_mod, "choose_backing", lambda device: fixed_backing(device, "test: no VMM"))
    engine = Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=64 << 10, kv_max_bytes=256 << 10, max_rows=4))
    info = engine.info
    assert not info.elastic and info.max_slots == info.num_slots == 64
    held = engine.kv.committed_bytes
    res = engine.step(StepRequest(0, [PoolResize(32, 0)]))  # bookkeeping only: memory is not returned
    assert res.num_slots == 32 and res.kv_committed_bytes == held
    with pytest.raises(StepError, match=r"KV capacity 128 outside \[0, 64\]"):
        engine.step(StepRequest(1, [PoolResize(128, 0)]))
