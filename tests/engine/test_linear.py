"""The skinny linear kernel (``kernels/csrc/skinny_linear.c``) against float64, and ``linear``'s
dispatch: every shape it takes agrees with ``F.linear`` to rounding; what it does not take is
``F.linear`` itself; the engine lets it run in steps of decodes and verify passes only."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kernels.linear
from kernels.linear import (
    BATCHED,
    NATIVE,
    NATIVE_ROWS,
    PACKED,
    PACKED_STEPS,
    ROWS,
    STEPS,
    Linear,
    batch_timing,
    batches_packable,
    few_rows,
    linear,
    mark_native,
    native_timing,
    pack,
    pack_batches,
    packed_timing,
    pays,
    unpack,
    unpack_batches,
)
from kernels.native import load
from services.common.step import ReqInput, StepRequest
from services.scheduler.loop import LoopConfig
from services.worker.engine import Engine, EngineConfig, packed_steps
from tests import sched_harness as h
from tests.device import TEST_DEVICE
from tests.reference import hf_greedy

pytestmark = pytest.mark.skipif(load() is None, reason="no C compiler: the native kernels are not built")


def _skinny(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    lib = load()
    assert lib is not None
    out = torch.full((x.shape[0], w.shape[0]), float("nan"))
    rc = lib.strata_skinny_linear_f32(
        x.data_ptr(), w.data_ptr(), 0 if b is None else b.data_ptr(), out.data_ptr(), x.shape[0], w.shape[0], w.shape[1]
    )
    assert rc == 0
    return out


@pytest.mark.parametrize("rows", range(1, 9))
def test_every_row_count_matches_float64(rows: int) -> None:
    """K below, at and past the 16-lane step (the scalar tail), N not a multiple of any tile."""
    gen = torch.Generator().manual_seed(rows)
    for n, k, bias in itertools.product((1, 2, 3, 5, 67), (1, 15, 16, 17, 100, 512), (False, True)):
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen) if bias else None
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        got = _skinny(x, w, b)
        err = float((got.double() - want).abs().max())
        assert err <= 1e-5 * (1 + float(want.abs().max())), (rows, n, k, bias, err)


def test_rows_outside_the_kernel_are_refused() -> None:
    lib = load()
    assert lib is not None
    x, w, out = torch.randn(9, 4), torch.randn(3, 4), torch.zeros(9, 3)
    assert lib.strata_skinny_linear_f32(x.data_ptr(), w.data_ptr(), 0, out.data_ptr(), 9, 3, 4) == -1
    assert not out.any()


def test_it_is_used_only_where_its_registers_fit() -> None:
    """AVX-512 (32 registers) holds the kernel's accumulators; on AVX2 it spilled and lost to MKL."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    assert pays() == ("avx512f" in flags.split())


def test_linear_dispatch_agrees_with_torch() -> None:
    """3-D and non-contiguous inputs, every row count around the kernel's range, and the cases
    that must keep ``F.linear`` (grad, fp64) bit for bit."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    for rows in range(1, 12):
        x = torch.randn(rows, 2, 40, generator=gen)[:, 0]  # rows of a wider tensor: not contiguous
        with torch.inference_mode():
            with few_rows(True):
                got = linear(x, w, b)
            outside, want = linear(x, w, b), F.linear(x, w, b)
        assert got.shape == want.shape == (rows, 48)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(outside, want)  # outside few_rows: torch's path, bit for bit
        if rows not in ROWS or not pays():
            assert torch.equal(got, want)
    x3 = torch.randn(1, 4, 40, generator=gen)
    with torch.inference_mode(), few_rows(True):
        torch.testing.assert_close(linear(x3, w), F.linear(x3, w), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 40, generator=gen, requires_grad=True)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # autograd: torch's path
    xd, wd = x.detach().double(), w.double()
    with torch.inference_mode(), few_rows(True):
        assert torch.equal(linear(xd, wd), F.linear(xd, wd))
    layer = Linear(40, 48)
    assert set(dict(layer.named_parameters())) == {"weight", "bias"}  # the checkpoint's names


def _inside_and_outside(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``F.linear(x, w, b)``, and ``linear``'s inside ``few_rows`` (a decode step) and outside it."""
    with torch.inference_mode():
        want = F.linear(x, w, b)
        with few_rows(True):
            inside = linear(x, w, b)
        return want, inside, linear(x, w, b)


