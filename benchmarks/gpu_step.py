"""Engine step times on a GPU, and the attention kernels' HBM bandwidth against the device's copy rate.

    python -m benchmarks.gpu_step --model models/qwen3-bench --model models/qwen3-0.6b --out step.json

Run by ``benchmarks/gpu_check.py`` on a lent GPU (issue #32); on a CPU it runs the same code at the
sizes it is given (the torch attention references instead of the Triton kernels), which is how the
dry run of ``make test`` keeps it from rotting.

Per model, in ``--dtype`` (bf16 by default), one ``Engine`` on ``--device``:

- prefill: one cold prompt of ``--prefill`` tokens (4,096) in one step (forward and the sample of its
  last token), median of ``--repeats``; tokens/s = tokens / step;
- decode: ``--batches`` (1, 64, 256) requests with ``--context`` tokens (1,024) of KV each, prefilled
  in chunks first, then ``--warmup`` + ``--steps`` decode steps of the whole batch, each request
  feeding its last sample (``use_last_sample``, as overlap scheduling sends it); median step over the
  timed steps, tokens/s = batch / step, and the engine's own split (``forward_s``, ``sample_s``).

Step times are wall clock around ``Engine.step``, which returns once the sampled ids are on the host.

The attention kernels alone, for each model's shape (its query and KV heads, head dim; one layer),
called through the checked launchers with ``impl="auto"`` (Triton on a GPU):

- flat decode of ``--attn-batches`` (64, 256) requests of ``--attn-context`` (4,096) keys each, one
  contiguous run of slots per request: bytes = K and V of every key + the slot table + q + out;
- cascade decode of 256 requests in groups of 16 sharing ``--attn-context`` keys, then 64 keys of
  their own: bytes = the distinct K/V read (a shared prefix once) + table + q + out, and the bytes
  a flat decode of the same rows would read over the same time ("flat-equivalent");
- extend (a causal prefill) of ``--prefill`` tokens: TFLOP/s (2 · Hq · D · T² multiply-adds ×2).

Each bandwidth is also given as a fraction of the copy rate: a device-to-device copy of
``--copy-mib`` MiB, counted as bytes read + bytes written per second (the HBM traffic of a copy,
counted the same way as the kernels'). The goal of issue #32 is a flat decode at ≥ 70 % of it.
Kernel times are CUDA-event times (median of ``--repeats`` × 5 after a warm-up) on a GPU, wall clock
on a CPU.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.common.step import ReleaseRow, ReqInput, StepRequest  # noqa: E402
from services.worker.engine import Engine, EngineConfig  # noqa: E402
from services.worker.engine_config import DTYPES, DType  # noqa: E402

PREFILL_CHUNK_TOKENS = 16384  # tokens per step while filling a decode batch's KV
FLAT_DECODE_GOAL = 0.7  # issue #32: the flat decode's HBM bandwidth as a fraction of the copy rate
CASCADE_GROUP = 16  # requests per shared prefix in the cascade case
CASCADE_TAIL = 64  # keys of their own after the shared prefix


@dataclass(frozen=True, slots=True)
class Sizes:
    batches: tuple[int, ...] = (1, 64, 256)
    context: int = 1024
    prefill: int = 4096
    steps: int = 20
    warmup: int = 3
    repeats: int = 3
    attn_batches: tuple[int, ...] = (64, 256)
    attn_context: int = 4096
    cascade_batch: int = 256
    copy_mib: int = 1024


# --- timing ---------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_times(fn: Callable[[], object], device: torch.device, n: int) -> list[float]:
    """Seconds of ``n`` calls of ``fn`` after one warm-up call (CUDA events on a GPU)."""
    fn()
    sync(device)
    times = []
    for _ in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def copy_rate(device: torch.device, mib: int, n: int) -> float:
    """Bytes read + written per second by a device-to-device copy of ``mib`` MiB."""
    src = torch.ones(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = statistics.median(kernel_times(lambda: dst.copy_(src), device, n))
    return 2 * src.numel() / t


# --- the engine -----------------------------------------------------------------------------------


def kv_slot_bytes(config: dict[str, Any], dtype: torch.dtype) -> int:
    """Bytes of one token's K and V over every attention layer (what ``WorkerInfo.bytes_per_slot`` says)."""
    layers = config["num_hidden_layers"]
    if config.get("layer_types"):
        layers = sum(t == "full_attention" for t in config["layer_types"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * layers * config["num_key_value_heads"] * head_dim * torch.finfo(dtype).bits // 8


@dataclass(frozen=True, slots=True)
class StepFigure:
    kind: str  # "prefill" | "decode"
    batch: int
    context: int  # tokens of KV per request at the first timed step (prefill: the prompt)
    step_ms: float  # median
    min_ms: float
    max_ms: float
    tokens_per_s: float
    forward_ms: float  # the engine's own forward_s, median
    sample_ms: float


def _figure(kind: str, batch: int, context: int, tokens: int, times: list[float], fwd: list[float],
            smp: list[float]) -> StepFigure:  # fmt: skip
    med = statistics.median(times)
    return StepFigure(kind, batch, context, med * 1e3, min(times) * 1e3, max(times) * 1e3, tokens / med,
                      statistics.median(fwd) * 1e3, statistics.median(smp) * 1e3)  # fmt: skip


class StepBench:
    """One engine with room for the largest decode batch; hands out rows and slots like a scheduler."""

    def __init__(self, model: Path, device: str, dtype: str, sizes: Sizes, seed: int = 0) -> None:
        config = json.loads((model / "config.json").read_text())
        self.sizes = sizes
        rows = max(sizes.batches)
        per_row = sizes.context + sizes.warmup + sizes.steps + 1
        slots = max(rows * per_row, sizes.prefill) + 1
        slot_bytes = kv_slot_bytes(config, DTYPES[dtype])
        self.engine = Engine(model, EngineConfig(
            device=device, dtype=cast(DType, dtype), kv_cache_bytes=slots * slot_bytes + (1 << 20), max_rows=rows,
            max_context=max(per_row, sizes.prefill) + 1,
        ))
        if self.engine.info.num_slots < slots:
            raise RuntimeError(f"the KV pool holds {self.engine.info.num_slots} slots, {slots} needed")
        self.device = self.engine.device
        self.vocab = self.engine.info.vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        self._step = itertools.count()

    def ids(self, n: int) -> list[int]:
        return torch.randint(3, min(self.vocab, 8000), (n,), generator=self.gen).tolist()

    def _run(self, reqs: list[ReqInput], ops: list[Any] | None = None) -> tuple[float, float, float]:
        sync(self.device)
        t0 = time.perf_counter()
        r = self.engine.step(StepRequest(next(self._step), ops=ops or [], reqs=reqs))
        return time.perf_counter() - t0, r.forward_s, r.sample_s

    def release(self, rows: int) -> None:
        self._run([], [ReleaseRow(b) for b in range(rows)])

    def prefill(self) -> StepFigure:
        n = self.sizes.prefill
        times, fwd, smp = [], [], []
        for i in range(self.sizes.repeats + 1):  # the first one warms up
            t, f, s = self._run([ReqInput("p", 0, self.ids(n), 0, list(range(1, n + 1)))])
            self.release(1)
            if i:
                times.append(t)
                fwd.append(f)
                smp.append(s)
        return _figure("prefill", 1, n, n, times, fwd, smp)

    def decode(self, batch: int) -> StepFigure:
        ctx, slot = self.sizes.context, itertools.count(1)
        per_step = max(1, PREFILL_CHUNK_TOKENS // ctx)
        for first in range(0, batch, per_step):
            rows = range(first, min(batch, first + per_step))
            self._run([ReqInput(f"r{b}", b, self.ids(ctx), 0, [next(slot) for _ in range(ctx)]) for b in rows])
        times, fwd, smp = [], [], []
        for k in range(self.sizes.warmup + self.sizes.steps):
            reqs = [ReqInput(f"r{b}", b, [], ctx + k, [next(slot)], use_last_sample=True, output_index=k + 1)
                    for b in range(batch)]  # fmt: skip
            t, f, s = self._run(reqs)
            if k >= self.sizes.warmup:
                times.append(t)
                fwd.append(f)
                smp.append(s)
        self.release(batch)
        return _figure("decode", batch, ctx + self.sizes.warmup, batch, times, fwd, smp)


# --- the attention kernels ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KernelFigure:
    kernel: str  # "decode" | "cascade_decode" | "extend"
    batch: int
    context: int  # keys per request (extend: the prompt)
    us: float  # median
    gbs: float  # HBM bytes per second (extend: 0)
    fraction_of_copy: float  # gbs / copy rate (extend: 0)
    tflops: float  # extend only
    flat_equivalent_fraction: float = 0.0  # cascade: the flat decode's bytes over this time, / copy rate


def attention_figures(hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device, sizes: Sizes,
                      copy_bps: float) -> list[KernelFigure]:  # fmt: skip
    from kernels.attention.launch import cascade_decode_attention, decode_attention, extend_attention
    from kernels.attention.prefix_groups import PrefixGroups

    n = 5 * sizes.repeats
    item = torch.finfo(dtype).bits // 8
    scale = d**-0.5
    out: list[KernelFigure] = []

    def kv(slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(slots, hkv, d, device=device, dtype=dtype),
                torch.randn(slots, hkv, d, device=device, dtype=dtype))  # fmt: skip

    ctx = sizes.attn_context
    for batch in sizes.attn_batches:
        k_cache, v_cache = kv(batch * ctx + 1)
        table = torch.arange(1, batch * ctx + 1, device=device).view(batch, ctx)
        rows = torch.arange(batch, device=device)
        seq = torch.full((batch,), ctx, device=device)
        q = torch.randn(batch, hq, d, device=device, dtype=dtype)
        t = statistics.median(kernel_times(
            lambda: decode_attention(q, k_cache, v_cache, table, rows, seq, scale), device, n))  # noqa: B023
        nbytes = 2 * batch * ctx * hkv * d * item + batch * ctx * 8 + 2 * batch * hq * d * item
        out.append(KernelFigure("decode", batch, ctx, t * 1e6, nbytes / t / 1e9, nbytes / t / copy_bps, 0.0))
        del k_cache, v_cache, table

    batch = sizes.cascade_batch
    groups = batch // CASCADE_GROUP
    if groups:
        distinct = groups * ctx + batch * CASCADE_TAIL
        k_cache, v_cache = kv(distinct + 1)
        width = ctx + CASCADE_TAIL
        table = torch.empty(batch, width, dtype=torch.int64, device=device)
        for b in range(batch):
            g = b // CASCADE_GROUP
            table[b, :ctx] = torch.arange(1 + g * ctx, 1 + (g + 1) * ctx, device=device)
            own = 1 + groups * ctx + b * CASCADE_TAIL
            table[b, ctx:] = torch.arange(own, own + CASCADE_TAIL, device=device)
        rows = torch.arange(batch, device=device)
        seq = torch.full((batch,), width, device=device)
        q = torch.randn(batch, hq, d, device=device, dtype=dtype)
        pg = PrefixGroups.from_lists(
            [(list(range(g * CASCADE_GROUP, (g + 1) * CASCADE_GROUP)), ctx) for g in range(groups)], batch, device)
        t = statistics.median(kernel_times(
            lambda: cascade_decode_attention(q, k_cache, v_cache, table, rows, seq, pg, scale), device, n))
        nbytes = 2 * distinct * hkv * d * item + batch * width * 8 + 2 * batch * hq * d * item
        flat = 2 * batch * width * hkv * d * item
        out.append(KernelFigure("cascade_decode", batch, width, t * 1e6, nbytes / t / 1e9, nbytes / t / copy_bps,
                                0.0, flat / t / copy_bps))  # fmt: skip
        del k_cache, v_cache, table

    tokens = sizes.prefill
    k_cache, v_cache = kv(tokens + 1)
    table = torch.arange(1, tokens + 1, device=device).view(1, tokens)
    q = torch.randn(tokens, hq, d, device=device, dtype=dtype)
    zero, lens = torch.zeros(1, dtype=torch.int64, device=device), torch.full((1,), tokens, device=device)
    t = statistics.median(kernel_times(
        lambda: extend_attention(q, k_cache, v_cache, table, zero, zero, lens, scale), device, max(3, n // 2)))
    flops = 2 * 2 * hq * d * tokens * tokens / 2  # QK^T and PV, causal: half the square
    out.append(KernelFigure("extend", 1, tokens, t * 1e6, 0.0, 0.0, flops / t / 1e12))
    return out


# --- the run --------------------------------------------------------------------------------------


def bench_model(model: Path, device: str, dtype: str, sizes: Sizes, copy_bps: float,
                say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    config = json.loads((model / "config.json").read_text())
    t0 = time.perf_counter()
    bench = StepBench(model, device, dtype, sizes)
    say(f"{model.name}: engine on {bench.device} ({dtype}) in {time.perf_counter() - t0:.1f}s")
    steps = [bench.prefill()]
    say(f"  prefill {sizes.prefill}: {steps[-1].step_ms:.1f} ms")
    for batch in sizes.batches:
        steps.append(bench.decode(batch))
        say(f"  decode batch {batch}: {steps[-1].step_ms:.2f} ms, {steps[-1].tokens_per_s:.0f} tok/s")
    del bench  # its pools go before the kernels' tensors come
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    shape = (config["num_attention_heads"], config["num_key_value_heads"], head_dim)
    kernels = attention_figures(*shape, DTYPES[dtype], torch.device(device), sizes, copy_bps)
    for k in kernels:
        rate = (f"{k.tflops:.1f} TFLOP/s" if k.kernel == "extend"
                else f"{k.gbs:.0f} GB/s, {k.fraction_of_copy:.0%} of copy")  # fmt: skip
        say(f"  {k.kernel} x{k.batch} over {k.context} keys: {k.us:.0f} us, {rate}")
    return {
        "dtype": dtype,
        "shape": {"layers": config["num_hidden_layers"], "hidden": config["hidden_size"], "heads": shape[0],
                  "kv_heads": shape[1], "head_dim": shape[2], "vocab": config["vocab_size"]},
        "steps": [asdict(s) for s in steps],
        "attention": [asdict(k) for k in kernels],
    }  # fmt: skip


def table(result: dict[str, Any]) -> str:
    rows = ["| model | step | batch | KV per request | ms (min–max) | tok/s | forward ms | sample ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in result["models"].items():
        for s in m["steps"]:
            rows.append(f"| {name} | {s['kind']} | {s['batch']} | {s['context']} | {s['step_ms']:.2f} "
                        f"({s['min_ms']:.2f}–{s['max_ms']:.2f}) | {s['tokens_per_s']:.0f} | {s['forward_ms']:.2f} | "
                        f"{s['sample_ms']:.2f} |")  # fmt: skip
    rows += ["", f"copy rate {result['copy_gbs']:.0f} GB/s (read + written)", "",
             "| model shape | kernel | batch | keys | µs | GB/s | of copy | TFLOP/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in result["models"].items():
        for k in m["attention"]:
            frac = f"{k['fraction_of_copy']:.0%}" if k["gbs"] else ""
            if k["flat_equivalent_fraction"]:
                frac += f" (flat-equivalent {k['flat_equivalent_fraction']:.0%})"
            rows.append(f"| {name} | {k['kernel']} | {k['batch']} | {k['context']} | {k['us']:.0f} | "
                        f"{k['gbs']:.0f} | {frac} | {k['tflops']:.1f} |")  # fmt: skip
    return "\n".join(rows)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, action="append", required=True, help="a checkpoint (repeatable)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    d = Sizes()
    p.add_argument("--batches", type=_ints, default=d.batches, help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=d.context, help="KV tokens per decoding request")
    p.add_argument("--prefill", type=int, default=d.prefill, help="tokens of the cold prefill (and of the extend)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--attn-batches", type=_ints, default=d.attn_batches)
    p.add_argument("--attn-context", type=int, default=d.attn_context)
    p.add_argument("--cascade-batch", type=int, default=d.cascade_batch, help="0 = no cascade case")
    p.add_argument("--copy-mib", type=int, default=d.copy_mib)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    a = p.parse_args(argv)
    sizes = Sizes(a.batches, a.context, a.prefill, a.steps, a.warmup, a.repeats, a.attn_batches, a.attn_context,
                  a.cascade_batch, a.copy_mib)  # fmt: skip
    device = torch.device(a.device)
    copy_bps = copy_rate(device, sizes.copy_mib, 10)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}: copy {copy_bps / 1e9:.0f} GB/s (read + written)", flush=True)
    result: dict[str, Any] = {"device": name, "copy_gbs": copy_bps / 1e9, "sizes": asdict(sizes),
                              "flat_decode_goal": FLAT_DECODE_GOAL, "models": {}}  # fmt: skip
    for model in a.model:
        result["models"][model.name] = bench_model(model, a.device, a.dtype, sizes, copy_bps,
                                                   lambda line: print(line, flush=True))  # fmt: skip
    print(table(result))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
