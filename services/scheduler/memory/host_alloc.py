"""Bookkeeping of the host (L2) pool's pages, kept by the scheduler (the worker keeps none).

Pure Python: the scheduler decides which host pages a backup, load, put or prefetch uses and
sends their ids in step ops; ``services.worker.host_cache.HostPool`` holds the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.memory.allocator import DoubleFreeError, _PageBitmap

HostDoubleFreeError = DoubleFreeError
"""Freeing a host page that is not allocated (already freed, or never handed out)."""


class HostPageAllocator:
    """Host page ids ``0..num_pages-1``, lowest free first; all-or-nothing allocation. The same
    first-fit bitmap as the device's slots (``allocator._PageBitmap``).

    Contract: ``alloc(n)`` returns n ascending ids or None (nothing taken) when fewer are free —
    the pool is the bound, the caller evicts or skips the backup. ``free`` raises
    ``HostDoubleFreeError`` and changes nothing if any id is not allocated or repeats.
    """

    __slots__ = ("_pages", "num_pages")

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._pages = _PageBitmap(num_pages, "host page")

    @property
    def available(self) -> int:
        return self._pages.free

    def is_allocated(self, page: int) -> bool:
        return self._pages.is_used(page)

    def alloc(self, n: int) -> list[int] | None:
        return self._pages.take(n)

    def free(self, pages: Sequence[int]) -> None:
        self._pages.give_back(pages)
