"""Mamba radix cache: tombstones and fallback, revival, surplus forks, state locks, cascading
removal, pages, Marconi ordering, checkpoint placement, and a stateful run of random operations that
keeps both pools' books balanced against an exact model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.scheduler.memory.allocator import DoubleFreeError, SlotAllocator
from services.scheduler.memory.base import CacheHandle, CacheKey, PrefixCache
from services.scheduler.memory.state_alloc import MambaSlotAllocator
from services.scheduler.memory.state_policy import StatePolicy, checkpoint_positions, state_eviction_order
from services.scheduler.memory.tree import InsertResult, PrefixTree
from services.scheduler.memory.tree_util import as_array, common_prefix


class Env:
    """Two allocators and the cache wired together, as the scheduler wires them."""

    def __init__(
        self, page_size: int = 1, policy: StatePolicy = "lru", kv_size: int = 64, mamba_size: int = 16
    ) -> None:
        self.kv = SlotAllocator(kv_size, page_size)
        self.mamba = MambaSlotAllocator(mamba_size)
        self.cache = PrefixTree(page_size, self.kv.free, self.mamba.free_many, state_policy=policy)

    def put(self, tokens: list[int]) -> tuple[InsertResult, list[int], int]:
        """A request that computed `tokens` from scratch forks its state and caches KV and fork."""
        own = self.kv.alloc(len(tokens))
        fork = self.mamba.alloc()
        assert own is not None and fork is not None
        slots = own[: len(tokens)]
        res = self.cache.insert_checkpoint(CacheKey(tokens), slots, fork)
        self.kv.free(own[: res.cached_len] + own[self.cache.aligned_len(len(tokens)) :])
        return res, slots, fork

    def served(self, tokens: list[int]) -> int:
        return self.cache.match(CacheKey(tokens)).length

    def check(self, held_states: int = 0) -> None:
        c = self.cache
        c.sanity_check()
        assert self.kv.available + c.evictable_size + c.protected_size == self.kv.size
        assert self.mamba.available + c.state_evictable + c.state_protected + held_states == self.mamba.size


def test_acceptance_scenario() -> None:
    """Tree after the four inserts (sN = forked state; † = no state, made by the split):

        [1 2 3] s1 ── [4 5] † ─┬─ [6 7] s2
        [10 11 12] s3          └─ [60 70] s4

    Access order, so that LRU is deterministic (one logical tick per operation):
        t1..t4  the four inserts (each attaches its state: state last-use s1=t1 s2=t2 s3=t3 s4=t4)
        t5      a reader re-reads [1..7]: serves s2; KV of [1 2 3] [4 5] [6 7] touched
    KV leaves by last use: [10 11 12] (t3) < [60 70] (t4) < [6 7] (t5), so evict(1) takes the
    whole leaf [10 11 12] with s3. States by last use: s1 (t1: matches went *through* it, never
    ended at it) < s4 (t4) < s2 (t5), so evict_states(1) turns [1 2 3] into a tombstone.
    """
    env = Env()
    _, _, s1 = env.put([1, 2, 3])
    _, _, s2 = env.put([1, 2, 3, 4, 5, 6, 7])
    _, _, s3 = env.put([10, 11, 12])
    res, _, s4 = env.put([1, 2, 3, 4, 5, 60, 70])
    assert res == InsertResult(5, True)
    assert env.served([1, 2, 3, 4, 5, 6, 7]) == 7
    env.check()

    assert env.cache.evict(1) == 3  # a leaf goes whole: [10 11 12]
    assert not env.mamba.is_allocated(s3)
    assert env.served([10, 11, 12]) == 0
    env.check()

    assert env.cache.evict_states(1) == 1
    assert not env.mamba.is_allocated(s1)
    env.check()

    # [1..5] ends at the tombstone [4 5]; its stateful ancestor [1 2 3] is a tombstone too now.
    m = env.cache.match(CacheKey([1, 2, 3, 4, 5]))
    assert (m.length, m.state, m.kv_len) == (0, None, 5)
    m = env.cache.match(CacheKey([1, 2, 3, 4, 5, 60, 70]))
    assert (m.length, m.state) == (7, s4)
    m = env.cache.match(CacheKey([1, 2, 3, 4, 5, 6, 7]))
    assert (m.length, m.state) == (7, s2)

    # s4 was used before s2: it goes, and [60 70] being a leaf, its KV with it.
    assert env.cache.evict_states(1) == 1
    assert not env.mamba.is_allocated(s4)
    assert env.served([1, 2, 3, 4, 5, 60, 70]) == 0
    assert env.served([1, 2, 3, 4, 5, 6, 7]) == 7
    assert env.cache.evictable_size == 7 and env.cache.state_evictable == 1
    env.check()


def test_kv_path_follows_tombstones_and_edges() -> None:
    env = Env()
    _, s123, _ = env.put([1, 2, 3])
    _, s1_7, _ = env.put([1, 2, 3, 4, 5, 6, 7])
    assert env.cache.evict_states(1) == 1  # [1 2 3] becomes a tombstone
    key = CacheKey([1, 2, 3, 4, 5, 9])
    assert env.served(key.tokens) == 0
    assert env.cache.kv_path(key) == s123 + s1_7[3:5]  # through the tombstone, into an edge
    assert env.cache.kv_path(CacheKey([7])) == [] and env.cache.kv_path(CacheKey([1], "other")) == []
    env.check()


def test_exact_insert_revives_a_tombstone() -> None:
    env = Env()
    env.put([1, 2, 3])
    env.put([1, 2, 3, 4, 5, 6])
    assert env.cache.evict_states(1) == 1  # [1 2 3]: least recently used, and inner: tombstone
    assert env.served([1, 2, 3, 9]) == 0
    res, _, fork = env.put([1, 2, 3])
    assert res == InsertResult(3, True)
    m = env.cache.match(CacheKey([1, 2, 3, 9]))
    assert (m.length, m.state) == (3, fork)
    env.check()


def test_surplus_fork_is_reported_and_freed() -> None:
    env = Env()
    _, slots, first = env.put([1, 2, 3])
    res, _, second = env.put([1, 2, 3])
    assert res == InsertResult(3, False)
    assert not env.mamba.is_allocated(second) and env.mamba.is_allocated(first)
    m = env.cache.match(CacheKey([1, 2, 3]))
    assert (m.slots, m.state) == (slots, first)
    env.check()


def test_a_checkpoint_inside_an_edge_splits_it() -> None:
    env = Env()
    _, slots, _ = env.put([1, 2, 3, 4, 5, 6])
    assert env.served([1, 2, 3, 9]) == 0
    assert env.cache.match(CacheKey([1, 2, 3, 9])).kv_len == 3  # the branch point to checkpoint at
    fork = env.mamba.alloc()
    assert fork is not None
    assert env.cache.insert_checkpoint(CacheKey([1, 2, 3]), slots[:3], fork) == InsertResult(3, True)
    m = env.cache.match(CacheKey([1, 2, 3, 9]))
    assert (m.slots, m.state) == (slots[:3], fork)
    env.check()


def test_insert_without_a_state_caches_no_new_kv() -> None:
    env = Env()
    own = env.kv.alloc(3)
    assert own is not None
    assert env.cache.insert(CacheKey([1, 2, 3]), own) == 0  # the cache frees what it cannot keep
    assert env.kv.available == env.kv.size
    _, slots, _ = env.put([1, 2, 3])
    own = env.kv.alloc(6)
    assert own is not None
    assert env.cache.insert(CacheKey([1, 2, 3, 4, 5, 6]), own) == 3
    env.kv.free(own[:3])  # the caller's duplicates, as in the PrefixCache contract
    assert env.cache.match(CacheKey([1, 2, 3, 4, 5, 6])).slots == slots
    env.check()


def test_locked_states_are_never_evicted() -> None:
    env = Env()
    _, _, s_short = env.put([1, 2, 3])
    _, _, s_long = env.put([1, 2, 3, 4, 5, 6])
    m = env.cache.match(CacheKey([1, 2, 3, 7]))
    env.cache.lock(m.node)
    assert (env.cache.state_protected, env.cache.state_evictable) == (1, 1)
    assert env.cache.evict_states(10) == 1  # only the leaf [4 5 6] (with its KV)
    assert env.mamba.is_allocated(s_short) and not env.mamba.is_allocated(s_long)
    assert env.cache.evict_states(1) == 0 and env.cache.evict(10) == 0
    assert env.cache.match(CacheKey([1, 2, 3])).state == s_short
    env.check()
    env.cache.unlock(m.node)
    assert env.cache.evict_states(1) == 1  # a leaf now: it goes whole
    assert env.kv.available == env.kv.size and env.mamba.available == env.mamba.size
    env.check()


def test_a_lock_keeps_the_kv_path_but_not_ancestor_states() -> None:
    env = Env()
    env.put([1, 2, 3])
    env.put([1, 2, 3, 4, 5, 6])
    m = env.cache.match(CacheKey([1, 2, 3, 4, 5, 6]))
    env.cache.lock(m.node)
    assert env.cache.protected_size == 6
    assert env.cache.evict_states(10) == 1  # [1 2 3]'s state: its node becomes a tombstone
    assert env.cache.evict(100) == 0
    assert env.served([1, 2, 3, 4, 5, 6]) == 6 and env.served([1, 2, 3]) == 0
    env.cache.unlock(m.node)
    assert env.cache.evict(1) == 6  # the leaf, then the tombstone it leaves childless
    assert env.kv.available == env.kv.size and env.mamba.available == env.mamba.size
    env.check()


def test_a_tombstone_left_without_children_is_removed() -> None:
    env = Env()
    env.put([1, 2, 3])
    env.put([1, 2, 3, 4, 5, 6])
    env.put([9, 9])
    assert env.cache.evict_states(1) == 1  # [1 2 3] -> tombstone
    assert env.cache.evictable_size == 8
    env.served([9, 9])  # [1..6] is now the least recently used leaf
    assert env.cache.evict_states(1) == 1  # the leaf [4 5 6] goes, and the tombstone above it
    assert env.cache.evictable_size == 2 and env.kv.available == env.kv.size - 2
    env.check()


def test_stale_and_stateless_handles_are_rejected() -> None:
    env = Env()
    env.put([1, 2, 3])
    env.put([1, 2, 3, 4])
    m = env.cache.match(CacheKey([1, 2, 3]))
    env.served([1, 2, 3, 4])  # the leaf's state is now the more recently used
    assert env.cache.evict_states(1) == 1  # [1 2 3] is a tombstone: the handle's state is gone
    with pytest.raises(ValueError):
        env.cache.lock(m.node)
    with pytest.raises(ValueError):
        env.cache.unlock(env.cache.match(CacheKey([1, 2, 3, 4])).node)
    leaf = env.cache.match(CacheKey([1, 2, 3, 4])).node
    env.cache.evict(10)
    with pytest.raises(ValueError):
        env.cache.lock(leaf)
    with pytest.raises(TypeError):
        env.cache.lock(CacheHandle())
    env.check()


def test_page_size_4_states_sit_on_page_ends() -> None:
    env = Env(page_size=4)
    tokens = list(range(10, 18))
    res, slots, _ = env.put(tokens)
    assert res == InsertResult(0, True)
    assert env.cache.match(CacheKey([*tokens, 1, 2])).slots == slots
    assert env.served(tokens[:7]) == 0  # the state is after 8 tokens; 7 reach no state
    changed = [*tokens[:5], 99, *tokens[6:]]  # leaves the tree inside the second page
    m = env.cache.match(CacheKey(changed))
    assert (m.length, m.kv_len) == (0, 4)
    # A state after 6 tokens has no page end to sit on: the fork is declined, nothing new cached.
    own = env.kv.alloc(6)
    fork = env.mamba.alloc()
    assert own is not None and fork is not None
    assert env.cache.insert_checkpoint(CacheKey(changed[:6]), own[:6], fork) == InsertResult(4, False)
    assert not env.mamba.is_allocated(fork)
    env.kv.free(own)
    # The branch point after one page takes a state and splits the edge there.
    res, _, _ = env.put(changed[:4])
    assert res == InsertResult(4, True)
    assert env.cache.match(CacheKey(changed)).slots == slots[:4]
    env.check()
    assert env.cache.evict(100) == 8
    assert env.kv.available == env.kv.size and env.mamba.available == env.mamba.size
    env.check()


def test_extra_keys_never_share_nodes() -> None:
    env = Env()
    own = env.kv.alloc(3)
    fork = env.mamba.alloc()
    assert own is not None and fork is not None
    env.cache.insert_checkpoint(CacheKey([1, 2, 3], "a"), own, fork)
    assert env.cache.match(CacheKey([1, 2, 3], "a")).state == fork
    assert env.cache.match(CacheKey([1, 2, 3], "b")).length == 0
    assert env.served([1, 2, 3]) == 0
    env.check()


def test_prefix_cache_interface() -> None:
    env = Env()
    cache: PrefixCache = env.cache
    _, slots, _ = env.put([1, 2, 3])
    m = cache.match_prefix(CacheKey([1, 2, 3, 4]))
    assert m.slots == slots
    cache.lock(m.node)
    assert cache.protected_size == 3 and cache.evictable_size == 0
    cache.unlock(m.node)
    assert cache.evict(3) == 3 and cache.total_size() == 0
    env.check()


# -- policy --------------------------------------------------------------------------------------


def test_state_eviction_order_lru_and_marconi() -> None:
    # Candidates: a long prefix used long ago, a short one, a medium one used most recently.
    last_use, depth = [1, 2, 3], [100, 4, 8]
    assert state_eviction_order(last_use, depth, "lru") == [0, 1, 2]
    # marconi, alpha 0.5: scores 0.5*0 + 0.5*1 = .5; .5*.5 + .5*.04 = .27; .5*1 + .5*.08 = .54
    assert state_eviction_order(last_use, depth, "marconi") == [1, 0, 2]
    assert state_eviction_order(last_use, depth, "marconi", alpha=0.0) == [0, 1, 2]
    assert state_eviction_order(last_use, depth, "marconi", alpha=1.0) == [1, 2, 0]
    assert state_eviction_order([5, 5], [8, 4], "lru") == [1, 0]  # ties: the shallower first
    with pytest.raises(ValueError):
        state_eviction_order([1, 2], [1, 2], "marconi", alpha=2.0)


def test_marconi_cache_gives_up_a_short_state_before_an_older_long_one() -> None:
    env = Env(policy="marconi", kv_size=256)
    env.put(list(range(100, 200)))  # t1: 100 tokens
    env.put([1, 2, 3, 4])  # t2: 4 tokens
    env.put([7, 7, 7, 7, 7, 7, 7, 7])  # t3: 8 tokens
    assert env.cache.evict_states(1) == 1
    assert env.served([1, 2, 3, 4]) == 0
    assert env.served(list(range(100, 200))) == 100
    env.check()


def test_checkpoint_positions() -> None:
    # chunk grid 4, 8; branch point 6; prompt end 10
    assert checkpoint_positions(10, 4, 1, [6]) == [4, 6, 8, 10]
    # pages of 4: 6 -> 4, 10 -> 8, deduplicated
    assert checkpoint_positions(10, 4, 4, [6]) == [4, 8]
    # already matched up to 4: nothing at or before it; branch points past the prompt are ignored
    assert checkpoint_positions(10, 4, 1, [2, 6, 50], start=4) == [6, 8, 10]
    # the grid is absolute, so requests with different matches checkpoint at the same places
    assert checkpoint_positions(20, 8, 1, [], start=5) == [8, 16, 20]
    assert checkpoint_positions(10, 0, 2, [5]) == [4, 10]  # no chunk grid
    assert checkpoint_positions(10, 4, 1, [6], include_end=False) == [4, 6, 8]
    assert checkpoint_positions(3, 4, 4, []) == []  # shorter than a page: nowhere to put a state
    with pytest.raises(ValueError):
        checkpoint_positions(10, 4, 0, [])


def test_mamba_slot_allocator() -> None:
    alloc = MambaSlotAllocator(3)
    got = [alloc.alloc() for _ in range(4)]
    assert got == [0, 1, 2, None] and alloc.available == 0
    alloc.free(1)
    assert alloc.available == 1 and not alloc.is_allocated(1)
    with pytest.raises(DoubleFreeError):
        alloc.free(1)
    with pytest.raises(DoubleFreeError):
        alloc.free_many([0, 0])
    with pytest.raises(DoubleFreeError):
        alloc.free(3)
    assert alloc.available == 1 and alloc.alloc() == 1


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
    assert common_prefix(as_array(key), pos, as_array(edge), limit) == want


# -- stateful: random operations against an exact model ------------------------------------------


_BASES = (
    list(range(1, 13)),
    [1, 2, 3, 4, 5, 6, *range(20, 26)],
    [1, 2, *range(30, 40)],
)


@dataclass
class _Req:
    key: CacheKey
    node: CacheHandle
    match_len: int
    matched: list[int]
    own: list[int]  # whole KV pages covering tokens [match_len, ...)
    state: int  # private working state (the copy-on-write target)


class MambaCacheMachine(RuleBasedStateMachine):
    """The model: {(extra, prefix of whole pages): KV slots of its last page} and {(extra, prefix):
    state slot}. Rules record what inserts add; evictions are learned from the slots the cache
    frees (a freed page or state leaves the model)."""

    @initialize(page_size=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["lru", "marconi"]))
    def setup(self, page_size: int, policy: StatePolicy) -> None:
        self.ps = page_size
        self.kv = SlotAllocator(48, page_size)
        self.mamba = MambaSlotAllocator(12)
        self.cache = PrefixTree(page_size, self.free_kv, self.free_mamba, state_policy=policy)
        self.pages: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self.page_at: dict[int, tuple[str, tuple[int, ...]]] = {}  # page head slot -> model key
        self.states: dict[tuple[str, tuple[int, ...]], int] = {}
        self.state_at: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.reqs: list[_Req] = []

    def free_kv(self, slots: list[int]) -> None:
        for head in slots[:: self.ps]:
            k = self.page_at.pop(head, None)
            if k is not None:
                del self.pages[k]
        self.kv.free(slots)

    def free_mamba(self, slots: list[int]) -> None:
        for s in slots:
            k = self.state_at.pop(s, None)
            if k is not None:
                del self.states[k]
        self.mamba.free_many(slots)

    def expected(self, key: CacheKey) -> tuple[list[int], int | None, int]:
        """(served slots, served state, KV match length) by the model."""
        slots: list[int] = []
        served: tuple[list[int], int | None] = ([], None)
        kv_len = 0
        for end in range(self.ps, len(key.tokens) + 1, self.ps):
            k = (key.extra, tuple(key.tokens[:end]))
            page = self.pages.get(k)
            if page is None:
                break
            slots += page
            kv_len = end
            if k in self.states:
                served = (list(slots), self.states[k])
        return served[0], served[1], kv_len

    def take_mamba(self) -> int | None:
        slot = self.mamba.alloc()
        if slot is None and self.cache.evict_states(1):
            slot = self.mamba.alloc()
        return slot

    # Keys are prefixes of a few sequences that branch after 2 and 6 tokens, plus a short random
    # tail, so that matches often share prefixes, branch, end on states and cross tombstones.
    tokens = st.builds(
        lambda base, cut, tail: base[:cut] + tail,
        st.sampled_from(_BASES),
        st.integers(1, 12),
        st.lists(st.integers(0, 1), max_size=3),
    )
    extras = st.sampled_from(["", "x"])

    @rule(tokens=tokens, extra=extras)
    def match_only(self, tokens: list[int], extra: str) -> None:
        key = CacheKey(tokens, extra)
        m = self.cache.match(key)
        assert (m.slots, m.state, m.kv_len) == self.expected(key)

    @rule(tokens=tokens, extra=extras)
    def admit(self, tokens: list[int], extra: str) -> None:
        key = CacheKey(tokens, extra)
        m = self.cache.match(key)
        assert (m.slots, m.state, m.kv_len) == self.expected(key)
        self.cache.lock(m.node)
        state = self.take_mamba()
        need = len(tokens) - m.length
        own = self.kv.alloc(need)
        if own is None:
            self.cache.evict(self.kv.round_up(need) - self.kv.available)
            own = self.kv.alloc(need)
        if own is None or state is None:
            if own is not None:
                self.kv.free(own)
            if state is not None:
                self.mamba.free(state)
            self.cache.unlock(m.node)
            return
        self.reqs.append(_Req(key, m.node, m.length, m.slots, own, state))

    @precondition(lambda self: bool(self.reqs))
    @rule(
        pick=st.integers(0, 1 << 16),
        drop=st.one_of(st.just(0), st.integers(0, 14)),
        no_fork=st.integers(0, 3).map(lambda x: x == 0),
    )
    def finish(self, pick: int, drop: int, no_fork: bool) -> None:
        """Checkpoint at a page end p >= match_len (with a fork unless told not to or the pool is
        dry), then retire. Mostly the common case: the whole key, forked."""
        r = self.reqs.pop(pick % len(self.reqs))
        n, m = len(r.key.tokens), r.match_len
        p = self.cache.aligned_len(n - min(drop, n - m))
        slots = r.matched + r.own[: n - m]
        key = CacheKey(r.key.tokens[:p], r.key.extra)
        mamba = None if no_fork else self.take_mamba()
        _, _, want_cached = self.expected(key)
        want_taken = mamba is not None and p > 0 and (key.extra, tuple(key.tokens)) not in self.states
        res = self.cache.insert_checkpoint(key, slots[:p], mamba)
        assert res == InsertResult(want_cached, want_taken) and res.cached_len >= m
        if res.state_taken:
            for end in range(res.cached_len + self.ps, p + 1, self.ps):
                k = (key.extra, tuple(key.tokens[:end]))
                self.pages[k] = slots[end - self.ps : end]
                self.page_at[slots[end - self.ps]] = k
            assert mamba is not None
            self.states[(key.extra, tuple(key.tokens))] = mamba
            self.state_at[mamba] = (key.extra, tuple(key.tokens))
        elif mamba is not None:
            assert not self.mamba.is_allocated(mamba)
        # Ours: duplicates [m, cached) and everything from p on; [cached, p) went to the cache.
        self.kv.free(r.own[: res.cached_len - m] + r.own[p - m :])
        self.mamba.free(r.state)
        self.cache.unlock(r.node)

    @rule(n=st.integers(0, 16))
    def evict(self, n: int) -> None:
        before = self.cache.evictable_size
        freed = self.cache.evict(n)
        assert freed >= min(n, before) and self.cache.evictable_size == before - freed

    @rule(n=st.integers(0, 2))
    def evict_states(self, n: int) -> None:
        before = self.cache.state_evictable
        assert self.cache.evict_states(n) == min(n, before)
        assert self.cache.state_evictable == before - min(n, before)

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "cache"):
            return
        c = self.cache
        c.sanity_check()
        held_kv = sum(len(r.own) for r in self.reqs)
        assert self.kv.available + c.evictable_size + c.protected_size + held_kv == self.kv.size
        held = len(self.reqs)
        assert self.mamba.available + c.state_evictable + c.state_protected + held == self.mamba.size
        assert sum(len(p) for p in self.pages.values()) == c.total_size()
        assert len(self.states) == c.state_evictable + c.state_protected
        assert all(self.mamba.is_allocated(s) for s in self.states.values())
        locked = {id(r.node) for r in self.reqs if r.match_len}
        assert c.state_protected == len(locked)


MambaCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
test_mamba_cache_machine = MambaCacheMachine.TestCase


def test_lfu_on_a_tree_with_states_keeps_the_most_hit_leaf() -> None:
    """LFU is a policy of the one tree, with or without states: the leaf matched most goes last."""
    kv, states = SlotAllocator(16), MambaSlotAllocator(4)
    tree = PrefixTree(1, kv.free, states.free_many, eviction="lfu")
    for toks in ([1, 2], [3, 4], [5, 6]):
        slots, st = kv.alloc(2), states.alloc()
        assert slots is not None and st is not None
        tree.insert_checkpoint(CacheKey(toks), slots, st)
    for _ in range(3):
        assert tree.match(CacheKey([1, 2])).length == 2  # hot, though least recently inserted
    assert tree.match(CacheKey([3, 4])).length == 2
    assert tree.evict(2) == 2
    assert tree.match(CacheKey([5, 6])).length == 0  # never hit: first to go
    assert tree.match(CacheKey([1, 2])).length == 2 and tree.match(CacheKey([3, 4])).length == 2
    assert tree.evict(2) == 2 and tree.match(CacheKey([3, 4])).length == 0
    tree.sanity_check()

