"""The prefix tree: token prefixes -> KV slots, page-aligned, with ref-count locks, and, for models
with recurrent layers, an optional state per node. One tree for every model kind.

    roots[extra] ── [1 2 3] s1 ── [4 5] † ─┬─ [6 7] s2          edge keys are array('i'), values
                 └─ [10 11 12] s3          └─ [60 70] s4        lists of KV slots; sN: state slot

Each extra key (cache_salt, adapter id) has its own root, so different extras never share nodes; a
root is dropped when its last child goes, so per-user salts do not accumulate.

**Without states** (dense models; ``free_states`` is None) every node end is a valid match end: a
match follows the key as far as whole pages agree, splitting the edge where it stops, so the
returned handle ends exactly at the matched length.

**With states** (hybrid models) a cached prefix is usable only together with the recurrent state
right after its last token, so a node may carry the slot of that state. A node without one is a
*tombstone* (its state was evicted, or a split made it): it keeps its KV for its children, but a
match never ends there; it falls back to the deepest node on the path that has a state. Matching
[1 2 3 4 5] above serves 3 tokens and s1; [1 .. 5 60 70] serves 7 and s4. A match never changes the
tree's shape. Leaves are never tombstones: a tombstone left without children is removed. A state
slot passed to ``insert_checkpoint`` always becomes the tree's: kept as the node's state, or freed
at once (surplus: the node has one; or the key does not end on a page boundary). The tree hands
out slot ids and never copies bytes: the scheduler orders copy-on-write and forks (see
``memory/states.py``).

Recency and frequency. A match refreshes the KV recency (one tick for the whole served path, so no
node is older than a descendant touched with it) and counts a hit on each served node; an insert
refreshes the path. A state's recency is refreshed only where it is *used*: where a match ends, and
where an insert attaches or re-offers one, so a chain of turn-by-turn checkpoints lets its stale
inner states age out.

Eviction is a policy of this one tree: KV leaves go least recently used first ("lru", deeper first
on ties) or least frequently hit first ("lfu", LRU on ties); states go by ``state_policy`` ("lru"
or "marconi", see ``state_policy``). Hot path: a child is found by one dict lookup on its first page
and an edge is compared with array slice equality (a C memcmp; see ``tree_util``).

**Cache off** (``keep=False``) is the same tree kept empty: a match finds nothing, and an insert
frees at once the whole pages (and the state) it would have cached and returns 0, so nothing ever
becomes evictable or protected and every caller's share of the slots is what it is with the cache on.

A node keeps its identity across splits as the *deeper* half: a handle always names the node that
ends where its match ended. Not thread-safe: the scheduler's loop is the only caller.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from services.scheduler.memory import tree_evict
from services.scheduler.memory.base import (
    CacheEvent,
    CacheHandle,
    CacheKey,
    EventSink,
    FreeSlots,
    MatchResult,
    PrefixCache,
)
from services.scheduler.memory.state_policy import DEFAULT_MARCONI_ALPHA, StatePolicy
from services.scheduler.memory.tree_node import (
    EvictionPolicy,
    FreeStates,
    InsertResult,
    OnRemove,
    TreeBooks,
    TreeMatch,
    TreeNode,
    owned,
)
from services.scheduler.memory.tree_util import as_array, child_key, common_prefix, lock_path, unlock_path

__all__ = ["EvictionPolicy", "InsertResult", "PrefixTree", "TreeMatch", "TreeNode"]

class PrefixTree(PrefixCache):
    """See PrefixCache for the contract and the module docstring for states. Beyond PrefixCache:
    with states, `insert` keeps new KV only under a node that gets a state (a new suffix is cached
    only with a state slot for a key of whole pages, otherwise its slots are freed at once, so the
    caller's share is still `slots[m:cached]`); `lock` protects the path and the handle's state and
    raises ValueError on a node without one; `evict_states(n)` frees n unlocked states (an inner
    node becomes a tombstone, a leaf goes with its KV)."""

    def __init__(
        self,
        page_size: int,
        free_slots: FreeSlots,
        free_states: FreeStates | None = None,
        *,
        eviction: EvictionPolicy = "lru",
        state_policy: StatePolicy = "lru",
        marconi_alpha: float = DEFAULT_MARCONI_ALPHA,
        on_event: EventSink | None = None,
        keep: bool = True,
    ) -> None:
        super().__init__(page_size, free_slots)
        if eviction not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {eviction!r}")
        if state_policy not in ("lru", "marconi"):
            raise ValueError(f"unknown state eviction policy {state_policy!r}")
        if not 0.0 <= marconi_alpha <= 1.0:
            raise ValueError(f"marconi_alpha must be in [0, 1], got {marconi_alpha}")
        self.eviction: EvictionPolicy = eviction
        self.state_policy: StatePolicy = state_policy
        self.marconi_alpha = marconi_alpha
        self.has_states = free_states is not None
        self.keep = keep  # False: cache off (see the module docstring)
        self._free_states = free_states
        self.on_event = on_event
        self.books = TreeBooks()  # the roots, the candidate sets and the counts (tree_evict, tree_check)
        self._tick = 0  # logical clock: deterministic, never ties between operations
        self._detached_root = TreeNode(array("i"), [], None, "")  # the handle of a miss on a rootless extra
        self.on_remove: OnRemove | None = None

    # -- queries --------------------------------------------------------------------------------

    def match(self, key: CacheKey, *, touch: bool = True) -> TreeMatch:
        """The longest usable prefix of `key` (whole pages; with states, up to the deepest state).
        `touch=False` only looks: no recency, no hit counted (the tree may still split an edge)."""
        root = self.books.roots.get(key.extra)
        ps = self.page_size
        if root is None or len(key.tokens) < ps:
            return TreeMatch([], self._detached_root if root is None else root, None, 0)
        # A miss on the first page is the common case: answer it before converting a long key.
        if child_key(as_array(key.tokens[:ps]), 0, ps) not in root.children:
            return TreeMatch([], root, None, 0)
        tokens = as_array(key.tokens)
        node, pos, partial, m = self._descend(root, tokens, self.aligned_len(len(tokens)))
        if partial is not None and not self.has_states:
            node, pos = self._split(partial, m), pos + m  # a handle ends where its match ends
        elif partial is not None:
            pos += m  # KV reach into the edge; no state sits there
        served = node
        while self.has_states and served.parent is not None and served.state is None:
            served = served.parent
        self._tick += touch
        slots: list[int] = []
        cur = served
        while cur.parent is not None:
            if touch:
                cur.last_access = self._tick
                cur.hits += 1
            slots[:0] = cur.value
            cur = cur.parent
        if served.parent is None:
            return TreeMatch([], served, None, pos)
        if touch:
            served.state_access = self._tick
        return TreeMatch(slots, served, served.state, pos)

    def match_prefix(self, key: CacheKey) -> MatchResult:
        m = self.match(key)
        return MatchResult(m.slots, m.node)

    def kv_path(self, key: CacheKey) -> list[int]:
        """The KV slots the tree holds for `key`'s leading whole pages, through tombstones and into
        an edge (`TreeMatch.kv_len` of them); changes nothing, not even recency."""
        root = self.books.roots.get(key.extra)
        if root is None:
            return []
        tokens = as_array(key.tokens)
        node, _, partial, m = self._descend(root, tokens, self.aligned_len(len(tokens)))
        out: list[int] = list(partial.value[:m]) if partial is not None else []
        while node.parent is not None:
            out[:0] = node.value
            node = node.parent
        return out

    def hits(self, handle: CacheHandle | None) -> int:
        """Matches that served the node `handle` names (0 for a root or None)."""
        return handle.hits if isinstance(handle, TreeNode) else 0

    @property
    def evictable_size(self) -> int:
        return self.books.evictable

    @property
    def protected_size(self) -> int:
        return self.books.protected

    @property
    def state_evictable(self) -> int:
        """States held by the tree whose node is not locked."""
        return self.books.state_evictable

    @property
    def state_protected(self) -> int:
        """States held by the tree whose node is locked (a request is copying from it)."""
        return self.books.state_protected

    # -- mutations ------------------------------------------------------------------------------

    def insert(self, key: CacheKey, slots: Sequence[int]) -> int:
        return self.insert_checkpoint(key, slots, None).cached_len

    def insert_checkpoint(self, key: CacheKey, slots: Sequence[int], state: int | None) -> InsertResult:
        """Insert the KV of `key` (and, with states, the state after its last token, which the
        caller owned: ownership passes to the tree whatever the outcome, see InsertResult)."""
        if len(slots) != len(key.tokens):
            raise ValueError(f"insert: {len(slots)} slots for {len(key.tokens)} tokens")
        if state is not None and not self.has_states:
            raise ValueError("insert: a state slot for a tree without states")
        if not self.keep:  # cache off: keep nothing, free what would have been cached
            n = self.aligned_len(len(slots))
            self.free(owned(slots[:n]) if n else [], [] if state is None else [state])
            return InsertResult(0, False)
        tokens = as_array(key.tokens)
        n = self.aligned_len(len(tokens))
        # A state describes the position after the key's last token: only a node end can hold it.
        attach = not self.has_states or (state is not None and n == len(tokens) and n > 0)
        if state is not None and not attach:
            self.free([], [state])
        if n == 0:
            return InsertResult(0, False)
        root = self.books.roots.get(key.extra)
        if root is None:
            if not attach:
                self._free_slots(owned(slots[:n]))
                return InsertResult(0, False)
            root = self.books.roots[key.extra] = TreeNode(array("i"), [], None, key.extra)
        node, pos, partial, m = self._descend(root, tokens, n)
        self._tick += 1
        end = pos + m
        if not attach:
            if end < n:
                self._free_slots(owned(slots[end:n]))  # would be a leaf without a state
            self._touch_path(node)
            return InsertResult(end, False)
        if partial is not None:
            node = self._split(partial, m)
        if end < n:
            leaf = TreeNode(tokens[end:n], owned(slots[end:n]), node, key.extra)
            node.children[child_key(leaf.key, 0, self.page_size)] = leaf
            self.books.leaves.discard(node)
            self.books.leaves.add(leaf)
            self.books.evictable += n - end
            node = leaf
            if self.on_event is not None:
                self.on_event(CacheEvent("insert", key.extra, end, tokens[:n]))
        self._touch_path(node)
        if state is None:
            return InsertResult(end, False)
        node.state_access = self._tick
        if node.state is not None:
            self.free([], [state])  # the tree already has this state: the fork is surplus
            return InsertResult(end, False)
        node.state = state  # a new leaf, a split point, or a tombstone revived
        self.books.stateful.add(node)
        if node.own_lock:
            self.books.state_protected += 1
        else:
            self.books.state_evictable += 1
        return InsertResult(end, True)

    def lock(self, node: CacheHandle) -> None:
        cur = self._node(node)
        if cur.parent is None:
            return
        if self.has_states and cur.state is None:
            raise ValueError("lock of a node without a state (lock right after match)")
        cur.own_lock += 1
        if self.has_states and cur.own_lock == 1:
            self.books.state_evictable -= 1
            self.books.state_protected += 1
        newly = lock_path(cur)
        self.books.evictable -= newly
        self.books.protected += newly

    def unlock(self, node: CacheHandle) -> None:
        cur = self._node(node)
        if cur.parent is None:
            return
        if cur.own_lock == 0:
            raise ValueError("unlock of a handle that is not locked")
        cur.own_lock -= 1
        if self.has_states and cur.own_lock == 0:
            self.books.state_evictable += 1
            self.books.state_protected -= 1
        released = unlock_path(cur)
        self.books.evictable += released
        self.books.protected -= released

    def evict(self, n: int) -> int:
        """Free at least n KV slots when that many are evictable (unlocked leaves in `eviction`
        order, each with its state, then tombstones left childless); returns the KV slots freed."""
        return tree_evict.evict(self, n)

    def evict_states(self, n: int) -> int:
        """Free up to n unlocked states in `state_policy` order; returns the number freed. An inner
        node keeps its KV as a tombstone; a leaf goes entirely (and tombstones it leaves childless)."""
        return tree_evict.evict_states(self, n)

    def free(self, kv: list[int], states: list[int]) -> None:
        """Give KV slots and state slots that leave the tree back to their allocators."""
        if kv:
            self._free_slots(kv)
        if states:
            assert self._free_states is not None
            self._free_states(states)

    def sanity_check(self) -> None:
        from services.scheduler.memory.tree_check import check_tree

        check_tree(self)

    # -- internals ------------------------------------------------------------------------------

    def _node(self, handle: CacheHandle) -> TreeNode:
        if not isinstance(handle, TreeNode):
            raise TypeError(f"not a prefix tree handle: {type(handle).__name__}")
        if handle.evicted:
            raise ValueError("stale handle: its node was evicted (lock right after match)")
        return handle

    def _descend(self, root: TreeNode, tokens: array[int], n: int) -> tuple[TreeNode, int, TreeNode | None, int]:
        """Follow tokens[:n] (n page-aligned) without changing anything. Returns the deepest node
        reached through whole edges, its end position, and the child whose edge the key follows
        for m more tokens (0 < m < len(edge), whole pages) before stopping, or (None, 0)."""
        node, pos, ps = root, 0, self.page_size
        while pos < n:
            child = node.children.get(child_key(tokens, pos, ps))
            if child is None:
                break
            edge_len = len(child.key)
            m = common_prefix(tokens, pos, child.key, min(edge_len, n - pos))
            m -= m % ps  # the dict lookup matched the first page, so m >= page_size
            if m < edge_len:
                return node, pos, child, m
            node, pos = child, pos + edge_len
        return node, pos, None, 0

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        """Cut node's edge after m tokens; the new upper node (no state, no locks of its own) is
        returned and `node` keeps its identity, its state and the deeper part of the edge."""
        parent = node.parent
        assert parent is not None, "roots have no edge to split"
        upper = TreeNode(node.key[:m], node.value[:m], parent, node.extra)
        upper.lock_ref, upper.last_access, upper.hits = node.lock_ref, node.last_access, node.hits
        parent.children[child_key(upper.key, 0, self.page_size)] = upper
        node.key, node.value, node.parent = node.key[m:], node.value[m:], upper
        upper.children[child_key(node.key, 0, self.page_size)] = node
        return upper

    def _touch_path(self, node: TreeNode) -> None:
        while node.parent is not None:
            node.last_access = self._tick
            node = node.parent
