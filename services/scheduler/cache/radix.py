"""Radix tree prefix cache: token ids -> KV slots, page-aligned, with ref-count locks.

    roots[extra] ── [1 2 3 4] ─┬─ [5 6 7 8 9 10 11 12]     (edge keys are array('i'),
                               └─ [9 9 9 9]                 values are lists of slots)

Each extra key (cache_salt, adapter id) has its own root, so different extras never share nodes;
a root is dropped when its last child is evicted, so per-user salts do not accumulate.

Hot-path cost: a child is found by one dict lookup on its first token (first page when
page_size > 1), and an edge is compared with array slice equality, which CPython does with memcmp.
Only when an edge mismatches does `_common_prefix` bisect for the first differing token, so a
32k-token match costs a few C passes over the key, not a Python loop per token.

A node keeps its identity across splits as the *deeper* half: a handle always names the node that
ends where its match ended, and a split above it never moves that end.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Sequence
from typing import Literal

from services.scheduler.cache.base import (
    CacheEvent,
    CacheHandle,
    CacheKey,
    EventSink,
    FreeSlots,
    MatchResult,
    PrefixCache,
)
from services.scheduler.cache.tree_util import as_array as _as_array
from services.scheduler.cache.tree_util import child_key, lock_path, unlock_path
from services.scheduler.cache.tree_util import common_prefix as _common_prefix

EvictionPolicy = Literal["lru", "lfu"]


class RadixNode(CacheHandle):
    __slots__ = ("children", "evicted", "extra", "hits", "key", "last_access", "lock_ref", "parent", "value")

    def __init__(self, key: array[int], value: list[int], parent: RadixNode | None, extra: str) -> None:
        self.children: dict[int | bytes, RadixNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.extra = extra
        self.lock_ref = 0
        self.last_access = 0
        self.hits = 0
        self.evicted = False


class RadixCache(PrefixCache):
    """See PrefixCache for the contract. `policy` picks the eviction order among unlocked leaves:
    "lru" (least recently matched or inserted first) or "lfu" (fewest matches first, LRU on ties).
    `on_event` receives a CacheEvent for every inserted and every evicted segment."""

    def __init__(
        self,
        page_size: int,
        free_slots: FreeSlots,
        *,
        policy: EvictionPolicy = "lru",
        on_event: EventSink | None = None,
    ) -> None:
        super().__init__(page_size, free_slots)
        if policy not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {policy!r}")
        self.policy: EvictionPolicy = policy
        self._on_event = on_event
        self._roots: dict[str, RadixNode] = {}
        # Childless non-root nodes, locked or not: the eviction candidates.
        self._leaves: set[RadixNode] = set()
        self._evictable = 0
        self._protected = 0
        # A logical clock: deterministic, and never ties between operations.
        self._tick = 0
        # The handle for a miss on an extra that has no root; lock/unlock on any root is a no-op.
        self._detached_root = RadixNode(array("i"), [], None, "")

    # -- queries --------------------------------------------------------------------------------

    def match_prefix(self, key: CacheKey) -> MatchResult:
        root = self._roots.get(key.extra)
        ps = self.page_size
        if root is None or len(key.tokens) < ps:
            return MatchResult([], self._detached_root if root is None else root)
        # A miss on the first page is the common case for new prompts: answer it before paying
        # for converting a long list key to an array.
        if self._child_key(_as_array(key.tokens[:ps])) not in root.children:
            return MatchResult([], root)
        tokens = _as_array(key.tokens)
        slots: list[int] = []
        node, _ = self._walk(root, tokens, self.aligned_len(len(tokens)), slots, hit=True)
        return MatchResult(slots, node)

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    # -- mutations ------------------------------------------------------------------------------

    def insert(self, key: CacheKey, slots: Sequence[int]) -> int:
        tokens = _as_array(key.tokens)
        if len(slots) != len(tokens):
            raise ValueError(f"insert: {len(slots)} slots for {len(tokens)} tokens")
        n = self.aligned_len(len(tokens))
        if n == 0:
            return 0
        root = self._roots.get(key.extra)
        if root is None:
            root = self._roots[key.extra] = RadixNode(array("i"), [], None, key.extra)
        node, pos = self._walk(root, tokens, n, None, hit=False)
        if pos < n:
            part = slots[pos:n]
            value = part if isinstance(part, list) else list(part)
            leaf = RadixNode(tokens[pos:n], value, node, key.extra)
            leaf.last_access = self._tick
            node.children[self._child_key(leaf.key)] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self._evictable += n - pos
            if self._on_event is not None:
                self._on_event(CacheEvent("insert", key.extra, pos, tokens[:n]))
        return pos

    def lock(self, node: CacheHandle) -> None:
        cur = self._node(node)
        newly = lock_path(cur)
        self._evictable -= newly
        self._protected += newly

    def unlock(self, node: CacheHandle) -> None:
        cur = self._node(node)
        if cur.parent is not None and cur.lock_ref == 0:
            raise ValueError("unlock of a handle that is not locked")
        released = unlock_path(cur)
        self._evictable += released
        self._protected -= released

    def evict(self, n: int) -> int:
        if n <= 0:
            return 0
        order = itertools.count()  # tie-breaker: nodes themselves are not comparable
        heap = [(self._priority(leaf), next(order), leaf) for leaf in self._leaves if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < n and heap:
            _, _, leaf = heapq.heappop(heap)
            freed.extend(leaf.value)
            parent = self._remove_leaf(leaf)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent), next(order), parent))
        if freed:
            self._free_slots(freed)
        return len(freed)

    # -- internals ------------------------------------------------------------------------------

    def _child_key(self, tokens: array[int], pos: int = 0) -> int | bytes:
        return child_key(tokens, pos, self.page_size)

    def _node(self, handle: CacheHandle) -> RadixNode:
        if not isinstance(handle, RadixNode):
            raise TypeError(f"not a radix cache handle: {type(handle).__name__}")
        if handle.evicted:
            raise ValueError("stale handle: its node was evicted (lock right after match_prefix)")
        return handle

    def _priority(self, node: RadixNode) -> tuple[int, int]:
        if self.policy == "lfu":
            return (node.hits, node.last_access)
        return (node.last_access, 0)

    def _walk(
        self, root: RadixNode, tokens: array[int], n: int, slots: list[int] | None, *, hit: bool
    ) -> tuple[RadixNode, int]:
        """Follow tokens[:n] (n page-aligned) from root, splitting an edge where the match stops
        inside it, so the returned node ends exactly at the returned matched length."""
        self._tick += 1
        node, pos = root, 0
        while pos < n:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            edge_len = len(child.key)
            # The dict lookup matched the first page, so m >= page_size here.
            m = _common_prefix(tokens, pos, child.key, min(edge_len, n - pos))
            m -= m % self.page_size
            if m < edge_len:
                child = self._split(child, m)
            child.last_access = self._tick
            if hit:
                child.hits += 1
            if slots is not None:
                slots.extend(child.value)
            node, pos = child, pos + m
            if m < edge_len:
                break
        return node, pos

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Cut node's edge after m tokens; the new upper node is returned, `node` keeps the rest."""
        parent = node.parent
        assert parent is not None, "roots have no edge to split"
        upper = RadixNode(node.key[:m], node.value[:m], parent, node.extra)
        upper.lock_ref, upper.last_access, upper.hits = node.lock_ref, node.last_access, node.hits
        parent.children[self._child_key(upper.key)] = upper
        node.key, node.value, node.parent = node.key[m:], node.value[m:], upper
        upper.children[self._child_key(node.key)] = node
        return upper

    def _remove_leaf(self, leaf: RadixNode) -> RadixNode:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        if self._on_event is not None:
            path = self._path_tokens(leaf)
            self._on_event(CacheEvent("evict", leaf.extra, len(path) - len(leaf.key), path))
        del parent.children[self._child_key(leaf.key)]
        self._leaves.discard(leaf)
        self._evictable -= len(leaf.key)
        # Drop references so a stale handle pins no memory.
        leaf.evicted, leaf.parent, leaf.key, leaf.value = True, None, array("i"), []
        if parent.parent is None:
            if not parent.children:
                del self._roots[parent.extra]
        elif not parent.children:
            self._leaves.add(parent)
        return parent

    def _path_tokens(self, node: RadixNode) -> array[int]:
        keys: list[array[int]] = []
        cur: RadixNode | None = node
        while cur is not None:
            keys.append(cur.key)
            cur = cur.parent
        out = array("i")
        for k in reversed(keys):
            out.extend(k)
        return out

    def sanity_check(self) -> None:
        ps = self.page_size
        evictable = protected = 0
        seen: set[int] = set()
        leaves = 0
        for extra, root in self._roots.items():
            _check(root.parent is None and not root.key and root.extra == extra, "malformed root")
            _check(bool(root.children), f"empty root kept for extra {extra!r}")
            stack = [root]
            while stack:
                node = stack.pop()
                child_locks = 0
                for ck, child in node.children.items():
                    _check(child.parent is node and not child.evicted, "broken parent link")
                    _check(child.extra == extra, "node shared across extra keys")
                    _check(len(child.key) > 0 and len(child.key) % ps == 0, "edge not whole pages")
                    _check(len(child.value) == len(child.key), "key/value length mismatch")
                    _check(ck == self._child_key(child.key), "child indexed under the wrong key")
                    _check(child.lock_ref >= 0, "negative lock count")
                    child_locks += child.lock_ref
                    if child.lock_ref:
                        protected += len(child.value)
                    else:
                        evictable += len(child.value)
                    before = len(seen)
                    seen.update(child.value)
                    _check(len(seen) == before + len(child.value), "a slot is cached twice")
                    _check((not child.children) == (child in self._leaves), "leaf set out of date")
                    leaves += not child.children
                    stack.append(child)
                if node is not root:
                    _check(node.lock_ref >= child_locks, "a node has fewer locks than its subtree")
        _check(leaves == len(self._leaves), "leaf set holds removed nodes")
        _check(evictable == self._evictable, f"evictable {self._evictable} != recount {evictable}")
        _check(protected == self._protected, f"protected {self._protected} != recount {protected}")


def _check(cond: bool, msg: str) -> None:
    # Not `assert`: the check must also run under `python -O`.
    if not cond:
        raise AssertionError(msg)
