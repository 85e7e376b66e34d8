"""What the worker's memory is made of: the allocator's view, the Python heap and live tensors.

RSS alone cannot tell a leak (objects kept alive) from the allocator holding freed memory. The
report separates them:

- glibc's ``mallinfo2``: bytes the heap arenas hold from the system (``arena``), of which in use
  (``in_use``) and free (``free``: kept for reuse, not returned), plus blocks served by ``mmap``;
  ``malloc_info`` gives the same per arena, and the number of arenas;
- the Python heap: ``sys.getallocatedblocks`` (pymalloc blocks), and ``tracemalloc``'s current
  bytes when it runs (``PYTHONTRACEMALLOC``);
- live tensors, found through the garbage collector and counted once per storage, with their
  bytes (the KV, Mamba and host pools among them: they are fixed, so growth here is tensors kept
  past their step).

``mallinfo`` and ``arenas`` are cheap (the metrics use them); ``tensors`` walks every object
(tens of milliseconds with the GIL held), so only the diagnostic RPC and the soak call it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import re
import sys
import tempfile
import tracemalloc
import warnings
from dataclasses import dataclass

import psutil
import torch


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


LIBC = _libc()  # the C library, for mallinfo2 / malloc_info here and mallopt / malloc_trim in host_malloc


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


@dataclass(frozen=True, slots=True)
class Tensors:
    count: int  # distinct storages
    nbytes: int


def tensors() -> Tensors:
    """Live tensors' storages on any device, each counted once."""
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in found:
        if o.is_meta:
            continue
        try:
            s = o.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        seen[s.data_ptr()] = s.nbytes()
    return Tensors(len(seen), sum(seen.values()))


@dataclass(frozen=True, slots=True)
class MemoryReport:
    rss_bytes: int
    heap: Heap
    arena_bytes: list[int]  # per arena, main first (arena_sizes)
    python_blocks: int  # sys.getallocatedblocks()
    traced_bytes: int  # tracemalloc's current total; 0 when it is not tracing
    tensors: Tensors
    threads: int


def report() -> MemoryReport:
    traced = tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0
    return MemoryReport(
        psutil.Process(os.getpid()).memory_info().rss,
        heap(),
        arena_sizes(),
        sys.getallocatedblocks(),
        traced,
        tensors(),
        psutil.Process(os.getpid()).num_threads(),
    )
