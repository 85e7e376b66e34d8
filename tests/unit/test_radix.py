"""Radix prefix cache: matching, dedup on insert, locks, eviction order, pages, extra keys, and a
stateful run of thousands of random operations that keeps `free + evictable + protected == size`."""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.scheduler.memory.allocator import SlotAllocator
from services.scheduler.memory.base import CacheEvent, CacheHandle, CacheKey
from services.scheduler.memory.state_alloc import MambaSlotAllocator
from services.scheduler.memory.tree import EvictionPolicy, InsertResult, PrefixTree
from services.scheduler.memory.tree_util import common_prefix as _common_prefix

SIZE = 64


class Env:
    """An allocator and a cache wired together, as the scheduler wires them."""

    def __init__(self, page_size: int = 1, policy: EvictionPolicy = "lru", size: int = SIZE) -> None:
        self.alloc = SlotAllocator(size, page_size)
        self.events: list[CacheEvent] = []
        self.cache = PrefixTree(page_size, self.alloc.free, eviction=policy, on_event=self.events.append)

    def put(self, tokens: list[int], extra: str = "") -> tuple[int, list[int]]:
        """A request that computed `tokens` from scratch caches them and frees what it keeps."""
        own = self.alloc.alloc(len(tokens))
        assert own is not None
        slots = own[: len(tokens)]
        cached = self.cache.insert(CacheKey(tokens, extra), slots)
        aligned = self.cache.aligned_len(len(tokens))
        self.alloc.free(own[:cached] + own[aligned:])
        return cached, slots

    def check(self) -> None:
        self.cache.sanity_check()
        c = self.cache
        assert self.alloc.available + c.evictable_size + c.protected_size == self.alloc.size


def test_full_and_longer_match() -> None:
    env = Env()
    _, slots = env.put([1, 2, 3, 4, 5, 6, 7, 8])
    m = env.cache.match_prefix(CacheKey([1, 2, 3, 4, 5, 6, 7, 8]))
    assert m.slots == slots and m.length == 8
    assert env.cache.match_prefix(CacheKey([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])).slots == slots
    assert env.cache.match_prefix(CacheKey([2, 1])).slots == []
    env.check()


def test_partial_match_does_not_change_sizes() -> None:
    env = Env()
    _, slots = env.put([1, 2, 3, 4])
    before = (env.cache.evictable_size, env.cache.protected_size, env.alloc.available)
    assert env.cache.match_prefix(CacheKey([1, 2, 9])).slots == slots[:2]
    assert (env.cache.evictable_size, env.cache.protected_size, env.alloc.available) == before
    env.check()


def test_mid_edge_match_locks_exactly_the_matched_length() -> None:
    env = Env()
    _, slots = env.put([1, 2, 3, 4, 5, 6, 7, 8])
    m = env.cache.match_prefix(CacheKey([1, 2, 3, 4, 9]))
    assert m.slots == slots[:4]
    env.cache.lock(m.node)
    assert env.cache.protected_size == 4 and env.cache.evictable_size == 4
    env.check()
    # Only the unmatched tail can go; the matched slots stay valid.
    assert env.cache.evict(100) == 4
    assert env.cache.match_prefix(CacheKey([1, 2, 3, 4, 5])).slots == slots[:4]
    env.cache.unlock(m.node)
    assert env.cache.protected_size == 0 and env.cache.evictable_size == 4
    env.check()


def test_duplicate_insert_returns_cached_length_and_caller_frees_duplicates() -> None:
    env = Env()
    cached, first = env.put([1, 2, 3, 4])
    assert cached == 0
    cached, second = env.put([1, 2, 3, 4])  # put() frees second[:cached]
    assert cached == 4
    assert env.cache.match_prefix(CacheKey([1, 2, 3, 4])).slots == first
    assert not any(env.alloc.is_allocated(s) for s in second)
    cached, third = env.put([1, 2, 3, 4, 5, 6])
    assert cached == 4
    assert env.cache.match_prefix(CacheKey([1, 2, 3, 4, 5, 6])).slots == first + third[4:]
    assert env.cache.evictable_size == 6
    env.check()


def test_insert_after_locked_match_frees_only_own_duplicates() -> None:
    """The scheduler's path: match+lock, compute the rest, insert, free slots[m:cached]."""
    env = Env()
    env.put([1, 2, 3])
    m = env.cache.match_prefix(CacheKey([1, 2, 3, 4, 5]))
    env.cache.lock(m.node)
    env.put([1, 2, 3, 4])  # another request caches token 4 meanwhile
    own = env.alloc.alloc(2)
    assert own is not None
    slots = m.slots + own
    cached = env.cache.insert(CacheKey([1, 2, 3, 4, 5]), slots)
    assert cached == 4
    env.alloc.free(slots[m.length : cached])
    env.cache.unlock(m.node)
    assert env.cache.evictable_size == 5
    env.check()


