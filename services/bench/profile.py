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
) -> str:
    """Run ``workload`` once on ``engine`` under two profilers; return the printable report
    (``top`` functions per thread, paths relative to the working directory)."""
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
    return "\n".join(parts)


def _trim_profile(text: str) -> str:
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if "function calls" in ln), 0)
    return "\n".join(ln.replace(str(Path.cwd()) + "/", "") for ln in lines[start:] if ln.strip())
