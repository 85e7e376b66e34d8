"""Where an engine decode step's time goes on a GPU: torch's profiler over a few steps.

    python -m benchmarks.gpu_profile --model models/qwen3-bench --batches 1,64 --out profile.txt

For each batch size (``StepBench`` of benchmarks/gpu_step.py: ``--context`` tokens of KV per request,
``use_last_sample`` decodes as overlap sends them), after warm-up steps, ``--steps`` decode steps
under ``torch.profiler``; writes per batch: wall ms per step, device-busy ms per step (the sum of
kernel times), kernels launched per step, the operators by self CPU time and by device time, and
(``cProfile``, ``--steps`` more steps) the host's Python functions by their own time.
A step whose wall time is far above its device time is bound by the host (Python, launches,
synchronisations), not by the GPU. ``--fused off`` (or ``both``: each batch twice, alternated) runs
the layers' torch chains instead of the fused Triton kernels (``kernels/fused_triton.py``), to
measure what they save; ``--graphs off`` (or ``both``) runs the decode steps eagerly instead of
replaying their CUDA graphs (services/worker/cuda_graphs.py). Runs on the CPU too (no device
columns, no graphs), at whatever sizes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from kernels import fused_triton

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_step import Sizes, StepBench, sync  # noqa: E402
from services.common.step import ReqInput  # noqa: E402
from services.worker.engine_config import DTYPES  # noqa: E402

ROWS = 25  # operators listed per table


def profile_decode(bench: StepBench, batch: int, steps: int, warmup: int) -> str:
    ctx, slot = bench.sizes.context, iter(range(1, 1 << 30))
    bench._run([ReqInput(f"r{b}", b, bench.ids(ctx), 0, [next(slot) for _ in range(ctx)]) for b in range(batch)])

    def step(k: int) -> None:
        bench._run([ReqInput(f"r{b}", b, [], ctx + k, [next(slot)], use_last_sample=True, output_index=k + 1)
                    for b in range(batch)])  # fmt: skip

    for k in range(warmup):
        step(k)
    on_gpu = bench.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sync(bench.device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for k in range(warmup, warmup + steps):
            step(k)
        sync(bench.device)
    wall = (time.perf_counter() - t0) / steps
    py = cProfile.Profile()  # the host side by Python function (Triton's launchers, the engine's own code)
    py.enable()
    for k in range(warmup + steps, warmup + 2 * steps):
        step(k)
    sync(bench.device)
    py.disable()
    host = io.StringIO()
    pstats.Stats(py, stream=host).sort_stats("tottime").print_stats(ROWS)
    bench.release(batch)
    events = prof.key_averages()
    lines = [f"## decode batch {batch}, {ctx} tokens of KV: {wall * 1e3:.2f} ms per step (wall, profiled)"]
    if on_gpu:
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy = sum(e.device_time for e in kernels) / steps / 1e3
        lines.append(f"device busy {busy:.2f} ms per step, {len(kernels) / steps:.0f} kernels per step")
        lines += ["", events.table(sort_by="self_device_time_total", row_limit=ROWS)]
    lines += [
        "",
        events.table(sort_by="self_cpu_time_total", row_limit=ROWS),
        "",
        f"cProfile, {steps} steps:",
        host.getvalue(),
    ]
    return "\n".join(lines)


def fused_off(off: bool) -> None:
    """The layers take the fused Triton kernels where ``fused_triton.usable`` says so: off, never."""
    fused_triton.usable = _never if off else _USABLE  # type: ignore[assignment]


_USABLE = fused_triton.usable


def _never(*tensors: object) -> bool:
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--batches", default="1,64", help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=1024, help="KV tokens per decoding request")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--fused",
        choices=("on", "off", "both"),
        default="on",
        help="the fused Triton kernels in the layers (both: each batch with them, then without)",
    )
    p.add_argument("--graphs", choices=("on", "off", "both"), default="on",
                   help="the decode steps' CUDA graphs (both: each batch with them, then without)")
    p.add_argument("--out", type=Path, default=None, help="also write the report here")
    a = p.parse_args(argv)
    batches = tuple(int(x) for x in a.batches.split(",") if x)
    sizes = Sizes(batches=batches, context=a.context, prefill=a.context, steps=2 * a.steps, warmup=a.warmup)
    bench = StepBench(a.model, a.device, a.dtype, sizes)
    modes = {"on": (False,), "off": (True,), "both": (False, True)}
    graphs = bench.engine.graphs
    parts = []
    for b in batches:
        for graphs_off in modes[a.graphs]:
            for off in modes[a.fused]:
                fused_off(off)
                bench.engine.graphs = None if graphs_off else graphs
                used = "on" if bench.engine.graphs is not None else "off"
                head = f"# fused Triton kernels {'off' if off else 'on'}, CUDA graphs {used}\n"
                parts.append(head + profile_decode(bench, b, a.steps, a.warmup))
    fused_off(False)
    bench.engine.graphs = graphs
    report = "\n\n".join(parts)
    print(report)
    if a.out is not None:
        a.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
