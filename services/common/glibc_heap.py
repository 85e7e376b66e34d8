"""glibc's heap, as the process sees it: ``mallinfo2`` totals and ``malloc_info`` per arena.

RSS alone cannot tell live memory from memory the allocator keeps: ``heap()`` separates bytes in
use from bytes free but held, and ``arena_sizes()`` shows how they spread over arenas. All zero /
empty where the C library is not glibc (>= 2.33 for ``mallinfo2``). Used by the worker's memory
report and metrics and by the allocation tracer of every service (``heap_trace``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import tempfile
from dataclasses import dataclass


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]  # fmt: skip


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


LIBC = _libc()  # the C library: mallinfo2 / malloc_info here, mallopt / malloc_trim in host_malloc


@dataclass(frozen=True, slots=True)
class Heap:
    """glibc's heap, summed over arenas (all zero where the C library is not glibc >= 2.33)."""

    arena_bytes: int  # obtained from the system by the arenas (sbrk and arena heaps)
    in_use_bytes: int  # of which handed out by malloc
    free_bytes: int  # of which free, kept for reuse
    mmap_bytes: int  # blocks served by their own mmap (above the mmap threshold)


def heap() -> Heap:
    fn = getattr(LIBC, "mallinfo2", None)
    if fn is None:
        return Heap(0, 0, 0, 0)
    fn.restype = _Mallinfo2
    m = fn()
    return Heap(m.arena, m.uordblks, m.fordblks, m.hblkhd)


_HEAP_RE = re.compile(r'<heap nr="(\d+)">.*?<system type="current" size="(\d+)"/>', re.S)


def arena_sizes() -> list[int]:
    """Bytes each arena holds from the system, in arena order (``malloc_info``; [] if unavailable)."""
    if LIBC is None or not hasattr(LIBC, "malloc_info"):
        return []
    fopen, fclose = LIBC.fopen, LIBC.fclose
    fopen.restype = ctypes.c_void_p
    fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    fclose.argtypes = [ctypes.c_void_p]
    LIBC.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    with tempfile.NamedTemporaryFile("r", suffix=".xml") as f:
        fp = fopen(f.name.encode(), b"w")
        if not fp:
            return []
        try:
            LIBC.malloc_info(0, fp)
        finally:
            fclose(fp)
        xml = f.read()
    return [int(size) for _, size in _HEAP_RE.findall(xml)]
