"""Tune glibc's allocator for a process that runs CPU forwards.

A CPU forward allocates and frees tensors of megabytes many times per step (gathered keys, MLP
activations of a prefill chunk). glibc serves blocks above ``M_MMAP_THRESHOLD`` (128 KiB at start,
raised dynamically to at most 32 MiB) with a fresh ``mmap`` and returns freed heap tops above
``M_TRIM_THRESHOLD`` to the kernel, so the same buffers are faulted in page by page on every layer
of every step: measured on the bench model, a batch-64 decode step spent more than half its time
in those page faults (241 ms vs 105-125 ms with the thresholds below). Keeping blocks up to
``THRESHOLD_BYTES`` on the heap makes a freed buffer reusable at once. The cost is that the
process keeps up to ``THRESHOLD_BYTES`` of freed heap instead of returning it; the KV and Mamba
pools are separate ``mmap`` reservations and are unaffected (they still give memory back).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_large_blocks_on_heap() -> bool:
    """Set both thresholds (once per process); False where the C library is not glibc."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt here: allocator thresholds left as they are")
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES))
    _done = ok
    return ok
