"""Slot and row allocators: whole pages, lowest first, loud double frees."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.memory.allocator import DoubleFreeError, RowAllocator, SlotAllocator


def test_alloc_and_free_round_trip() -> None:
    a = SlotAllocator(16)
    got = a.alloc(5)
    assert got == [0, 1, 2, 3, 4]
    assert a.available == 11
    assert all(a.is_allocated(s) for s in got) and not a.is_allocated(5)
    a.free(got)
    assert a.available == 16
    assert not any(a.is_allocated(s) for s in range(16))


def test_alloc_is_never_partial() -> None:
    a = SlotAllocator(8)
    assert a.alloc(6) is not None
    assert a.alloc(3) is None
    assert a.available == 2  # the refused call changed nothing
    assert a.alloc(2) == [6, 7]
    assert a.alloc(1) is None
    assert a.alloc(0) == []


def test_alloc_rounds_up_to_whole_pages() -> None:
    a = SlotAllocator(16, page_size=4)
    got = a.alloc(5)
    assert got == list(range(8))
    assert a.available == 8
    assert a.round_up(5) == 8 and a.round_up(8) == 8 and a.round_up(0) == 0


def test_prefers_low_pages() -> None:
    a = SlotAllocator(32, page_size=4)
    pages = [a.alloc(4) for _ in range(4)]  # pages 0..3
    assert all(p is not None for p in pages)
    a.free(pages[2])  # type: ignore[arg-type]
    a.free(pages[0])  # type: ignore[arg-type]
    # Lowest first: page 0, then page 2, then the untouched tail (4..).
    assert a.alloc(4) == list(range(0, 4))
    assert a.alloc(8) == list(range(8, 12)) + list(range(16, 20))


def test_alloc_spans_fragmented_runs_in_ascending_order() -> None:
    a = SlotAllocator(10)
    a.alloc(10)
    a.free([7])
    a.free([1, 2])
    a.free([4])
    assert a.alloc(4) == [1, 2, 4, 7]


@pytest.mark.parametrize("page_size", [1, 4])
def test_double_free_raises_and_changes_nothing(page_size: int) -> None:
    a = SlotAllocator(16, page_size=page_size)
    got = a.alloc(8)
    assert got is not None
    a.free(got)
    with pytest.raises(DoubleFreeError):
        a.free(got)
    assert a.available == 16


def test_free_of_never_allocated_slot_raises() -> None:
    a = SlotAllocator(8)
    a.alloc(2)
    with pytest.raises(DoubleFreeError):
        a.free([5])
    with pytest.raises(DoubleFreeError):
        a.free([8])  # out of the pool
    with pytest.raises(DoubleFreeError):
        a.free([-1])  # would silently wrap in a bytearray
    assert a.available == 6


def test_duplicate_in_one_free_call_raises_and_changes_nothing() -> None:
    a = SlotAllocator(8)
    a.alloc(8)
    with pytest.raises(DoubleFreeError):
        a.free([3, 5, 3])
    assert a.available == 0
    with pytest.raises(DoubleFreeError):
        a.free([2, 6, 6, 1])  # mixed valid and duplicate: nothing freed
    assert a.available == 0


def test_partial_page_free_is_rejected() -> None:
    a = SlotAllocator(16, page_size=4)
    got = a.alloc(8)
    assert got is not None
    with pytest.raises(ValueError):
        a.free(got[:3])
    with pytest.raises(ValueError):
        a.free(got[1:5])  # whole count, but not page-aligned
    with pytest.raises(ValueError):
        a.free([0, 2, 1, 3])  # the right page, scrambled
    assert a.available == 8
    a.free(got[4:] + got[:4])  # whole pages in any page order are fine
    assert a.available == 16


def test_bad_construction() -> None:
    with pytest.raises(ValueError):
        SlotAllocator(10, page_size=4)
    with pytest.raises(ValueError):
        SlotAllocator(8, page_size=0)


def test_row_allocator() -> None:
    r = RowAllocator(3)
    assert [r.alloc(), r.alloc(), r.alloc()] == [0, 1, 2]
    assert r.alloc() is None
    r.free(1)
    assert r.available == 1
    with pytest.raises(DoubleFreeError):
        r.free(1)
    with pytest.raises(DoubleFreeError):
        r.free(7)
    assert r.alloc() == 1


@settings(max_examples=150, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 24)), max_size=60),
)
def test_matches_a_set_model(page_size: int, ops: list[tuple[bool, int]]) -> None:
    """Against a plain set: same free count, lowest pages first, never a slot handed out twice."""
    size = 48
    a = SlotAllocator(size, page_size=page_size)
    free_pages = set(range(size // page_size))
    held: list[list[int]] = []
    for is_alloc, arg in ops:
        if is_alloc:
            got = a.alloc(arg)
            k = -(-arg // page_size)
            if k > len(free_pages):
                assert got is None
                continue
            want = sorted(free_pages)[:k]
            assert got == [p * page_size + j for p in want for j in range(page_size)]
            free_pages -= set(want)
            held.append(got)
        elif held:
            chunk = held.pop(arg % len(held))
            a.free(chunk)
            free_pages |= {s // page_size for s in chunk}
            if chunk:
                with pytest.raises(DoubleFreeError):
                    a.free(chunk[:page_size])
        assert a.available == len(free_pages) * page_size
    owned = [s for chunk in held for s in chunk]
    assert len(owned) == len(set(owned))
    assert all(a.is_allocated(s) for s in owned)