def test_packed_copies_serve_the_steps_they_were_packed_for() -> None:
    """``pack``: each fp32 weight of the model's ``Linear`` layers gets a oneDNN-packed copy, which
    ``linear`` uses for the steps given: "decode" inside ``few_rows``, "prefill" outside it, at any
    row count (within rounding of ``F.linear``); a step not given is bit for bit ``F.linear``.
    ``unpack`` drops them."""
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(Linear(40, 48), Linear(48, 8, bias=False), torch.nn.Linear(8, 8))
    added = pack(model)
    assert added == (48 * 40 + 8 * 48) * 4
    assert hasattr(model[0].weight, PACKED) and not hasattr(model[2].weight, PACKED)  # torch's own Linear: not ours
    assert getattr(model[0].weight, PACKED_STEPS) == STEPS == {"decode", "prefill"}
    w, b = model[0].weight, model[0].bias
    used = 0
    for steps in (STEPS, frozenset({"decode"}), frozenset({"prefill"})):
        assert pack(model, steps) == added  # the copies are kept, their steps set again
        for rows in (1, 2, 5, 9, 70):
            x = torch.randn(rows, 3, 40, generator=gen)[:, 1]  # not contiguous
            want, inside, outside = _inside_and_outside(x, w, b)
            for step, got in (("decode", inside), ("prefill", outside)):
                if step in steps:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                    used += 1
                elif step == "prefill" or not kernels.linear.pays():  # inside: the skinny kernel where it pays
                    assert torch.equal(got, want), (steps, step, rows)
        with torch.inference_mode():
            x = torch.randn(70, 40, generator=gen)
            packed_out = torch.ops.mkldnn._linear_pointwise(x, getattr(w, PACKED), b, "none", [], "")
            with few_rows("decode" in steps):
                assert torch.equal(linear(x, w, b), packed_out)  # the copy, for the step it was packed for
    assert used == 5 * 4
    x3 = torch.randn(2, 3, 48, generator=gen)
    with torch.inference_mode(), few_rows(True):
        torch.testing.assert_close(linear(x3, model[1].weight), F.linear(x3, model[1].weight), rtol=1e-5, atol=1e-5)
    mkl, packed = packed_timing(model, rows=2, rounds=1)
    assert mkl > 0 and packed > 0
    unpack(model)
    assert not any(hasattr(m.weight, a) for m in model[:2] for a in (PACKED, PACKED_STEPS))
    assert pack(model.double()) == 0  # fp64: not packed


@pytest.mark.skipif(not batches_packable(), reason="this torch has no MKL packed GEMM")
def test_batch_copies_serve_decode_batches_of_more_than_8_rows() -> None:
    """``pack_batches``: each fp32 weight of the model's ``Linear`` layers gets an MKL-packed copy,
    which ``linear`` uses inside ``few_rows`` at more than 8 rows (within rounding of ``F.linear``,
    any row count, not only the one packed for); at 1-8 rows and outside ``few_rows`` it is not
    used. ``unpack_batches`` drops the copies."""
    gen = torch.Generator().manual_seed(4)
    model = torch.nn.Sequential(Linear(40, 48), Linear(48, 8, bias=False), torch.nn.Linear(8, 8))
    assert pack_batches(model) == (48 * 40 + 8 * 48) * 4
    assert hasattr(model[0].weight, BATCHED) and not hasattr(model[2].weight, BATCHED)
    w, b = model[0].weight, model[0].bias
    for rows in (1, 8, 9, 33, 64, 65, 200):
        x = torch.randn(rows, 3, 40, generator=gen)[:, 1]  # not contiguous
        want, inside, outside = _inside_and_outside(x, w, b)
        with torch.inference_mode():
            copy = torch.ops.mkl._mkl_linear(x.contiguous(), getattr(w, BATCHED), w, b, rows)
        torch.testing.assert_close(inside, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(outside, want)  # a prefill chunk: MKL on the plain weight
        if rows > 8:
            assert torch.equal(inside, copy), rows  # the copy, for a decode batch
    x3 = torch.randn(4, 3, 48, generator=gen)  # [..., K] inputs keep their leading shape
    with torch.inference_mode(), few_rows(True):
        torch.testing.assert_close(linear(x3, model[1].weight), F.linear(x3, model[1].weight), rtol=1e-5, atol=1e-5)
    without, with_ = batch_timing(model, rows=16, rounds=1)
    assert without > 0 and with_ > 0
    unpack_batches(model)
    assert not any(hasattr(m.weight, BATCHED) for m in model[:2])
    assert pack_batches(model.double()) == 0  # fp64: not packed


@pytest.mark.skipif(TEST_DEVICE != "cpu" or not batches_packable(), reason="MKL's packed GEMM is the CPU's")
def test_decode_batches_take_the_batch_copies_and_equal_transformers(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``packed_weights`` on, decode steps of more than 8 requests multiply with the MKL-packed
    copies, and greedy output stays transformers' for every request."""
    calls: list[int] = []
    batched = kernels.linear._batched
    monkeypatch.setattr(kernels.linear, "_batched", lambda x, *a: calls.append(x.shape[0]) or batched(x, *a))
    eng = Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=1 << 22, max_rows=16, packed_weights="on"))
    rng = random.Random(6)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randrange(3, 30))] for _ in range(12)]
    lengths = [rng.randrange(6, 14) for _ in prompts]
    outs, loop = h.run(eng, [h.Spec(p, n) for p, n in zip(prompts, lengths, strict=True)], LoopConfig(cache="radix"))
    for p, n, o in zip(prompts, lengths, outs, strict=True):
        assert o.ids == hf_greedy(tiny_qwen3, p, n, stop_at_eos=False)
    assert calls and min(calls) > 8, calls
    loop.batcher.mem.check_idle()


