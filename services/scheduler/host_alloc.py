"""Bookkeeping of the host (L2) pool's pages, kept by the scheduler (the worker keeps none).

Pure Python: the scheduler decides which host pages a backup, load, put or prefetch uses and
sends their ids in step ops; ``services.worker.host_cache.HostPool`` holds the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence


class HostDoubleFreeError(ValueError):
    """Freeing a host page that is not allocated (already freed, or never handed out)."""


class HostPageAllocator:
    """Host page ids ``0..num_pages-1``, lowest free first; all-or-nothing allocation.

    Contract: ``alloc(n)`` returns n ascending ids or None (nothing taken) when fewer are free —
    the pool is the bound, the caller evicts or skips the backup. ``free`` raises
    ``HostDoubleFreeError`` and changes nothing if any id is not allocated or repeats.
    """

    __slots__ = ("_free", "_lowest_free", "_state", "num_pages")

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._state = bytearray(num_pages)  # 1 = allocated; bytearray.find scans in C
        self._free = num_pages
        self._lowest_free = 0

    @property
    def available(self) -> int:
        return self._free

    def is_allocated(self, page: int) -> bool:
        return 0 <= page < self.num_pages and self._state[page] == 1

    def alloc(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate a negative count ({n})")
        if n > self._free:
            return None
        out: list[int] = []
        pos = self._lowest_free
        for _ in range(n):
            pos = self._state.find(0, pos)
            self._state[pos] = 1
            out.append(pos)
            pos += 1
        self._free -= n
        if n:
            self._lowest_free = pos
        return out

    def free(self, pages: Sequence[int]) -> None:
        if len(set(pages)) != len(pages):
            raise HostDoubleFreeError("the same host page appears twice in one free call")
        for p in pages:  # validate everything first, so a bad call leaves the state unchanged
            if not self.is_allocated(p):
                raise HostDoubleFreeError(f"host page {p} is not allocated (pool has {self.num_pages})")
        for p in pages:
            self._state[p] = 0
        self._free += len(pages)
        if pages:
            self._lowest_free = min(self._lowest_free, min(pages))
