"""Tune glibc's allocator for a process that runs CPU forwards.

A CPU forward allocates and frees tensors of megabytes many times per step (gathered keys, MLP
activations of a prefill chunk). glibc serves blocks above ``M_MMAP_THRESHOLD`` (128 KiB at start,
raised dynamically to at most 32 MiB) with a fresh ``mmap`` and returns freed heap tops above
``M_TRIM_THRESHOLD`` to the kernel, so the same buffers are faulted in page by page on every layer
of every step: measured on the bench model, a batch-64 decode step spent more than half its time
in those page faults (241 ms vs 105-125 ms with the thresholds below). Keeping blocks up to
``THRESHOLD_BYTES`` on the heap makes a freed buffer reusable at once. The cost is that the
process keeps the freed heap instead of returning it; the KV and Mamba pools are separate ``mmap``
reservations and are unaffected (they still give memory back).

What bounds the kept heap is the number of arenas. glibc gives a thread that finds its arena
busy a new one, up to 8 per core; each arena then keeps, free, up to the largest working set any
step ran in it. The worker runs every step on one engine thread (``WorkerServicer``), and caps
the arenas at ``ARENAS`` (``cap_arenas``, ``M_ARENA_MAX``, before any thread starts; a
``MALLOC_ARENA_MAX`` in the environment wins): the kept heap is then at most a couple of steps'
peak, whatever the run's length. Within those arenas, blocks of varying sizes still fragment the
free heap slowly; ``Trimmer`` gives free pages back (``malloc_trim``) at most every
``TRIM_EVERY_S`` when more than ``TRIM_MIN_FREE_BYTES`` are free: about 10 ms for 160 MB, so the
faults it costs are spread over many steps. Measured under the
L3 soak (docs/benchmarks.md, "Worker memory over an hour"): 12 arenas and a free heap that kept
growing with the default; flat with these settings.
"""

from __future__ import annotations

import logging
import os
import time

from services.common import glibc_heap

log = logging.getLogger(__name__)

THRESHOLD_BYTES = 1 << 30
ARENAS = 2
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_done = False


def _mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt``; False where there is none."""
    fn = getattr(glibc_heap.LIBC, "mallopt", None)
    return fn is not None and bool(fn(param, value))


def keep_large_blocks_on_heap() -> bool:
    """Set both thresholds (once per process); False where the C library is not glibc."""
    global _done
    if _done:
        return True
    if getattr(glibc_heap.LIBC, "mallopt", None) is None:
        log.info("no glibc mallopt here: allocator thresholds left as they are")
        return False
    _done = _mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES) and _mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES)
    return _done


TRIM_EVERY_S = 10.0
TRIM_MIN_FREE_BYTES = 64 << 20


class Trimmer:
    """Returns glibc's free heap to the kernel now and then; see the module docstring."""

    def __init__(self, every_s: float = TRIM_EVERY_S, min_free_bytes: int = TRIM_MIN_FREE_BYTES) -> None:
        self.every_s = every_s
        self.min_free_bytes = min_free_bytes
        self.trims = 0
        self._last = time.monotonic()
        self._trim = getattr(glibc_heap.LIBC, "malloc_trim", None)

    def maybe(self) -> bool:
        """Trim if it is time and enough is free; True if it trimmed."""
        now = time.monotonic()
        if self._trim is None or now - self._last < self.every_s:
            return False
        self._last = now
        if glibc_heap.heap().free_bytes < self.min_free_bytes:
            return False
        self._trim(0)
        self.trims += 1
        return True


def cap_arenas(n: int = ARENAS) -> bool:
    """At most ``n`` glibc arenas (unless ``MALLOC_ARENA_MAX`` is set). glibc fixes the limit the
    first time a thread needs a new arena, so this must run before the process starts threads
    that allocate: the worker calls it first thing in ``main``. False where it cannot apply."""
    return "MALLOC_ARENA_MAX" not in os.environ and _mallopt(_M_ARENA_MAX, n)