@pytest.mark.parametrize("rows", range(1, 9))
def test_the_8_lane_kernel_matches_float64(rows: int) -> None:
    """N below, at and past every tile height, K below, at and past the 8-lane step; M outside 1-8 refused."""
    lib = load()
    assert lib is not None
    gen = torch.Generator().manual_seed(8 + rows)
    for n, k, bias in itertools.product((1, 2, 3, 7, 8, 9, 67), (1, 7, 8, 9, 100, 512), (False, True)):
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen) if bias else None
        out = torch.full((rows, n), float("nan"))
        rc = lib.strata_rows_linear_f32(x.data_ptr(), w.data_ptr(), 0 if b is None else b.data_ptr(), out.data_ptr(),
                                        rows, n, k)  # fmt: skip
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        err = float((out.double() - want).abs().max())
        assert rc == 0 and err <= 1e-5 * (1 + float(want.abs().max())), (n, k, bias, err)
    x, w, out = torch.randn(9, 4), torch.randn(3, 4), torch.zeros(9, 3)
    assert lib.strata_rows_linear_f32(x.data_ptr(), w.data_ptr(), 0, out.data_ptr(), 9, 3, 4) == -1 and not out.any()


def test_marked_weights_take_the_8_lane_kernel_at_their_row_counts_inside_few_rows_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``mark_native``: the row counts it was given take the kernel inside ``few_rows`` (within
    rounding of ``F.linear``, before a packed copy); others, and any outside ``few_rows``, keep
    their path (outside: ``F.linear`` bit for bit)."""
    gen = torch.Generator().manual_seed(4)
    model = torch.nn.Sequential(Linear(40, 48), Linear(48, 8, bias=False), torch.nn.Linear(8, 8))
    assert mark_native(model, frozenset({1, 3})) == 2 and not hasattr(model[2].weight, NATIVE)  # torch's own Linear
    pack(model, frozenset({"decode"}))
    w, b = model[0].weight, model[0].bias
    calls: list[int] = []
    native = kernels.linear._rows
    monkeypatch.setattr(kernels.linear, "_rows", lambda x, *a: calls.append(x.shape[0]) or native(x, *a))
    for rows in range(1, 10):
        x = torch.randn(rows, 3, 40, generator=gen)[:, 1]  # not contiguous
        with torch.inference_mode():
            with few_rows(True):
                got = linear(x, w, b)
            outside, want = linear(x, w, b), F.linear(x, w, b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(outside, want)
    assert calls == [1, 3]
    other, native_s = native_timing(model, 2, rounds=1)
    assert other > 0 and native_s > 0
    assert mark_native(model, frozenset()) == 2 and all(not getattr(m.weight, NATIVE) for m in model[:2])
    assert mark_native(model.double()) == 0  # fp64: not the kernel's
    assert frozenset(range(1, 9)) == NATIVE_ROWS


class _Counting:
    """The native library, counting calls of the skinny kernel."""

    def __init__(self, lib: Any) -> None:
        self.lib, self.calls = lib, 0

    def strata_skinny_linear_f32(self, *args: Any) -> int:
        self.calls += 1
        return int(self.lib.strata_skinny_linear_f32(*args))


def test_the_engine_uses_it_for_decodes_and_verify_passes_only(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 decodes and a verify pass of 3 drafts take the kernel; a prefill chunk of 5 tokens, alone
    or beside decodes, keeps MKL (its logits stay bit for bit what a reference computes)."""
    lib = load()
    counting = _Counting(lib)
    monkeypatch.setattr(kernels.linear, "load", lambda: counting)
    monkeypatch.setattr(kernels.linear, "pays", lambda: True)  # the engine's choice, on any machine
    # MKL and the kernel, not packed copies (which would take every few-rows step where they pay)
    eng = Engine(tiny_qwen3, EngineConfig(device=TEST_DEVICE, kv_cache_bytes=1 << 20, max_rows=8, packed_weights="off",
                                          native_linear="off"))  # fmt: skip
    slots = iter(range(1, 1000))
    steps = iter(range(1, 100))

    def step(*reqs: ReqInput) -> int:
        before = counting.calls
        eng.step(StepRequest(next(steps), reqs=list(reqs)))
        return counting.calls - before

    def new(row: int, ids: list[int], start: int = 0, drafts: int = 0) -> ReqInput:
        return ReqInput(f"r{row}", row, ids, start, [next(slots) for _ in ids], num_draft=drafts)

    assert step(*(new(r, [5 + r] * 6) for r in range(4))) == 0  # prefill chunks: 24 rows, and chunks
    assert step(new(4, [9, 10, 11, 12, 13])) == 0  # a 5-token chunk alone
    assert step(*(new(r, [7], start=6) for r in range(4))) > 0  # 4 decodes
    assert step(new(0, [8, 9, 10, 11], start=7, drafts=3)) > 0  # a verify pass: 4 rows
    assert step(new(1, [7], start=7), new(2, [7], start=7), new(5, [3, 4, 5])) == 0  # decodes + a chunk


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the 8-lane kernel is the CPU's")
def test_small_decode_batches_take_the_8_lane_kernel_and_equal_transformers(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``native_linear`` on, decode steps of 1-3 requests take the 8-lane kernel, and greedy
    output stays transformers' for every request (steps with a prefill chunk keep MKL)."""
    calls: list[int] = []
    native = kernels.linear._rows
    monkeypatch.setattr(kernels.linear, "_rows", lambda x, *a: calls.append(x.shape[0]) or native(x, *a))
    eng = Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=1 << 22, max_rows=4, packed_weights="off",
                                          native_linear="on"))  # fmt: skip
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randrange(3, 30))] for _ in range(3)]
    lengths = [3, 6, 16]  # the last request decodes its last ten tokens alone
    outs, loop = h.run(eng, [h.Spec(p, n) for p, n in zip(prompts, lengths, strict=True)], LoopConfig(cache="radix"))
    for p, n, o in zip(prompts, lengths, outs, strict=True):
        assert o.ids == hf_greedy(tiny_qwen3, p, n, stop_at_eos=False)
    assert {1, 2} <= set(calls), set(calls)  # alone, and two at once
    loop.batcher.mem.check_idle()


