"""Resizable scheduler allocators: growing adds free slots at the end; shrinking is lazy (the tail
is never handed out again and the shrink completes when its last held slot is freed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.memory.allocator import DoubleFreeError, SlotAllocator
from services.scheduler.memory.state_alloc import MambaSlotAllocator

# (op, argument): alloc n pages / free the i-th held allocation / resize to n pages.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 6)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("resize"), st.integers(0, 40)),
    ),
    max_size=60,
)


def check(a: SlotAllocator, held: set[int], size: int) -> None:
    """The allocator agrees with a model that only knows the held pages and the target size."""
    ps = a.page_size
    assert a.size == size * ps
    below = {p for p in held if p < size}
    assert a.available == (size - len(below)) * ps
    assert a.shrink_pending == (len(held) - len(below)) * ps
    assert a.shrink_done == (len(held) == len(below))
    assert a.high_water == (max(held) + 1 if held else 0) * ps
    for p in range(size + 3):
        assert a.is_allocated(p * ps) == (p in held)


@settings(max_examples=300, deadline=None)
@given(page_size=st.sampled_from([1, 4]), start=st.integers(0, 24), ops=OPS)
def test_slot_allocator_resize_matches_model(page_size: int, start: int, ops: list[tuple[str, int]]) -> None:
    a = SlotAllocator(start * page_size, page_size)
    held: set[int] = set()  # pages
    runs: list[list[int]] = []  # what alloc returned, freed whole
    size = start
    for op, arg in ops:
        if op == "alloc":
            got = a.alloc(arg * page_size)
            free_below = sorted(p for p in range(size) if p not in held)
            if arg > len(free_below):
                assert got is None  # never partial, never from the tail
            else:
                assert got is not None
                pages = sorted({s // page_size for s in got})
                assert pages == free_below[:arg]  # lowest usable pages first
                held.update(pages)
                if got:
                    runs.append(got)
        elif op == "free" and runs:
            run = runs.pop(arg % len(runs))
            a.free(run)
            held.difference_update(s // page_size for s in run)
            with pytest.raises(DoubleFreeError):
                a.free(run)  # a second free is refused and changes nothing
        elif op == "resize":
            a.resize(arg * page_size)
            size = arg
        check(a, held, size)


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 24), ops=OPS)
def test_mamba_allocator_resize_matches_model(start: int, ops: list[tuple[str, int]]) -> None:
    a = MambaSlotAllocator(start)
    held: list[int] = []
    size = start
    for op, arg in ops:
        if op == "alloc":
            got = a.alloc()
            free_below = [s for s in range(size) if s not in held]
            assert got == (free_below[0] if free_below else None)
            if got is not None:
                held.append(got)
        elif op == "free" and held:
            slot = held.pop(arg % len(held))
            a.free(slot)
            with pytest.raises(DoubleFreeError):
                a.free(slot)
        elif op == "resize":
            a.resize(arg)
            size = arg
        tail = [s for s in held if s >= size]
        assert (a.size, a.available, a.shrink_pending) == (size, size - (len(held) - len(tail)), len(tail))
        assert a.shrink_done == (not tail) and a.high_water == (max(held) + 1 if held else 0)
        assert all(a.is_allocated(s) for s in held)


def test_lazy_shrink_walkthrough() -> None:
    a = SlotAllocator(16, page_size=4)
    low, high = a.alloc(8), a.alloc(4)  # pages 0, 1 and 2
    assert low is not None and high is not None
    a.resize(8)  # cut pages 2 and 3; page 2 is still held
    assert (a.size, a.available, a.shrink_pending, a.shrink_done) == (8, 0, 4, False)
    assert a.alloc(1) is None  # page 3 is free but beyond the target: never handed out
    a.free(high)
    assert (a.available, a.shrink_pending, a.shrink_done) == (0, 0, True)
    with pytest.raises(DoubleFreeError, match="was never allocated"):
        a.free(high)  # the tail is gone from the books
    a.resize(12)  # grow back: page 2 is free again, at the end
    assert a.available == 4 and a.alloc(4) == [8, 9, 10, 11]
    with pytest.raises(ValueError, match=r"size \(6\) must be a non-negative multiple of page_size \(4\)"):
        a.resize(6)
    with pytest.raises(ValueError, match="must be >= 0"):
        MambaSlotAllocator(3).resize(-1)


def test_grow_over_a_pending_tail_cancels_that_part_of_the_shrink() -> None:
    a = MambaSlotAllocator(6)
    slots = [a.alloc() for _ in range(6)]
    assert slots == [0, 1, 2, 3, 4, 5]
    a.resize(2)
    assert (a.available, a.shrink_pending) == (0, 4)
    a.free(3)
    a.resize(4)  # slot 3 (freed) is usable again; 4 and 5 are still a pending tail
    assert (a.size, a.available, a.shrink_pending) == (4, 1, 2)
    assert a.alloc() == 3 and a.alloc() is None
    a.free_many([4, 5])
    assert a.shrink_done and a.high_water == 4
