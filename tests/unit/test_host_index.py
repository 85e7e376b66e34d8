"""HostIndex (the host tier of a hybrid model's hierarchical cache) and the L3 hit rule for hybrid
prefixes: scenarios, then random operations against the accounting identity."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.l3_lookup import usable_pages
from services.scheduler.memory.host_alloc import HostPageAllocator
from services.scheduler.memory.host_index import HostIndex


def _key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _filled(size: int, n: int) -> HostIndex:
    idx = HostIndex(HostPageAllocator(size))
    got = idx.reserve(n)
    assert got is not None
    for i, page in enumerate(got):
        assert idx.add(_key(i), page)
    return idx


def test_a_prefix_run_and_deeper_pages_evicted_first() -> None:
    idx = _filled(4, 4)
    assert idx.run([_key(i) for i in range(6)], 0) == 4
    assert idx.run([_key(i) for i in range(6)], 5) == 5  # absent start: an empty run
    idx.touch([_key(0), _key(1), _key(2)])  # a prefix used: key 0 most recent, key 2 next...
    got = idx.reserve(2)  # full: evicts the least recent, key 3, then the deepest touched, key 2
    assert got is not None and len(got) == 2
    assert [_key(i) in idx for i in range(4)] == [True, True, False, False]
    idx.release(got)
    idx.check()


def test_pins_protect_and_a_reservation_is_all_or_nothing() -> None:
    idx = _filled(3, 3)
    assert idx.pin([_key(0), _key(1), _key(9)]) == [_key(0), _key(1)]  # absent keys are skipped
    assert (idx.evictable, idx.protected) == (1, 2)
    assert idx.reserve(2) is None and len(idx) == 3  # nothing evicted for a refused reservation
    got = idx.reserve(1)
    assert got is not None and _key(2) not in idx
    idx.release(got)
    idx.unpin([_key(0), _key(1)])
    with pytest.raises(ValueError, match="not pinned"):
        idx.unpin([_key(0)])
    idx.check()


def test_adding_a_key_held_elsewhere_frees_the_new_page() -> None:
    idx = _filled(3, 1)
    got = idx.reserve(1)
    assert got is not None
    assert not idx.add(_key(0), got[0])
    assert len(idx) == 1 and idx.reserved == 0
    idx.check()
    assert idx.evict(5) == 1 and len(idx) == 0
    idx.check()


def test_usable_pages_needs_every_page_up_to_a_stored_state() -> None:
    assert usable_pages([True] * 4, [False, True, False, True]) == 4
    assert usable_pages([True, True, False, True], [False, True, False, True]) == 2  # a gap at page 3
    assert usable_pages([True] * 3, [False, False, False]) == 0  # pages without a state: unusable
    assert usable_pages([], []) == 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), size=st.integers(1, 12))
def test_random_operations_keep_the_accounting(seed: int, size: int) -> None:
    rng = random.Random(seed)
    idx = HostIndex(HostPageAllocator(size))
    held: list[int] = []  # reserved, not yet added
    pinned: list[bytes] = []
    for _ in range(200):
        op = rng.randrange(6)
        if op == 0:
            got = idx.reserve(rng.randrange(0, 4))
            if got is not None:
                held += got
        elif op == 1 and held:
            idx.add(_key(rng.randrange(20)), held.pop())
        elif op == 2 and held:
            idx.release([held.pop()])
        elif op == 3:
            pinned += idx.pin([_key(rng.randrange(20))])
        elif op == 4 and pinned:
            idx.unpin([pinned.pop(rng.randrange(len(pinned)))])
        else:
            idx.touch([_key(rng.randrange(20)) for _ in range(3)])
        idx.check()
        assert all(k in idx for k in pinned)  # a pinned entry is never evicted
