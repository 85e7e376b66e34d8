"""The models' linear layers: ``F.linear``, except a decode of a few rows on the CPU.

At M = 3..8 rows (a small batch's decode step, a verify pass of a few drafts) MKL's sgemm reads
the weights at well under the memory's rate, and the weights are most of what such a step reads:
``kernels/csrc/skinny_linear.c`` streams each weight row once for all M rows. Measured on the
bench model's 57 weight matrices with cold caches (2 threads), ms per pass over all of them:

    M            1     2     3     4     6     8
    F.linear  4.79  5.38  6.23  8.92  9.57  10.37
    skinny    4.35  5.56  5.75  5.90  6.57   7.42

and per engine step of the bench model (512-token contexts, alternated, median of 5): decode at
batch 4 19.5 -> 16.1 ms, at batch 8 24.3 -> 20.5 ms, a verify of 4 drafts at batch 1 19.4 -> 16.8 ms
(docs/benchmarks.md). One and two rows were no faster in the model (11.1 vs 11.8 ms, 12.7 vs 12.7
ms), so they keep MKL.

The kernel's results agree with ``F.linear``'s to rounding (~1e-6 relative: its summation order is
not MKL's), so it is used only where the engine says so (``few_rows``, per step): in steps of
decodes and verify passes, whose GEMMs already differ in shape, and so in rounding, from a
reference's one-sequence decode. A prefill chunk never takes the kernels (a 7-token chunk of the
hybrid model moved 1.8e-4 from transformers' logits through the skinny kernel; the bar is 1e-4);
it takes the packed copies below where the engine keeps them for prefill, else MKL. Everything
else (other row counts, half precision, a GPU, no C compiler, autograd) keeps ``F.linear``.

**The 8-lane kernel** (``mark_native``, ``kernels/csrc/skinny_linear.c: strata_rows_linear_f32``,
1-8 rows): a small batch's decode step streams every weight once for a few multiply-adds each, and
MKL and oneDNN read them well under the memory's rate (11-13 GB/s at one row on an AVX2 EPYC whose
``sum`` over the same bytes runs at 19-22, less from two rows). The kernel walks R weight rows at a
time with one 8-lane accumulator per (row, input row), sized for AVX2's 16 registers; the engine
marks the weights with the row counts where a pass measured it faster at start (``native_timing``
at 1 and at 4 rows), and ``linear`` then takes it inside ``few_rows``, before a packed copy.
Engine decode steps (512-token contexts, alternated, medians of 4), off -> on: the bench model
26.2 -> 18.1 ms at 1 request, 29.2 -> 22.2 at 2, 30.4 -> 26.1 at 4; Qwen3-0.6B's widths and
vocabulary on 4 layers 90.6 -> 58.1 ms at 1, 105.3 -> 82.7 at 2.

**Packed weights** (``pack``): oneDNN's copy of a weight in its own blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, what vLLM's CPU worker multiplies with), used for
the steps the engine packed them for (``PACKED_STEPS``): "decode", inside ``few_rows`` (steps of
decodes and verify passes) for every row count the 8-lane kernel does not take; "prefill",
outside it (every other forward: prefill chunks, mixed steps). ``EngineConfig.packed_weights``
keeps them, by default, for each kind of step where a pass at its rows measured them faster (the
engine, ``_pack_weights``, says by how much). On an
AVX2-only EPYC (2 threads, the bench model's 57 matrices), ms per pass, MKL / packed: 12.0 / 9.3
at M = 1, 18.6 / 9.4 at 2, 21.6 / 11.3 at 4, 19.9 / 13.1 at 8, 44.6 / 37.3 at 64, 126 / 113 at
256; one GEMM of a 1024-token chunk at Qwen3-0.6B's widths runs at 86-99 GFLOP/s through MKL and
118-134 packed. Engine prefill steps of 4 x 256 tokens (alternated, medians of 4), MKL -> packed:
the bench model 626 -> 537 ms, Qwen3-0.6B's widths on 4 layers 1751 -> 1252 ms. On an AVX-512
Xeon the packed copies lost at one row (0.79x per decode step) and won only from M = 32 (1.1x).
The copy doubles the weights' memory, and oneDNN keeps what it builds for each input shape (~0.5-2
MiB): the worker caps those caches (``services/worker/__init__.py``). Its rounding is oneDNN's,
not MKL's: prefill logits move by ~1e-6 relative from transformers', within the bar (the engine
tier's exactness tests, hybrid model included, pass with the copies on every step).

**Batch copies** (``pack_batches``): MKL's own packed format (``cblas_sgemm_pack``, through
``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``), packed for ``BATCH_ROWS`` rows and
used inside ``few_rows`` at more than 8 rows (a decode batch), before a oneDNN copy. MKL's
``sgemm`` repacks the weight on every call, and at a decode batch that copy is much of the product
(``perf``, a 64-row decode step of the bench model on an AVX-512 Xeon: 24 % of the step in
``sgemm_scopy``). A pass over the bench model's 57 matrices (2 threads), ms, ``F.linear`` / copies
packed for 16, 64, 256 rows:

    M          9     16     32     64    128    256
    F.linear 10.6  14.3   16.7   22.5   39.1   62.9
    pack 16   9.5  10.3   14.5   21.1   40.3   66.5
    pack 64   9.1   9.8   12.0   16.6   35.9   59.4
    pack 256  9.8  10.5   12.8   17.5   34.5   53.9

(oneDNN's copies 18.9-20.5 ms at 64 rows). The products differ from ``F.linear``'s by rounding
(sometimes not at all: its own blocking at some shapes), ~3e-6 relative at most on random data.

The skinny kernel runs only where the build has AVX-512 (``pays``): it keeps 24 16-lane
accumulators and 4 operands in registers, which AVX-512's 32 hold and AVX2's 16 do not. On an
AVX2-only EPYC (2 threads, the 56 matrices without the LM head, warm) it spilled and lost to MKL,
ms per pass:

    M            1     2     4     8
    F.linear  10.4  17.5  16.7  14.3
    skinny    10.5  17.4  21.6  36.1
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused import usable
from kernels.native import load

ROWS = range(3, 9)  # the row counts that take the kernel (it takes 1..8; 1 and 2 measured no faster)
_scope = threading.local()  # .on: inside few_rows(True), on this thread


@contextmanager
def few_rows(on: bool) -> Iterator[None]:
    """Within the block (this thread only), ``linear`` takes the native kernel for ``ROWS`` rows;
    outside it, never. The engine turns it on for a forward with no prefill chunk."""
    before = getattr(_scope, "on", False)
    _scope.on = on
    try:
        yield
    finally:
        _scope.on = before


@functools.cache
def pays() -> bool:
    """Whether this machine's build of the kernel keeps its accumulators in registers (AVX-512)."""
    lib = load()
    return lib is not None and bool(lib.strata_skinny_linear_pays())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]``, ``weight [N, K]``."""
    if torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    decode = getattr(_scope, "on", False)
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    fp32_cpu = x.dtype == torch.float32 and x.device.type == "cpu"
    if decode and rows in getattr(weight, NATIVE, ()) and fp32_cpu:
        return _rows(x.reshape(rows, k).contiguous(), weight, bias).view(*x.shape[:-1], weight.shape[0])
    if decode and rows > BATCH_MIN_ROWS and fp32_cpu and (batched := getattr(weight, BATCHED, None)) is not None:
        return _batched(x.reshape(rows, k).contiguous(), batched, weight, bias).view(*x.shape[:-1], weight.shape[0])
    packed = getattr(weight, PACKED, None)
    if packed is not None and fp32_cpu and ("decode" if decode else "prefill") in getattr(weight, PACKED_STEPS, ()):
        return _packed(x.reshape(-1, k).contiguous(), packed, bias).view(*x.shape[:-1], weight.shape[0])
    if decode and rows in ROWS and pays() and fp32_cpu and usable(weight, *(() if bias is None else (bias,))):
        return _few_rows(x.reshape(rows, k).contiguous(), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The 16-lane native kernel on ``x [M, K]`` (contiguous, M in ``ROWS``); ``weight`` and
    ``bias`` as ``kernels.fused.usable`` takes them."""
    return _native("strata_skinny_linear_f32", x, weight, bias)


