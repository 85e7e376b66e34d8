"""The scheduler's view of the Mamba state pool: which of the M state slots are in use.

A *Mamba slot* holds one recurrent state (conv + temporal) in the worker's pool; ids are 0..M-1.
Every slot is owned by exactly one of: the free list here, a running request (its private working
state, or a fork it is about to donate), or the Mamba radix cache (a cached state). Invariant,
checked in tests and whenever the server is idle:

    available + cache.state_evictable + cache.state_protected + held by requests == size + shrink_pending

(`shrink_pending` is 0 unless a lazy shrink waits for held slots at or above `size`.)

Sizing: at its peak one running request pins ``STATES_PER_ROW`` (``services.common.step``) slots
at once: its own working state, which its forward passes update in place; the cached state it
matched, locked until its copy-on-write into the first has run; and a fork of the first it has
allocated to donate to the tree as a checkpoint, before insert takes it. The worker's pool is
``STATES_PER_ROW * max_rows`` unless told otherwise (``EngineConfig``); a larger one's surplus is
what the cache can keep.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.memory.allocator import DoubleFreeError, _PageBitmap


class MambaSlotAllocator:
    """A pool of `size` Mamba slots (0..size-1), handed out one at a time, lowest free first.

    Contract:
    - `alloc()` returns a free slot or None when none is free (never raises on exhaustion: the
      caller evicts cached states with `PrefixTree.evict_states` or skips a checkpoint).
    - `free(slot)` / `free_many(slots)` raise DoubleFreeError, changing nothing, when a slot is
      free already or was never handed out. `free_many` is the `free_mamba` callback the cache
      takes.
    - `resize(new_size)` grows at once and shrinks lazily, like `SlotAllocator.resize`:
      `available` counts only slots below `size`; `shrink_pending` counts the held slots at or
      above it, and the worker may release them once `shrink_done`.
    """

    __slots__ = ("_slots",)

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        # The same first-fit bitmap as KV pages: one byte per slot doubles as the ownership record.
        self._slots = _PageBitmap(size, "state slot")

    @property
    def size(self) -> int:
        """Usable slots: the target of the last `resize`."""
        return self._slots.limit

    @property
    def available(self) -> int:
        """Free slots below `size`."""
        return self._slots.free

    @property
    def shrink_pending(self) -> int:
        """Held slots at or above `size`: a shrink completes when this reaches 0."""
        return self._slots.tail_used

    @property
    def shrink_done(self) -> bool:
        return self._slots.tail_used == 0

    @property
    def high_water(self) -> int:
        """1 + the highest held slot (0 when none is): the smallest size a shrink could complete at now."""
        return self._slots.high_water

    def resize(self, new_size: int) -> None:
        """Grow at once or shrink lazily to `new_size` slots; held slots are never taken back."""
        if new_size < 0:
            raise ValueError(f"size must be >= 0, got {new_size}")
        self._slots.resize(new_size)

    def is_allocated(self, slot: int) -> bool:
        return self._slots.is_used(slot)

    def alloc(self) -> int | None:
        got = self._slots.take(1)
        return got[0] if got else None

    def free(self, slot: int) -> None:
        self._slots.give_back([slot])

    def free_many(self, slots: Sequence[int]) -> None:
        self._slots.give_back(slots)


__all__ = ["DoubleFreeError", "MambaSlotAllocator"]