def test_nested_locks_and_shared_paths() -> None:
    env = Env()
    env.put([1, 2, 3, 4])
    env.put([1, 2, 7, 8, 9])
    a = env.cache.match_prefix(CacheKey([1, 2, 3, 4])).node
    b = env.cache.match_prefix(CacheKey([1, 2, 7, 8, 9])).node
    env.cache.lock(a)
    assert env.cache.protected_size == 4
    env.cache.lock(b)  # shares [1, 2]: only [7, 8, 9] is newly locked
    assert env.cache.protected_size == 7
    env.cache.lock(a)
    assert env.cache.protected_size == 7
    env.cache.unlock(a)
    env.cache.unlock(b)
    assert env.cache.protected_size == 4
    env.cache.unlock(a)
    assert env.cache.protected_size == 0 and env.cache.evictable_size == 7
    with pytest.raises(ValueError):
        env.cache.unlock(a)
    env.check()


def _evicted(env: Env) -> list[tuple[int, ...]]:
    return [tuple(e.tokens) for e in env.events if e.kind == "evict"]


def test_lru_evicts_least_recently_used_leaf_first() -> None:
    env = Env(policy="lru")
    for first in (1, 2, 3):
        env.put([first, 0, 0])
    env.cache.match_prefix(CacheKey([1, 0, 0]))  # 1 is now the most recent
    assert env.cache.evict(3) == 3
    assert _evicted(env) == [(2, 0, 0)]
    assert env.cache.evict(4) == 6
    assert _evicted(env) == [(2, 0, 0), (3, 0, 0), (1, 0, 0)]
    env.check()


def test_lfu_evicts_least_frequently_used_leaf_first() -> None:
    env = Env(policy="lfu")
    env.put([1, 0])
    env.put([2, 0])
    for _ in range(3):
        env.cache.match_prefix(CacheKey([1, 0]))
    env.cache.match_prefix(CacheKey([2, 0]))  # most recent, but used less often
    env.put([3, 0])  # never matched: goes first
    env.cache.evict(6)
    assert _evicted(env) == [(3, 0), (2, 0), (1, 0)]
    env.check()


def test_eviction_climbs_to_parents_that_become_leaves() -> None:
    env = Env()
    env.put([1, 2, 3, 4])
    env.put([1, 2, 5, 6])
    assert env.cache.evict(6) == 6  # both leaves, then their shared parent
    assert env.cache.total_size() == 0
    assert env.alloc.available == SIZE
    env.check()


def test_locked_nodes_are_never_evicted() -> None:
    env = Env()
    _, locked_slots = env.put([1, 2, 3, 4])
    env.put([5, 6, 7, 8])
    env.put([1, 2, 9, 9])
    m = env.cache.match_prefix(CacheKey([1, 2, 3, 4]))
    env.cache.lock(m.node)
    assert env.cache.evict(SIZE) == 6  # [5..8] and [9, 9]; [1, 2, 3, 4] stays
    assert env.cache.match_prefix(CacheKey([1, 2, 3, 4])).slots == locked_slots
    assert env.cache.evictable_size == 0 and env.cache.protected_size == 4
    assert env.cache.evict(1) == 0
    env.check()


def test_stale_handle_is_rejected() -> None:
    env = Env()
    env.put([1, 2])
    m = env.cache.match_prefix(CacheKey([1, 2]))
    env.cache.evict(2)
    with pytest.raises(ValueError):
        env.cache.lock(m.node)
    with pytest.raises(TypeError):
        env.cache.lock(CacheHandle())


def test_page_alignment() -> None:
    env = Env(page_size=4)
    tokens = list(range(10, 20))  # 10 tokens: two whole pages and a 2-token tail
    cached, slots = env.put(tokens)
    assert cached == 0
    assert env.cache.evictable_size == 8  # the tail is never cached
    assert env.cache.match_prefix(CacheKey(tokens)).slots == slots[:8]
    assert env.cache.match_prefix(CacheKey(tokens[:7])).slots == slots[:4]  # partial page: no
    changed = [*tokens[:5], 99, *tokens[6:]]  # differs inside the second page
    m = env.cache.match_prefix(CacheKey(changed))
    assert m.slots == slots[:4]
    env.cache.lock(m.node)
    assert env.cache.protected_size == 4
    env.cache.unlock(m.node)
    assert env.cache.insert(CacheKey(tokens[:3]), [0, 0, 0]) == 0  # shorter than a page: no-op
    env.cache.evict(SIZE)
    assert env.alloc.available == SIZE
    env.check()