def _rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The 8-lane native kernel on ``x [M, K]`` (contiguous, M in ``NATIVE_ROWS``); ``weight`` and
    ``bias`` as ``mark_native`` marked them."""
    return _native("strata_rows_linear_f32", x, weight, bias)


def _packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K]`` (contiguous) times a weight's oneDNN-packed copy (``pack``), plus ``bias``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _batched(x: torch.Tensor, batched: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K]`` (contiguous) times a weight's MKL-packed copy (``pack_batches``), plus ``bias``."""
    return torch.ops.mkl._mkl_linear(x, batched, weight, bias, x.shape[0])


def _native(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lib = load()
    assert lib is not None
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
    getattr(lib, name)(
        x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
        weight.shape[0], x.shape[1],
    )  # fmt: skip
    return out


PACKED = "strata_packed"  # the attribute of a weight Parameter that holds its oneDNN-packed copy
PACKED_STEPS = "strata_packed_steps"  # on a packed weight: the steps that use the copy (in ``STEPS``)
STEPS = frozenset({"decode", "prefill"})  # decode: inside ``few_rows``; prefill: any other forward
NATIVE = "strata_native_rows"  # on a weight Parameter: the row counts whose products take ``_rows``
NATIVE_ROWS = frozenset(range(1, 9))  # what the 8-lane kernel takes
BATCHED = "strata_batch_packed"  # on a weight Parameter: its MKL-packed copy for decode batches
BATCH_ROWS = 64  # the rows MKL packs those copies for (they serve 9 to a few hundred rows)
BATCH_MIN_ROWS = max(NATIVE_ROWS)  # decode steps of more rows than this take the copies
TIMING_ROUNDS = 5  # passes of each side in the start-up timings (the fastest counts)


def pack(model: nn.Module, steps: frozenset[str] = STEPS) -> int:
    """Give each fp32 CPU weight of ``model``'s ``Linear`` layers a oneDNN-packed copy (kept where
    there is one), which ``linear`` uses in ``steps`` (a subset of ``STEPS``: inside ``few_rows``,
    outside it); returns the bytes the copies take."""
    total = 0
    with torch.no_grad():
        for w in _fp32_cpu_weights(model):
            if not hasattr(w, PACKED):
                setattr(w, PACKED, torch.ops.mkldnn._reorder_linear_weight(w.detach()))
            setattr(w, PACKED_STEPS, steps & STEPS)
            total += w.numel() * w.element_size()
    return total


def _fp32_cpu_weights(model: nn.Module) -> Iterator[torch.Tensor]:
    """The fp32 CPU weights of ``model``'s ``Linear`` layers (ours, not torch's own)."""
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.weight.dtype == torch.float32 and mod.weight.device.type == "cpu":
            yield mod.weight


def unpack(model: nn.Module) -> None:
    """Drop the packed copies ``pack`` made."""
    for mod in model.modules():
        if isinstance(mod, Linear) and hasattr(mod.weight, PACKED):
            delattr(mod.weight, PACKED)
            delattr(mod.weight, PACKED_STEPS)


def batches_packable() -> bool:
    """Whether this torch has MKL's packed GEMM (``cblas_sgemm_pack`` / ``_compute``)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def pack_batches(model: nn.Module) -> int:
    """Give each fp32 CPU weight of ``model``'s ``Linear`` layers an MKL-packed copy for decode
    batches (packed for ``BATCH_ROWS`` rows), which ``linear`` uses inside ``few_rows`` at more than
    ``BATCH_MIN_ROWS`` rows; returns the bytes the copies take (0 where MKL's packing is missing)."""
    if not batches_packable():
        return 0
    total = 0
    with torch.no_grad():
        for w in _fp32_cpu_weights(model):
            if not hasattr(w, BATCHED):
                setattr(w, BATCHED, torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), BATCH_ROWS))
            total += w.numel() * w.element_size()
    return total


