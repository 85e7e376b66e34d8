"""Mamba radix cache for hybrid models: KV slots of the full-attention layers plus recurrent states.

Reusing a prefix of a hybrid model needs both the KV of every prefix token and the recurrent (Mamba)
state right after its last token. So each node carries its edge's KV slots and, optionally, the
Mamba slot holding the state at its end:

    roots[extra] ── [1 2 3] s1 ── [4 5] † ─┬─ [6 7] s2          sN: Mamba slot of the state at
                 └─ [10 11 12] s3          └─ [60 70] s4        the node's end; †: no state

A node without a state is a *tombstone* (its state was evicted, or it was made by a split): it keeps
its KV for its children, but a match never ends there; it falls back to the deepest node on the
path that still has a state. Matching [1 2 3 4 5] above serves 3 tokens and s1; [1 .. 5 60 70]
serves 7 and s4. Leaves are never tombstones: a tombstone left without children is removed.

Copy-on-write. A cached state is read-only. The cache hands out a state's slot id and never copies
bytes; the scheduler orders the copies, which the worker runs in step-stream order:
- a request that starts from a matched state allocates a private slot and copies the matched state
  into it (copy-on-write) before its first forward; it never writes the matched slot;
- to checkpoint, a request allocates a fresh slot, inserts it here and, if the tree took it, copies
  (forks) its working state into it in the same step, before any later copy can read it.

Ownership of a Mamba slot passed to `insert` always passes to the cache: kept as the node's state,
or freed at once through `free_mamba` when the node already has one (the fork was surplus) or the
key does not end on a page boundary.

Recency. KV recency is refreshed on every node of a matched or inserted path (one tick for the whole
path, so no node is older than a descendant touched with it); only unlocked leaves are evicted, least
recent first. State recency is refreshed only where a state is *used*: at the node a match ends
at, and where insert attaches or re-offers one. A match through s1 to s4 uses s1's KV, not s1's
state, so a chain of turn-by-turn checkpoints lets its stale inner states age out.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Callable, Sequence
from typing import NamedTuple

from services.scheduler.cache.base import CacheHandle, CacheKey, FreeSlots, MatchResult, PrefixCache
from services.scheduler.cache.mamba_policy import DEFAULT_MARCONI_ALPHA, StatePolicy, state_eviction_order
from services.scheduler.cache.tree_util import as_array, check, child_key, common_prefix, lock_path, unlock_path

FreeMamba = Callable[[list[int]], None]
"""Returns Mamba slots to the allocator; the cache calls it for states it evicts or declines."""


class MambaNode(CacheHandle):
    __slots__ = (
        "children",
        "depth",
        "evicted",
        "extra",
        "key",
        "last_access",
        "lock_ref",
        "parent",
        "state",
        "state_access",
        "state_lock",
        "value",
    )

    def __init__(self, key: array[int], value: list[int], parent: MambaNode | None, extra: str) -> None:
        self.children: dict[int | bytes, MambaNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.extra = extra
        # Tokens from the root through the end of this node: what a hit on its state saves.
        self.depth: int = (parent.depth if parent is not None else 0) + len(key)
        self.state: int | None = None
        # Locks held at this node or below it (protects KV); locks held at this node (its state).
        self.lock_ref = 0
        self.state_lock = 0
        self.last_access = 0
        self.state_access = 0
        self.evicted = False


class MambaMatch(NamedTuple):
    """A match that ends at a cached state.

    `slots`: owned list of the KV slots of the served prefix (up to the deepest node with a state).
    `node`: the handle to lock; a root when nothing is served.
    `mamba_slot`: the state after `slots`, to copy (never write), or None when nothing is served.
    `kv_len`: how far the key follows the tree by KV alone (through tombstones, into an edge), in
    whole pages, >= len(slots): where this key branches off, a good place for a checkpoint.
    """

    slots: list[int]
    node: CacheHandle
    mamba_slot: int | None
    kv_len: int

    @property
    def length(self) -> int:
        return len(self.slots)


class InsertResult(NamedTuple):
    """`cached_len`: as PrefixCache.insert. `mamba_taken`: the slot passed in is now a node's state;
    False means there was none, or the cache already freed it (surplus, or not page-aligned)."""

    cached_len: int
    mamba_taken: bool


class MambaRadixCache(PrefixCache):
    """PrefixCache over KV plus one optional Mamba state per node; see the module docstring.

    Contract, beyond PrefixCache:
    - `match` / `match_prefix` serve only up to the deepest node with a state; they never change
      the tree's shape, what is cached or any lock, only recency.
    - `insert(key, slots, mamba_slot)` keeps new KV only under a node that gets a state: a new
      suffix is cached only with a `mamba_slot` for a key of whole pages; otherwise its slots are
      freed through `free_slots` at once (so the caller's share is still `slots[m:cached]`).
    - `lock(h)` protects the KV path from h to the root and h's state; locking a node that has no
      state raises ValueError (lock right after match). `unlock` releases both.
    - `evict(n)` frees >= n KV slots when that many are evictable (unlocked leaves, each with its
      state, then tombstones left childless). `evict_mamba(n)` frees n unlocked states, order by
      `policy`: a node with children becomes a tombstone (KV kept), a leaf is removed with its KV.
    - Not thread-safe: the scheduler's loop is the only caller.
    """

    def __init__(
        self,
        page_size: int,
        free_slots: FreeSlots,
        free_mamba: FreeMamba,
        *,
        policy: StatePolicy = "lru",
        marconi_alpha: float = DEFAULT_MARCONI_ALPHA,
    ) -> None:
        super().__init__(page_size, free_slots)
        if policy not in ("lru", "marconi"):
            raise ValueError(f"unknown state eviction policy {policy!r}")
        if not 0.0 <= marconi_alpha <= 1.0:
            raise ValueError(f"marconi_alpha must be in [0, 1], got {marconi_alpha}")
        self.policy: StatePolicy = policy
        self.marconi_alpha = marconi_alpha
        self._free_mamba = free_mamba
        self._roots: dict[str, MambaNode] = {}
        self._leaves: set[MambaNode] = set()  # childless non-root nodes: KV eviction candidates
        self._stateful: set[MambaNode] = set()  # nodes with a state: state eviction candidates
        self._evictable = 0
        self._protected = 0
        self._mamba_evictable = 0
        self._mamba_protected = 0
        self._tick = 0  # logical clock: deterministic, never ties between operations
        self._detached_root = MambaNode(array("i"), [], None, "")

    # -- queries --------------------------------------------------------------------------------

    def match(self, key: CacheKey) -> MambaMatch:
        root = self._roots.get(key.extra)
        ps = self.page_size
        if root is None or len(key.tokens) < ps:
            return MambaMatch([], self._detached_root if root is None else root, None, 0)
        # A miss on the first page is the common case: answer it before converting a long key.
        if child_key(as_array(key.tokens[:ps]), 0, ps) not in root.children:
            return MambaMatch([], root, None, 0)
        tokens = as_array(key.tokens)
        n = self.aligned_len(len(tokens))
        path: list[MambaNode] = []
        served = 0  # nodes of `path` up to the deepest one with a state
        node, pos = root, 0
        while pos < n:
            child = node.children.get(child_key(tokens, pos, ps))
            if child is None:
                break
            edge_len = len(child.key)
            m = common_prefix(tokens, pos, child.key, min(edge_len, n - pos))
            m -= m % ps
            pos += m
            if m < edge_len:
                break  # inside an edge: KV matches, but no state sits there
            path.append(child)
            node = child
            if child.state is not None:
                served = len(path)
        self._tick += 1
        slots: list[int] = []
        for nd in path[:served]:
            nd.last_access = self._tick
            slots.extend(nd.value)
        if not served:
            return MambaMatch([], root, None, pos)
        end = path[served - 1]
        end.state_access = self._tick
        return MambaMatch(slots, end, end.state, pos)

    def kv_path(self, key: CacheKey) -> list[int]:
        """The KV slots the tree holds for `key`'s leading whole pages, through tombstones and into
        an edge (`MambaMatch.kv_len` of them); changes nothing, not even recency."""
        root = self._roots.get(key.extra)
        if root is None:
            return []
        tokens = as_array(key.tokens)
        node, _, partial, m = self._descend(root, tokens, self.aligned_len(len(tokens)))
        out: list[int] = list(partial.value[:m]) if partial is not None else []
        while node.parent is not None:
            out[:0] = node.value
            node = node.parent
        return out

    def match_prefix(self, key: CacheKey) -> MatchResult:
        """PrefixCache view of `match` (without the state slot)."""
        m = self.match(key)
        return MatchResult(m.slots, m.node)

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    @property
    def mamba_evictable(self) -> int:
        """States held by the cache whose node is not locked."""
        return self._mamba_evictable

    @property
    def mamba_protected(self) -> int:
        """States held by the cache whose node is locked (a request is copying from it)."""
        return self._mamba_protected

    # -- mutations ------------------------------------------------------------------------------

    def insert(self, key: CacheKey, slots: Sequence[int], mamba_slot: int | None = None) -> int:
        return self.insert_checkpoint(key, slots, mamba_slot).cached_len

    def insert_checkpoint(self, key: CacheKey, slots: Sequence[int], mamba_slot: int | None) -> InsertResult:
        """Insert the KV of `key` and the state after its last token (a fork the caller owned).
        Ownership of `mamba_slot` passes to the cache whatever the outcome (see InsertResult)."""
        tokens = as_array(key.tokens)
        if len(slots) != len(tokens):
            raise ValueError(f"insert: {len(slots)} slots for {len(tokens)} tokens")
        n = self.aligned_len(len(tokens))
        # A state describes the position after the key's last token, and only a node end can hold
        # it: a key that ends mid-page has no such node.
        attach = mamba_slot is not None and n == len(tokens) and n > 0
        if mamba_slot is not None and not attach:
            self._free_mamba([mamba_slot])
        if n == 0:
            return InsertResult(0, False)
        root = self._roots.get(key.extra)
        if root is None:
            if not attach:
                self._free_slots(_owned(slots[:n]))
                return InsertResult(0, False)
            root = self._roots[key.extra] = MambaNode(array("i"), [], None, key.extra)
        node, pos, partial, m = self._descend(root, tokens, n)
        self._tick += 1
        end = pos + m
        if not attach:
            if end < n:
                self._free_slots(_owned(slots[end:n]))  # would be a leaf without a state
            self._touch_path(node)
            return InsertResult(end, False)
        assert mamba_slot is not None
        if partial is not None:
            node = self._split(partial, m)
        if end < n:
            leaf = MambaNode(tokens[end:n], _owned(slots[end:n]), node, key.extra)
            node.children[child_key(leaf.key, 0, self.page_size)] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self._evictable += n - end
            node = leaf
        self._touch_path(node)
        node.state_access = self._tick
        if node.state is not None:
            self._free_mamba([mamba_slot])  # the tree already has this state: the fork is surplus
            return InsertResult(end, False)
        # A new leaf, a split point, or a tombstone revived.
        node.state = mamba_slot
        self._stateful.add(node)
        if node.state_lock:
            self._mamba_protected += 1
        else:
            self._mamba_evictable += 1
        return InsertResult(end, True)

    def lock(self, node: CacheHandle) -> None:
        cur = self._node(node)
        if cur.parent is None:
            return
        if cur.state is None:
            raise ValueError("lock of a node without a state (lock right after match)")
        cur.state_lock += 1
        if cur.state_lock == 1:
            self._mamba_evictable -= 1
            self._mamba_protected += 1
        newly = lock_path(cur)
        self._evictable -= newly
        self._protected += newly

    def unlock(self, node: CacheHandle) -> None:
        cur = self._node(node)
        if cur.parent is None:
            return
        if cur.state_lock == 0:
            raise ValueError("unlock of a handle that is not locked")
        cur.state_lock -= 1
        if cur.state_lock == 0:
            self._mamba_evictable += 1
            self._mamba_protected -= 1
        released = unlock_path(cur)
        self._evictable += released
        self._protected -= released

    def evict(self, n: int) -> int:
        """Free at least n KV slots (least recently used unlocked leaves first, each with its state)
        when that many are evictable; returns the KV slots freed."""
        if n <= 0:
            return 0
        order = itertools.count()  # tie-breaker: nodes themselves are not comparable
        heap = [(lf.last_access, -lf.depth, next(order), lf) for lf in self._leaves if lf.lock_ref == 0]
        heapq.heapify(heap)
        kv: list[int] = []
        states: list[int] = []
        while len(kv) < n and heap:
            leaf = heapq.heappop(heap)[-1]
            up = self._remove_leaf(leaf, kv, states)
            if up is not None and up.lock_ref == 0:
                heapq.heappush(heap, (up.last_access, -up.depth, next(order), up))
        self._release(kv, states)
        return len(kv)

    def evict_mamba(self, n: int) -> int:
        """Free up to n unlocked states in `policy` order; returns the number freed. An inner node
        keeps its KV as a tombstone; a leaf goes entirely (and tombstones it leaves childless)."""
        if n <= 0:
            return 0
        cands = [nd for nd in self._stateful if nd.state_lock == 0]
        ranked = state_eviction_order(
            [c.state_access for c in cands], [c.depth for c in cands], self.policy, self.marconi_alpha
        )
        kv: list[int] = []
        states: list[int] = []
        for i in ranked[:n]:
            node = cands[i]
            if node.children:
                assert node.state is not None
                states.append(node.state)
                node.state = None
                self._stateful.discard(node)
                self._mamba_evictable -= 1
            else:
                self._remove_leaf(node, kv, states)
        self._release(kv, states)
        return len(states)

    # -- internals ------------------------------------------------------------------------------

    def _node(self, handle: CacheHandle) -> MambaNode:
        if not isinstance(handle, MambaNode):
            raise TypeError(f"not a Mamba radix cache handle: {type(handle).__name__}")
        if handle.evicted:
            raise ValueError("stale handle: its node was evicted (lock right after match)")
        return handle

    def _descend(self, root: MambaNode, tokens: array[int], n: int) -> tuple[MambaNode, int, MambaNode | None, int]:
        """Follow tokens[:n] (n page-aligned) without changing anything. Returns the deepest node
        reached through whole edges, its end position, and the child whose edge the key follows
        for m more tokens (0 < m < len(edge), whole pages) before stopping, or (None, 0)."""
        node, pos = root, 0
        while pos < n:
            child = node.children.get(child_key(tokens, pos, self.page_size))
            if child is None:
                break
            edge_len = len(child.key)
            m = common_prefix(tokens, pos, child.key, min(edge_len, n - pos))
            m -= m % self.page_size
            if m < edge_len:
                return node, pos, child, m
            node, pos = child, pos + edge_len
        return node, pos, None, 0

    def _split(self, node: MambaNode, m: int) -> MambaNode:
        """Cut node's edge after m tokens; the new upper node (no state, no locks of its own) is
        returned and `node` keeps its identity, its state and the deeper part of the edge."""
        parent = node.parent
        assert parent is not None, "roots have no edge to split"
        upper = MambaNode(node.key[:m], node.value[:m], parent, node.extra)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        parent.children[child_key(upper.key, 0, self.page_size)] = upper
        node.key, node.value, node.parent = node.key[m:], node.value[m:], upper
        upper.children[child_key(node.key, 0, self.page_size)] = node
        return upper

    def _touch_path(self, node: MambaNode) -> None:
        while node.parent is not None:
            node.last_access = self._tick
            node = node.parent

    def _remove_leaf(self, leaf: MambaNode, kv: list[int], states: list[int]) -> MambaNode | None:
        """Remove an unlocked leaf, then every tombstone that this leaves childless, collecting
        their KV and states. Returns the ancestor that became a (stateful) leaf, if any."""
        node = leaf
        while True:
            parent = node.parent
            assert parent is not None and not node.children and node.lock_ref == 0
            kv.extend(node.value)
            if node.state is not None:
                states.append(node.state)
                self._stateful.discard(node)
                self._mamba_evictable -= 1
            del parent.children[child_key(node.key, 0, self.page_size)]
            self._leaves.discard(node)
            self._evictable -= len(node.key)
            # Drop references so a stale handle pins no memory.
            node.evicted, node.parent, node.key, node.value, node.state = True, None, array("i"), [], None
            if parent.parent is None:
                if not parent.children:
                    del self._roots[parent.extra]
                return None
            if parent.children:
                return None
            if parent.state is not None:
                self._leaves.add(parent)
                return parent
            # A childless tombstone would be a leaf without a state. It cannot be locked: a lock
            # sits at a node with a state, and every lock below it left with its child.
            check(parent.lock_ref == 0, "a childless tombstone is locked")
            node = parent

    def _release(self, kv: list[int], states: list[int]) -> None:
        if kv:
            self._free_slots(kv)
        if states:
            self._free_mamba(states)

    def sanity_check(self) -> None:
        ps = self.page_size
        evictable = protected = m_evictable = m_protected = leaves = stateful = 0
        seen_kv: set[int] = set()
        seen_states: set[int] = set()
        for extra, root in self._roots.items():
            check(root.parent is None and not root.key and root.extra == extra, "malformed root")
            check(root.state is None and root.state_lock == 0, "a root holds a state or a lock")
            check(bool(root.children), f"empty root kept for extra {extra!r}")
            stack = [root]
            while stack:
                node = stack.pop()
                child_locks = 0
                for ck, child in node.children.items():
                    check(child.parent is node and not child.evicted, "broken parent link")
                    check(child.extra == extra, "node shared across extra keys")
                    check(len(child.key) > 0 and len(child.key) % ps == 0, "edge not whole pages")
                    check(len(child.value) == len(child.key), "key/value length mismatch")
                    check(child.depth == node.depth + len(child.key), "stale depth")
                    check(ck == child_key(child.key, 0, ps), "child indexed under the wrong key")
                    child_locks += child.lock_ref
                    stack.append(child)
                if node is root:
                    continue
                check(node.state_lock >= 0, "negative state lock count")
                check(node.lock_ref == node.state_lock + child_locks, "lock counts disagree with the subtree")
                if node.lock_ref:
                    protected += len(node.value)
                else:
                    evictable += len(node.value)
                before = len(seen_kv)
                seen_kv.update(node.value)
                check(len(seen_kv) == before + len(node.value), "a KV slot is cached twice")
                check((not node.children) == (node in self._leaves), "leaf set out of date")
                check(bool(node.children) or node.state is not None, "a leaf is a tombstone")
                leaves += not node.children
                check((node.state is not None) == (node in self._stateful), "stateful set out of date")
                if node.state is None:
                    check(node.state_lock == 0, "a lock on a node without a state")
                    continue
                stateful += 1
                check(node.state not in seen_states, f"Mamba slot {node.state} is cached twice")
                seen_states.add(node.state)
                if node.state_lock:
                    m_protected += 1
                else:
                    m_evictable += 1
        check(leaves == len(self._leaves), "leaf set holds removed nodes")
        check(stateful == len(self._stateful), "stateful set holds removed nodes")
        check(evictable == self._evictable, f"evictable {self._evictable} != recount {evictable}")
        check(protected == self._protected, f"protected {self._protected} != recount {protected}")
        check(m_evictable == self._mamba_evictable, f"mamba_evictable {self._mamba_evictable} != {m_evictable}")
        check(m_protected == self._mamba_protected, f"mamba_protected {self._mamba_protected} != {m_protected}")


def _owned(part: Sequence[int]) -> list[int]:
    # A slice of a list is already a fresh list; anything else is copied so the tree owns it.
    return part if isinstance(part, list) else list(part)
