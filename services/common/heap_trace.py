"""Opt-in allocation tracing for any service: ``STRATA_TRACEMALLOC_S=N`` (seconds).

With it set, the process starts ``tracemalloc`` and, every ``N`` seconds, logs its RSS, glibc's
heap (bytes in use, and free but kept), Python's allocated blocks, and the allocation sites whose
live bytes grew most since the first report (a warm-up baseline): the tool for "this service's RSS
creeps up by a few bytes per request — from where?". Growth in RSS and the heap's bytes in use
with none in the traced sites is native memory (a C extension's); growth in free heap alone is
the allocator keeping memory. Tracing slows Python down (roughly 2x) and costs memory of its own;
it is for diagnosis, never on by default.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import tracemalloc

import psutil

from services.common.glibc_heap import heap

log = logging.getLogger(__name__)

ENV = "STRATA_TRACEMALLOC_S"
ONLY_ENV = "STRATA_TRACEMALLOC_ONLY"  # comma-separated service names; unset = every service
FRAMES = 6  # stack depth kept per allocation: enough to see which caller owns a site
TOP = 10


def start_from_environment(service: str = "", environ: dict[str, str] | None = None) -> threading.Thread | None:
    """Start the tracer and its reporting thread when ``STRATA_TRACEMALLOC_S`` asks for it (and
    ``STRATA_TRACEMALLOC_ONLY``, when set, names ``service``)."""
    env = environ if environ is not None else os.environ
    value = env.get(ENV, "")
    only = [s.strip() for s in env.get(ONLY_ENV, "").split(",") if s.strip()]
    if not value or (only and service not in only):
        return None
    try:
        period = float(value)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; allocation tracing stays off", ENV, value)
        return None
    if period <= 0:
        return None
    tracemalloc.start(FRAMES)
    thread = threading.Thread(target=_report, args=(period,), name="heap-trace", daemon=True)
    thread.start()
    log.info("allocation tracing on: growth by site every %.0f s (%s)", period, ENV)
    return thread


def _report(period: float, stop: threading.Event | None = None) -> None:
    stop = stop or threading.Event()
    baseline: tracemalloc.Snapshot | None = None
    while not stop.wait(period):
        snap = tracemalloc.take_snapshot().filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))
        if baseline is None:
            baseline = snap
            log.info("allocation tracing: baseline of %.1f MiB traced", _total(snap) / 2**20)
            continue
        growth = snap.compare_to(baseline, "traceback")
        h = heap()
        log.info(
            "allocation tracing: RSS %.1f MiB, heap in use %.1f MiB, free %.1f MiB, %d Python blocks; "
            "%.1f MiB traced (%+.2f MiB since the baseline); top growth:",
            psutil.Process().memory_info().rss / 2**20, h.in_use_bytes / 2**20, h.free_bytes / 2**20,
            sys.getallocatedblocks(), _total(snap) / 2**20, (_total(snap) - _total(baseline)) / 2**20,
        )  # fmt: skip
        for stat in growth[:TOP]:
            frames = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in stat.traceback)
            log.info("  %+9.1f KiB %+7d blocks  %s", stat.size_diff / 1024, stat.count_diff, frames)


def _total(snap: tracemalloc.Snapshot) -> int:
    return sum(s.size for s in snap.statistics("filename"))