def test_page_alignment_split_and_dedup() -> None:
    env = Env(page_size=4)
    env.put(list(range(12)))
    cached, _ = env.put([*range(6), 77, 77, 77, 77])  # shares one page, mismatches mid-page
    assert cached == 4
    assert env.cache.evictable_size == 12 + 4
    env.check()


def test_extra_keys_never_share_nodes() -> None:
    env = Env()
    _, a_slots = env.put([1, 2, 3], extra="a")
    cached, b_slots = env.put([1, 2, 3], extra="b")
    assert cached == 0
    assert env.cache.match_prefix(CacheKey([1, 2, 3], "a")).slots == a_slots
    assert env.cache.match_prefix(CacheKey([1, 2, 3], "b")).slots == b_slots
    assert env.cache.match_prefix(CacheKey([1, 2, 3], "c")).slots == []
    assert env.cache.match_prefix(CacheKey([1, 2, 3])).slots == []
    env.cache.evict(6)
    assert env.cache.match_prefix(CacheKey([1, 2, 3], "a")).slots == []
    env.check()


def test_events_describe_inserted_and_evicted_segments() -> None:
    env = Env()
    env.put([1, 2, 3], extra="s")
    env.put([1, 2, 4, 5], extra="s")
    assert [(e.kind, e.extra, e.start, tuple(e.tokens)) for e in env.events] == [
        ("insert", "s", 0, (1, 2, 3)),
        ("insert", "s", 2, (1, 2, 4, 5)),
    ]
    env.events.clear()
    env.cache.evict(100)
    assert sorted((e.kind, e.start, tuple(e.tokens)) for e in env.events) == [
        ("evict", 0, (1, 2)),
        ("evict", 2, (1, 2, 3)),
        ("evict", 2, (1, 2, 4, 5)),
    ]


def test_cache_off_keeps_nothing_and_frees_what_it_is_given() -> None:
    alloc = SlotAllocator(16, page_size=4)
    cache = PrefixTree(4, alloc.free, keep=False)
    own = alloc.alloc(6)
    assert own is not None
    assert cache.insert(CacheKey([1, 2, 3, 4, 5, 6]), own[:6]) == 0
    alloc.free(own[4:])  # the partial page stays the caller's
    assert alloc.available == 16
    m = cache.match(CacheKey([1, 2, 3, 4]))
    assert m.slots == [] and m.state is None and m.kv_len == 0
    cache.lock(m.node)
    cache.unlock(m.node)
    assert cache.evict(10) == 0 and cache.total_size() == 0
    cache.sanity_check()
    with pytest.raises(ValueError):
        cache.insert(CacheKey([1, 2, 3, 4]), [0, 1])


def test_cache_off_with_states_frees_a_state_it_is_given() -> None:
    alloc, states = SlotAllocator(16, page_size=4), MambaSlotAllocator(2)
    cache = PrefixTree(4, alloc.free, states.free_many, keep=False)
    own, state = alloc.alloc(8), states.alloc()
    assert own is not None and state is not None
    res = cache.insert_checkpoint(CacheKey(list(range(8))), own, state)
    assert res == InsertResult(0, False)
    assert alloc.available == 16 and states.available == 2
    assert cache.state_evictable == cache.state_protected == 0


def test_long_prefix_match_and_split() -> None:
    env = Env(size=1 << 16)
    rng = random.Random(0)
    tokens = array("i", (rng.randrange(150_000) for _ in range(32_768)))
    _, slots = env.put(list(tokens))
    assert env.cache.match_prefix(CacheKey(tokens)).slots == slots
    probe = array("i", tokens)
    probe[20_001] = -1
    assert env.cache.match_prefix(CacheKey(probe)).slots == slots[:20_001]
    env.check()


@settings(max_examples=200, deadline=None)
@given(
    edge=st.lists(st.integers(0, 3), min_size=1, max_size=300),
    extra=st.lists(st.integers(0, 3), max_size=300),
    pos=st.integers(0, 5),
)
def test_common_prefix_agrees_with_a_naive_scan(edge: list[int], extra: list[int], pos: int) -> None:
    key = [7] * pos + extra
    limit = min(len(edge), len(key) - pos)
    if limit <= 0:
        return
    want = next((i for i in range(limit) if key[pos + i] != edge[i]), limit)
    assert _common_prefix(array("i", key), pos, array("i", edge), limit) == want


