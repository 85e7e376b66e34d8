"""Eviction from the prefix tree (``tree.py``): KV leaves in the tree's ``eviction`` order, states
in its ``state_policy`` order, and the removal of a leaf with the tombstones it leaves childless.
Kept apart so the tree's matching and insertion read without it; it works on the tree's
``books`` (``tree_node.TreeBooks``), as ``tree_check`` does."""

from __future__ import annotations

import heapq
import itertools
from array import array
from typing import TYPE_CHECKING

from services.scheduler.memory.base import CacheEvent
from services.scheduler.memory.state_policy import state_eviction_order
from services.scheduler.memory.tree_node import TreeNode, path_tokens
from services.scheduler.memory.tree_util import child_key

if TYPE_CHECKING:
    from services.scheduler.memory.tree import PrefixTree



def evict(t: PrefixTree, n: int) -> int:
    """Free at least n KV slots when that many are evictable (unlocked leaves in `eviction`
    order, each with its state, then tombstones left childless); returns the KV slots freed."""
    if n <= 0:
        return 0
    order = itertools.count()  # tie-breaker: nodes themselves are not comparable
    heap = [(_priority(t, lf), next(order), lf) for lf in t.books.leaves if lf.lock_ref == 0]
    heapq.heapify(heap)
    kv: list[int] = []
    states: list[int] = []
    while len(kv) < n and heap:
        up = _remove_leaf(t, heapq.heappop(heap)[-1], kv, states)
        if up is not None and up.lock_ref == 0:
            heapq.heappush(heap, (_priority(t, up), next(order), up))
    t.free(kv, states)
    return len(kv)


def evict_states(t: PrefixTree, n: int) -> int:
    """Free up to n unlocked states in `state_policy` order; returns the number freed. An inner
    node keeps its KV as a tombstone; a leaf goes entirely (and tombstones it leaves childless)."""
    if n <= 0 or not t.has_states:
        return 0
    cands = [nd for nd in t.books.stateful if nd.own_lock == 0]
    ranked = state_eviction_order(
        [c.state_access for c in cands], [c.depth for c in cands], t.state_policy, t.marconi_alpha
    )
    kv: list[int] = []
    states: list[int] = []
    for i in ranked[:n]:
        node = cands[i]
        if node.children:
            assert node.state is not None
            if t.on_remove is not None:
                t.on_remove(node.extra, path_tokens(node), node.depth, [], node.state)
            states.append(node.state)
            node.state = None
            t.books.stateful.discard(node)
            t.books.state_evictable -= 1
        else:
            _remove_leaf(t, node, kv, states)
    t.free(kv, states)
    return len(states)


def _priority(t: PrefixTree, node: TreeNode) -> tuple[int, ...]:
    if t.eviction == "lfu":
        return (node.hits, node.last_access, -node.depth)
    return (node.last_access, -node.depth)


def _remove_leaf(t: PrefixTree, leaf: TreeNode, kv: list[int], states: list[int]) -> TreeNode | None:
    """Remove an unlocked leaf, then every tombstone that this leaves childless, collecting
    their KV and states. Returns the ancestor that became an evictable leaf, if any."""
    node = leaf
    while True:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        if t.on_event is not None or t.on_remove is not None:
            path = path_tokens(node)
            if t.on_event is not None:
                t.on_event(CacheEvent("evict", node.extra, len(path) - len(node.key), path))
            if t.on_remove is not None:
                t.on_remove(node.extra, path, len(path) - len(node.key), node.value, node.state)
        kv.extend(node.value)
        if node.state is not None:
            states.append(node.state)
            t.books.stateful.discard(node)
            t.books.state_evictable -= 1
        del parent.children[child_key(node.key, 0, t.page_size)]
        t.books.leaves.discard(node)
        t.books.evictable -= len(node.key)
        # Drop references so a stale handle pins no memory.
        node.evicted, node.parent, node.key, node.value, node.state = True, None, array("i"), [], None
        if parent.parent is None:
            if not parent.children:
                del t.books.roots[parent.extra]
            return None
        if parent.children:
            return None
        t.books.leaves.add(parent)
        if not t.has_states or parent.state is not None:
            return parent
        # A childless tombstone would be a leaf without a state. It cannot be locked: a lock
        # sits at a node with a state, and every lock below it left with its child.
        t.books.leaves.discard(parent)
        node = parent

