"""Slot and row allocators for the scheduler's view of the KV pool.

A *slot* holds one token's KV; a *page* is `page_size` consecutive slots and is the unit of
allocation. Both allocators keep one byte of state per page (or row) in a `bytearray`:

    state:  [1 1 1 1 0 0 1 0 0 0 ...]      1 = allocated, 0 = free
             ^ lowest_free hint points at the first 0 (every page before it is allocated)

The bytearray doubles as the ownership record (a double free is detected, not absorbed) and as the
free list: `bytearray.find` is a C `memchr`, so finding the next run of free pages costs a C scan,
never a Python loop over the pool. Allocation is first-fit from the lowest page, so used memory
stays packed at the front and an elastic pool can later unmap free tail pages.

Elastic pools: `resize` grows at once (free slots appended at the end) and shrinks lazily: slots
at or above the target stop being handed out immediately, and the shrink is done once every one
of them is free. Only then may the worker be told to release them (`PoolResize`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

_FREE = 0
_USED = 1


class DoubleFreeError(ValueError):
    """Freeing a slot or row that is not currently allocated (already freed, or never handed out)."""


class _PageBitmap:
    """First-fit allocator of page indices 0..limit-1 over a bytearray of states.

    Resizable: ``resize`` moves the *limit* (pages below it may be handed out). Growing appends
    free pages; shrinking is lazy: pages at or above the new limit are never handed out again,
    and those still allocated (the *pending tail*) stay tracked until they are given back; the
    state is truncated to the limit when the last of them returns::

        state:  [1 1 0 1 0 0 | 0 1 0]      limit = 6, pending tail = 1 page (index 7)
                 usable pages ^ tail: freed pages here are not free to take
    """

    __slots__ = ("_free", "_limit", "_lowest_free", "_ones", "_state", "_tail_used", "unit")

    def __init__(self, count: int, unit: str = "page") -> None:
        """``unit`` names what is counted in error messages (page, row, state slot, host page)."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self.unit = unit
        self._state = bytearray(count)
        # A read-only run of ones to mark runs allocated without building a bytes object per call.
        self._ones = memoryview(b"\x01" * count)
        self._limit = count
        self._free = count  # free pages below the limit
        self._tail_used = 0  # allocated pages at or above the limit
        self._lowest_free = 0

    @property
    def free(self) -> int:
        return self._free

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def tail_used(self) -> int:
        return self._tail_used

    @property
    def high_water(self) -> int:
        """1 + the highest allocated page (0 when none is): the smallest limit nothing would cut."""
        return self._state.rfind(_USED) + 1

    def is_used(self, page: int) -> bool:
        return 0 <= page < len(self._state) and self._state[page] == _USED

    def resize(self, count: int) -> None:
        """Move the limit to ``count`` pages (see the class docstring); never fails on held pages."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        state = self._state
        if count > len(state):
            state.extend(bytes(count - len(state)))
            if count > len(self._ones):
                self._ones = memoryview(b"\x01" * count)
        self._limit = count
        self._free = state.count(_FREE, 0, count)
        self._tail_used = state.count(_USED, count, len(state))
        self._lowest_free = min(self._lowest_free, count)
        self._trim()

    def _trim(self) -> None:
        if not self._tail_used and len(self._state) > self._limit:
            del self._state[self._limit :]

    def take(self, k: int) -> list[int] | None:
        """Take the k lowest free pages (ascending), or None without side effects if fewer are free."""
        if k < 0:
            raise ValueError(f"cannot allocate a negative count ({k})")
        if k > self._free:
            return None
        state, limit = self._state, self._limit
        pages: list[int] = []
        pos = self._lowest_free
        need = k
        while need:
            start = state.find(_FREE, pos, limit)
            # The run ends at the next used page, capped at what we still need.
            end = state.find(_USED, start, min(start + need, limit))
            if end < 0:
                end = min(start + need, limit)
            state[start:end] = self._ones[: end - start]
            pages.extend(range(start, end))
            need -= end - start
            pos = end
        self._free -= k
        if k:
            self._lowest_free = pos
        return pages

    def give_back(self, pages: Sequence[int]) -> None:
        """Return pages; raises DoubleFreeError, leaving the state unchanged, if any is not allocated."""
        k = len(pages)
        if not k:
            return
        # Linear for the ascending runs that alloc hands out and the tree stores.
        ordered = sorted(pages)
        lo, hi = ordered[0], ordered[-1]
        count = len(self._state)
        if lo < 0 or hi >= count:
            bad = lo if lo < 0 else hi
            raise DoubleFreeError(f"{self.unit} {bad} is not allocated: it was never allocated (the pool has {count})")
        if k > 1 and len(set(ordered)) != k:
            raise DoubleFreeError(f"the same {self.unit} appears twice in one free call")
        state = self._state
        if hi - lo + 1 == k:
            # Distinct pages spanning exactly k: one run, checked and cleared by C slice operations.
            if (i := state.find(_FREE, lo, hi + 1)) >= 0:
                raise DoubleFreeError(f"{self.unit} {i} is already free")
            state[lo : hi + 1] = bytes(k)
        else:
            # Validate everything before mutating, so a bad call leaves the pool consistent.
            for p in ordered:
                if state[p] != _USED:
                    raise DoubleFreeError(f"{self.unit} {p} is already free")
            for p in ordered:
                state[p] = _FREE
        in_tail = k - bisect.bisect_left(ordered, self._limit)
        self._free += k - in_tail
        self._lowest_free = min(self._lowest_free, lo)
        if in_tail:
            self._tail_used -= in_tail
            self._trim()


class SlotAllocator:
    """A pool of `size` KV slots (0..size-1) handed out in whole pages of `page_size` slots.

    Contract:
    - `alloc(n)` returns `round_up(n)` slots (whole pages, ascending), so possibly more than n, or
      None when that many are not free. Never partial. The extra slots of the last page are the
      caller's like the rest: it keeps them for later tokens and frees them with the page.
    - `free(slots)` takes whole pages laid out as alloc returns them (each page's slots consecutive,
      starting at a multiple of `page_size`). Freeing a slot that is free, or was never handed out,
      raises DoubleFreeError and changes nothing; a malformed list raises ValueError.
    - The lowest free pages are always handed out first.
    - `resize(new_size)`: growing adds free slots at the end at once; shrinking is lazy (see the
      module docstring): `available` never counts a slot at or above `size`, `shrink_pending`
      counts the ones still held there, and `shrink_done` says the worker may release them.
    """

    __slots__ = ("_pages", "page_size")

    def __init__(self, size: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < 0 or size % page_size:
            raise ValueError(f"size ({size}) must be a non-negative multiple of page_size ({page_size})")
        self.page_size = page_size
        self._pages = _PageBitmap(size // page_size)

    @property
    def size(self) -> int:
        """Usable slots: the target of the last `resize` (slots 0..size-1 may be handed out)."""
        return self._pages.limit * self.page_size

    @property
    def available(self) -> int:
        """Free slots below `size` (always a multiple of page_size)."""
        return self._pages.free * self.page_size

    @property
    def shrink_pending(self) -> int:
        """Slots at or above `size` still allocated: a shrink completes when this reaches 0."""
        return self._pages.tail_used * self.page_size

    @property
    def shrink_done(self) -> bool:
        """No slot at or above `size` is held: the worker's pool may shrink to `size` now."""
        return self._pages.tail_used == 0

    @property
    def high_water(self) -> int:
        """1 + the highest allocated slot's page end (0 when nothing is held): the smallest size a
        shrink could complete at right now."""
        return self._pages.high_water * self.page_size

    def resize(self, new_size: int) -> None:
        """Grow at once or shrink lazily to `new_size` slots (a non-negative multiple of page_size).

        Held slots are never taken back: after a shrink they stay the holder's, are freed as
        usual, and are not handed out again. A grow that reaches back over a pending tail
        cancels that much of the shrink. Grow only once the worker's pool has (or, in the same
        step's ops, will have) the capacity.
        """
        if new_size < 0 or new_size % self.page_size:
            raise ValueError(f"size ({new_size}) must be a non-negative multiple of page_size ({self.page_size})")
        self._pages.resize(new_size // self.page_size)

    def round_up(self, n: int) -> int:
        """The smallest multiple of page_size that is >= n."""
        return -(-n // self.page_size) * self.page_size

    def is_allocated(self, slot: int) -> bool:
        return slot >= 0 and self._pages.is_used(slot // self.page_size)

    def alloc(self, n: int) -> list[int] | None:
        ps = self.page_size
        pages = self._pages.take(-(-n // ps))
        if pages is None or ps == 1:
            return pages
        slots: list[int] = []
        # Pages come back ascending; expand each contiguous run with one range().
        run_start = prev = pages[0] if pages else 0
        for p in pages[1:]:
            if p != prev + 1:
                slots.extend(range(run_start * ps, (prev + 1) * ps))
                run_start = p
            prev = p
        if pages:
            slots.extend(range(run_start * ps, (prev + 1) * ps))
        return slots

    def free(self, slots: Sequence[int]) -> None:
        ps = self.page_size
        if ps == 1:
            self._pages.give_back(slots)
            return
        if len(slots) % ps:
            raise ValueError(f"free: {len(slots)} slots is not a whole number of pages of {ps}")
        heads = slots[::ps]
        pages = [h // ps for h in heads]
        expected: list[int] = []
        for h in heads:
            if h % ps:
                raise ValueError(f"free: slot {h} starts a page but is not page-aligned")
            expected.extend(range(h, h + ps))
        if list(slots) != expected:
            raise ValueError("free: slots are not whole pages laid out consecutively")
        self._pages.give_back(pages)


class RowAllocator:
    """Rows of the req_to_token table, one per running request; lowest free row first.

    `alloc()` returns a row or None when all are taken; `free(row)` raises DoubleFreeError when
    the row is not currently allocated.
    """

    __slots__ = ("_rows", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._rows = _PageBitmap(size, "row")

    @property
    def available(self) -> int:
        return self._rows.free

    def alloc(self) -> int | None:
        rows = self._rows.take(1)
        return rows[0] if rows else None

    def free(self, row: int) -> None:
        self._rows.give_back([row])
