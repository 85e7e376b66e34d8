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
(tens of milliseconds with the GIL held), so only the diagnostic RPC and the soak call it. It
leaves the frozen heap (``settle_heap``) as it is.
"""

from __future__ import annotations

import gc
import os
import sys
import tracemalloc
import warnings
import weakref
from dataclasses import dataclass

import psutil
import torch

from services.common.glibc_heap import Heap, arena_sizes, heap


@dataclass(frozen=True, slots=True)
class Tensors:
    count: int  # distinct storages
    nbytes: int


_frozen: list[weakref.ref[torch.Tensor]] = []  # the tensors alive when the heap was frozen


def remember_frozen() -> None:
    """Call just before ``settle_heap`` freezes the heap: the tensors alive now (weights, pools)
    leave ``gc.get_objects()`` then, so ``tensors`` finds them through weak references instead.
    (Thawing and freezing again at each report would freeze whatever was alive at that moment,
    for good: a cycle among a step's objects then outlives the step, and the worker grew by tens
    of KiB per report under load.)"""
    _frozen[:] = [weakref.ref(t) for t in _live_tensors()]


def _live_tensors() -> list[torch.Tensor]:
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def tensors() -> Tensors:
    """Live tensors' storages on any device, each counted once."""
    seen: dict[int, int] = {}
    found = _live_tensors() + [t for r in _frozen if (t := r()) is not None]
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