def unpack_batches(model: nn.Module) -> None:
    """Drop the copies ``pack_batches`` made."""
    for mod in model.modules():
        if isinstance(mod, Linear) and hasattr(mod.weight, BATCHED):
            delattr(mod.weight, BATCHED)


def batch_timing(model: nn.Module, rows: int = 32, rounds: int = TIMING_ROUNDS) -> tuple[float, float]:
    """Seconds for one pass at ``rows`` rows (a decode batch) over every weight ``pack_batches``
    packed, as a decode step multiplies without the copies and with them (``_against_decode``)."""
    return _against_decode(model, BATCHED, rows, rounds, lambda x, w: _batched(x, getattr(w, BATCHED), w, None))


def mark_native(model: nn.Module, rows: frozenset[int] = NATIVE_ROWS) -> int:
    """Mark every fp32 CPU weight of ``model``'s ``Linear`` layers that the native 8-lane kernel
    takes: ``linear`` then uses it inside ``few_rows`` for ``rows`` rows (a subset of
    ``NATIVE_ROWS``; empty unmarks). Returns how many weights; 0 where the library is unavailable."""
    if load() is None:
        return 0
    marked = 0
    for mod in model.modules():
        if (
            isinstance(mod, Linear)
            and mod.weight.device.type == "cpu"
            and usable(mod.weight, *(() if mod.bias is None else (mod.bias,)))
        ):
            setattr(mod.weight, NATIVE, rows & NATIVE_ROWS)
            marked += 1
    return marked


