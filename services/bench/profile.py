"""A cProfile of one in-process run, split by thread: the engine thread (``Engine.step``: forward +
sample) and the event-loop thread (scheduler, asyncio, the driver), each sorted by own time."""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
from pathlib import Path
from typing import Any

from services.bench.metrics import summarize
from services.bench.runner import InProcessBackend, ProfiledEngine, replay, warm_up
from services.bench.workloads import Workload
from services.scheduler.loop import LoopConfig


def profile_in_process(
    engine: Any,
    loop_cfg: LoopConfig,
    workload: Workload,
    concurrency: int,
    vocab_size: int,
    top: int,
    timeout_s: float | None = None,
) -> tuple[str, float]:
    """Run ``workload`` once on ``engine`` under two profilers; return the printable report
    (``top`` functions per thread, paths relative to the working directory) and the share of the
    engine's step time spent in attention (``attention_share``)."""
    loop_prof, engine_prof = cProfile.Profile(), cProfile.Profile()
    profiled = ProfiledEngine(engine, engine_prof)

    async def go() -> tuple[list[Any], float]:
        async with InProcessBackend(profiled, loop_cfg, "profile") as b:
            await warm_up(b, vocab_size)
            return await replay(b, workload, concurrency, timeout_s=timeout_s)

    loop_prof.enable()
    records, duration = asyncio.run(go())
    loop_prof.disable()
    m = summarize("profile", records, duration)
    parts = [f"run: {m.requests} requests in {duration:.2f}s ({m.total_throughput:.0f} tok/s total)"]
    for name, prof in (("engine thread (Engine.step)", engine_prof), ("event-loop thread", loop_prof)):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        parts.append(f"--- {name}\n{_trim_profile(buf.getvalue())}")
    share = attention_share(pstats.Stats(engine_prof))
    parts.append(f"--- attention: {share:.1%} of engine step time")
    return "\n".join(parts), share


# The top-level attention entry points of every path (each layer calls exactly one of them).
_ATTENTION_FUNCS = ("run_attention", "decode_attention", "extend_attention", "decode_attention_torch",
                    "extend_attention_torch", "cascade_decode_attention")


def attention_share(stats: pstats.Stats) -> float:
    """Cumulative time in the attention entry points of ``kernels/`` over the cumulative time of the
    engine's ``step``; the launchers of one path never call each other's entry points, except a
    launcher calling its own torch reference (counted once: only the outermost is summed)."""
    table = stats.stats  # type: ignore[attr-defined]
    attention = step = 0.0
    for (path, _line, name), (_cc, _nc, _tt, ct, callers) in table.items():
        if name == "step" and path.endswith("services/worker/engine.py"):
            step = max(step, ct)
        elif "/kernels/" in path and name in _ATTENTION_FUNCS:
            nested = any(c[2] in _ATTENTION_FUNCS and "/kernels/" in c[0] for c in callers)
            attention += 0.0 if nested else ct
    return attention / step if step else 0.0


def _trim_profile(text: str) -> str:
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if "function calls" in ln), 0)
    return "\n".join(ln.replace(str(Path.cwd()) + "/", "") for ln in lines[start:] if ln.strip())