def test_packed_copies_are_kept_per_step_where_they_measured_faster() -> None:
    """``packed_weights=auto``: each kind of step keeps the copies at a 10 % gain; prefill chunks at
    no loss where decode steps keep them anyway, else at the same 10 %."""
    assert packed_steps(2.0, 1.3) == {"decode", "prefill"}
    assert packed_steps(2.0, 1.02) == {"decode", "prefill"}  # the copies are there: not slower is enough
    assert packed_steps(2.0, 0.95) == {"decode"}
    assert packed_steps(1.05, 1.3) == {"prefill"}
    assert packed_steps(1.05, 1.05) == frozenset()  # no copies for 5 %: they double the weights' memory


def test_auto_turns_the_kernel_on_at_the_row_counts_whose_own_timing_gained(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``native_linear=auto`` times passes at 1, 2, 4 and 8 rows, each standing for its neighbours
    (``NATIVE_TIMED``, which covers 1-8 once): a gain at 4 rows alone turns on 4 rows alone (MKL's
    4-row path is its slowest, so one count's gain does not carry to the others)."""
    import services.worker.engine as engine_mod

    assert sorted(r for rows in engine_mod.NATIVE_TIMED.values() for r in rows) == sorted(NATIVE_ROWS)
    marked: list[frozenset[int]] = []
    real_mark = engine_mod.mark_native

    def mark(model: Any, rows: frozenset[int] = NATIVE_ROWS) -> int:
        marked.append(frozenset(rows))
        return real_mark(model, rows)

    for gains, want in (({4}, {4}), ({2, 8}, {2, 3, 5, 6, 7, 8}), (set(), set())):
        marked.clear()
        monkeypatch.setattr(engine_mod, "mark_native", mark)
        monkeypatch.setattr(engine_mod, "native_timing", lambda m, n, g=gains: (2.0, 1.0) if n in g else (1.0, 1.0))
        monkeypatch.setattr(kernels.linear, "pays", lambda: True)
        Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=1 << 20, max_rows=4, packed_weights="off", native_linear="auto"))
        assert marked[-1] == frozenset(want), (gains, marked)
