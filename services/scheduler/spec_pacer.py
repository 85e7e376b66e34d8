"""Whether drafting pays, measured: the decode token rate with drafts and without, per batch size.

What a verify step costs against a decode step depends on the device, the model and the batch,
not on the acceptance alone. On 2 CPU cores prompt lookup at batch 1 made a looping answer 1.5x
faster; on an H100 the same workload at 0.83 acceptance ran at 0.54x, because a decode step
replays a CUDA graph while a verify step runs eagerly, and a drafting request gives up overlap
(docs/benchmarks.md, "GPU, fourth loan"). So the scheduler measures instead of assuming.

For each batch-size bucket (1, 2, 3-4, 5-8, ... decoding requests) the pacer alternates between
*windows* of ``window`` pure decode steps with drafting on and with it off, and keeps a running
rate for each: output tokens committed over the wall time between commits (so a verify's own
cost, the overlap it gives up and the tokens it keeps all count). Drafting stays in the faster
mode; the slower one is tried again for one window after 4 windows, then 8, ... up to
``max_probe_every`` while it stays slower (back to 4 when a try reverses the choice). Steps with a
prefill, after an idle pause, or just after the mode or the bucket changed (their step was planned
before: ``settle``) are not counted, nor is a *stall*: a step over ``stall`` (20) times its
window's median (a first-call compile, a page-in, a pause of the process). A stall is no cost of
the mode, and a rate that kept it would keep the mode it hit off for many windows: on an H100 the
first verify steps of a stack took 1.5 s for 16 steps (Triton compiling their shapes) against
~0.1 s later.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

PROBE_EVERY = 4  # windows in the faster mode before the slower one is tried again, at first


@dataclass(slots=True)
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # drafting? -> tokens/s, a running mean over windows
    on: bool = True  # drafting in this bucket now
    probing: bool = False  # this window tries the mode that was slower
    probe_every: int = PROBE_EVERY
    since_probe: int = 0
    window: list[tuple[float, int]] = field(default_factory=list)  # the open window: (seconds, tokens) per step


@dataclass(slots=True)
class PacerCounters:
    windows_on: int = 0  # windows measured with drafting on
    windows_off: int = 0  # ... and off


def bucket_of(n: int) -> int:
    """0 for one decoding request, 1 for two, 2 for 3-4, 3 for 5-8, ..."""
    return max(n - 1, 0).bit_length()


class Pacer:
    """Drafting on or off per batch-size bucket, from measured token rates (see the module doc)."""

    def __init__(self, window: int = 16, settle: int = 2, margin: float = 1.02, max_probe_every: int = 64,
                 stall: float = 20.0, clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        """``margin``: drafting must be this much faster to stay on (ties go to plain decode, which
        keeps overlap and costs no drafting time). ``stall``: a step this many times its window's
        median is left out: far above what a verify step costs against a decode (1.4x on 2 CPU
        cores, ~3-8x a graphed decode on an H100)."""
        if window < 1 or settle < 0 or margin < 1.0 or max_probe_every < PROBE_EVERY or stall <= 1.0:
            raise ValueError(f"pacer: window {window}, settle {settle}, margin {margin}, "
                             f"max_probe_every {max_probe_every}, stall {stall} out of range")  # fmt: skip
        self.window, self.settle, self.margin, self.max_probe_every = window, settle, margin, max_probe_every
        self.stall = stall
        self.clock = clock
        self.counters = PacerCounters()
        self._buckets: dict[int, _Bucket] = {}
        self._last: float | None = None  # the previous commit
        self._prev: tuple[int, bool] | None = None  # (bucket, mode) of the previous counted step
        self._settling = 0

    def _bucket(self, key: int) -> _Bucket:
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket()
        return b

    def allows(self, n: int) -> bool:
        """Whether requests draft while ``n`` requests decode."""
        return self._bucket(bucket_of(n)).on

    def observe(self, n: int, tokens: int, counted: bool) -> None:
        """A step was committed: ``tokens`` output tokens while ``n`` requests decode. ``counted``:
        a pure decode step that followed another step without an idle pause."""
        now, last = self.clock(), self._last
        self._last = now
        if not counted or last is None or n < 1 or tokens < 1:
            self._prev = None
            return
        key = bucket_of(n)
        b = self._bucket(key)
        state = (key, b.on)
        if state != self._prev:
            self._prev, self._settling = state, self.settle
        if self._settling > 0:
            self._settling -= 1
            return
        b.window.append((now - last, tokens))
        if len(b.window) >= self.window:
            self._close(b)

    def _close(self, b: _Bucket) -> None:
        """End ``b``'s window: fold its rate in, then choose the next window's mode."""
        limit = self.stall * statistics.median(t for t, _ in b.window)
        kept = [(t, n) for t, n in b.window if t <= limit]
        seconds, tokens = sum(t for t, _ in kept), sum(n for _, n in kept)
        rate = tokens / seconds if seconds > 0 else 0.0
        old = b.rate.get(b.on)
        b.rate[b.on] = rate if old is None else 0.5 * old + 0.5 * rate
        log.debug("pacer: a window with drafting %s: %d tokens in %d steps (%d stalls left out), %.1f ms: "
                  "%.0f tokens/s (mean %.0f, other %s)", "on" if b.on else "off", tokens, len(kept),
                  len(b.window) - len(kept), 1e3 * seconds, rate, b.rate[b.on],
                  f"{b.rate[not b.on]:.0f}" if (not b.on) in b.rate else "-")  # fmt: skip
        if b.on:
            self.counters.windows_on += 1
        else:
            self.counters.windows_off += 1
        b.window.clear()
        if (not b.on) not in b.rate:  # the other mode has no rate yet: measure it
            b.on = not b.on
            return
        faster = b.rate[True] > self.margin * b.rate[False]
        if b.probing:
            b.probing = False
            reversed_ = faster == b.on
            b.probe_every = PROBE_EVERY if reversed_ else min(2 * b.probe_every, self.max_probe_every)
            b.on = faster
            b.since_probe = 0
            return
        if faster != b.on:
            b.on, b.since_probe = faster, 0
            return
        b.since_probe += 1
        if b.since_probe >= b.probe_every:
            b.on, b.probing, b.since_probe = not b.on, True, 0