# -- stateful: thousands of random operations --------------------------------------------------


@dataclass
class _Req:
    key: CacheKey
    node: CacheHandle
    match_len: int
    matched: list[int]
    own: list[int]  # whole pages from the allocator, covering tokens [match_len, ...)


class CacheMachine(RuleBasedStateMachine):
    """A model of what is cached: {(extra, prefix of whole pages): slots of its last page}. Inserts
    are recorded by the rules, evictions through the cache's events."""

    @initialize(page_size=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["lru", "lfu"]))
    def setup(self, page_size: int, policy: EvictionPolicy) -> None:
        self.ps = page_size
        self.alloc = SlotAllocator(48, page_size)
        self.cache = PrefixTree(page_size, self.alloc.free, eviction=policy, on_event=self.on_event)
        self.model: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self.reqs: list[_Req] = []

    def on_event(self, e: CacheEvent) -> None:
        if e.kind == "evict":
            for end in range(e.start + self.ps, len(e.tokens) + 1, self.ps):
                del self.model[(e.extra, tuple(e.tokens[:end]))]

    def expected(self, key: CacheKey) -> list[int]:
        out: list[int] = []
        for end in range(self.ps, len(key.tokens) + 1, self.ps):
            page = self.model.get((key.extra, tuple(key.tokens[:end])))
            if page is None:
                break
            out += page
        return out

    tokens = st.lists(st.integers(0, 2), max_size=14)
    extras = st.sampled_from(["", "x"])

    @rule(tokens=tokens, extra=extras)
    def match_only(self, tokens: list[int], extra: str) -> None:
        key = CacheKey(tokens, extra)
        assert self.cache.match_prefix(key).slots == self.expected(key)

    @rule(tokens=tokens, extra=extras)
    def admit(self, tokens: list[int], extra: str) -> None:
        key = CacheKey(tokens, extra)
        m = self.cache.match_prefix(key)
        assert m.slots == self.expected(key)
        self.cache.lock(m.node)
        need = len(tokens) - m.length
        own = self.alloc.alloc(need)
        if own is None:
            self.cache.evict(self.alloc.round_up(need) - self.alloc.available)
            own = self.alloc.alloc(need)
        if own is None:
            self.cache.unlock(m.node)
            return
        self.reqs.append(_Req(key, m.node, m.length, m.slots, own))

    @precondition(lambda self: bool(self.reqs))
    @rule(pick=st.integers(0, 1 << 16))
    def finish(self, pick: int) -> None:
        r = self.reqs.pop(pick % len(self.reqs))
        n = len(r.key.tokens)
        slots = r.matched + r.own[: n - r.match_len]
        want = len(self.expected(r.key))
        cached = self.cache.insert(r.key, slots)
        assert cached == want and cached >= r.match_len
        aligned = self.cache.aligned_len(n)
        for end in range(cached + self.ps, aligned + 1, self.ps):
            self.model[(r.key.extra, tuple(r.key.tokens[:end]))] = slots[end - self.ps : end]
        m = r.match_len
        self.alloc.free(r.own[: cached - m] + r.own[aligned - m :])
        self.cache.unlock(r.node)

    @rule(n=st.integers(0, 40))
    def evict(self, n: int) -> None:
        before = self.cache.evictable_size
        freed = self.cache.evict(n)
        assert freed >= min(n, before) and self.cache.evictable_size == before - freed

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "cache"):
            return
        c = self.cache
        c.sanity_check()
        held = sum(len(r.own) for r in self.reqs)
        assert self.alloc.available + c.evictable_size + c.protected_size + held == self.alloc.size
        tree = [s for page in self.model.values() for s in page]
        owned = tree + [s for r in self.reqs for s in r.own]
        assert len(owned) == len(set(owned)), "a slot is owned twice"
        assert all(self.alloc.is_allocated(s) for s in owned)
        assert len(tree) == c.total_size()
        locked = {
            (r.key.extra, tuple(r.key.tokens[:end]))
            for r in self.reqs
            for end in range(self.ps, r.match_len + 1, self.ps)
        }
        assert c.protected_size == len(locked) * self.ps

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        while self.reqs:
            self.finish(0)
        c = self.cache
        assert c.protected_size == 0
        assert self.alloc.available + c.evictable_size == self.alloc.size
        c.evict(self.alloc.size)
        assert self.alloc.available == self.alloc.size and not self.model


CacheMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
test_cache_state_machine = CacheMachine.TestCase