def packed_timing(
    model: nn.Module, rows: int = 2, rounds: int = TIMING_ROUNDS, skip: Collection[nn.Module] = ()
) -> tuple[float, float]:
    """Seconds for one pass over every packed weight of ``model`` (but those of the layers in
    ``skip``) at ``rows`` rows (2: a small decode batch, the weights read from memory once; 64: a
    prefill chunk), with MKL on the plain weights and with the packed copies; the fastest of ``rounds``
    alternated passes of each (after one of each to warm up)."""
    pairs = [(m.weight, getattr(m.weight, PACKED)) for m in model.modules()
             if isinstance(m, Linear) and getattr(m.weight, PACKED, None) is not None
             and not any(m is s for s in skip)]  # fmt: skip
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w, _ in pairs}

    def mkl() -> None:
        for w, _ in pairs:
            F.linear(inputs[w.shape[1]], w)

    def packed() -> None:
        for w, p in pairs:
            _packed(inputs[w.shape[1]], p, None)

    return _alternated(mkl, packed, rounds)


def native_timing(model: nn.Module, rows: int, rounds: int = TIMING_ROUNDS) -> tuple[float, float]:
    """Seconds for one pass at ``rows`` rows (a small decode batch) over every weight
    ``mark_native`` marked, as a decode step multiplies without the kernel and with it
    (``_against_decode``)."""
    return _against_decode(model, NATIVE, rows, rounds, lambda x, w: _rows(x, w, None))


def _against_decode(
    model: nn.Module, marker: str, rows: int, rounds: int, candidate: Callable[[torch.Tensor, torch.Tensor], object]
) -> tuple[float, float]:
    """Seconds for one pass at ``rows`` rows over every weight of ``model``'s ``Linear`` layers
    that has attribute ``marker``: as a decode step multiplies without ``candidate`` (the oneDNN
    copy where decode steps keep it, else MKL on the plain weight), and with ``candidate(x, w)``;
    the fastest of ``rounds`` alternated passes of each."""
    weights = [m.weight for m in model.modules() if isinstance(m, Linear) and hasattr(m.weight, marker)]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def other() -> None:
        for w in weights:
            p = getattr(w, PACKED, None)
            if p is not None and "decode" in getattr(w, PACKED_STEPS, ()):
                _packed(inputs[w.shape[1]], p, None)
            else:
                F.linear(inputs[w.shape[1]], w)

    def with_candidate() -> None:
        for w in weights:
            candidate(inputs[w.shape[1]], w)

    return _alternated(other, with_candidate, rounds)


def _alternated(a: Callable[[], None], b: Callable[[], None], rounds: int) -> tuple[float, float]:
    """The fastest seconds of ``a`` and of ``b`` over ``rounds`` passes each, alternated (ABBA),
    after one of each to warm up. The fastest, not the median: what else runs on the machine only
    ever adds time, and a worker often starts beside a loaded stack (a restart under load). The
    bench model's 4-row gain of the native kernel, 15 times beside a process spinning 30 ms of
    every 60: 0.27-3.50 as the median of 3, 0.98-1.47 as the fastest of 7."""
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.inference_mode():
        for i in range(rounds + 1):
            for second in (False, True) if i % 2 == 0 else (True, False):
                t0 = time.perf_counter()
                (b if second else a)()
                if i:
                    times[second].append(time.perf_counter() - t0)
    return min(times[False]), min(times[True])


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``linear``: the same parameters and checkpoint names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
