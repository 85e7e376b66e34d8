"""The prefix tree's node and what its queries return (``tree.py``)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from services.scheduler.memory.base import CacheHandle

EvictionPolicy = Literal["lru", "lfu"]
FreeStates = Callable[[list[int]], None]
"""Returns state slots to their allocator; the tree calls it for states it evicts or declines."""
OnRemove = Callable[[str, "array[int]", int, list[int], "int | None"], None]
"""Told of every evicted node before its slots are freed: (extra, tokens from the root through the
node's end, where the node's own tokens start, its KV slots (empty when only its state goes), its
state slot or None). The host tier's write_back copies them out."""


class TreeNode(CacheHandle):
    __slots__ = ("children", "depth", "evicted", "extra", "hits", "key", "last_access", "lock_ref", "own_lock",
                 "parent", "state", "state_access", "value")

    def __init__(self, key: array[int], value: list[int], parent: TreeNode | None, extra: str) -> None:
        self.children: dict[int | bytes, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.extra = extra
        # Tokens from the root through the end of this node: what a hit on its state saves.
        self.depth: int = (parent.depth if parent is not None else 0) + len(key)
        self.state: int | None = None
        # Locks held at this node or below it (they protect the KV path); locks held at this node.
        self.lock_ref = 0
        self.own_lock = 0
        self.last_access = 0
        self.state_access = 0
        self.hits = 0
        self.evicted = False


@dataclass(slots=True)
class TreeBooks:
    """What a ``PrefixTree`` keeps about its nodes besides the nodes: its roots (one per extra key),
    the eviction candidates and the sizes of its invariant (``free + evictable + protected ==
    size``). ``tree.py`` keeps them as it matches, inserts and locks, ``tree_evict.py`` as it
    removes nodes, and ``tree_check.py`` recounts them from the nodes."""

    roots: dict[str, TreeNode] = field(default_factory=dict)
    leaves: set[TreeNode] = field(default_factory=set)  # childless non-root nodes: KV eviction candidates
    stateful: set[TreeNode] = field(default_factory=set)  # nodes with a state: state eviction candidates
    evictable: int = 0  # KV slots in unlocked nodes
    protected: int = 0  # KV slots in locked nodes
    state_evictable: int = 0
    state_protected: int = 0


class TreeMatch(NamedTuple):
    """`slots`: owned list of the KV slots of the served prefix. `node`: the handle to lock (a root
    when nothing is served). `state`: the state slot after `slots`, to copy and never write (None
    without states or when nothing is served). `kv_len`: how far the key follows the tree by KV
    alone (through tombstones, into an edge), whole pages, >= len(slots): where it branches off."""

    slots: list[int]
    node: CacheHandle
    state: int | None
    kv_len: int

    @property
    def length(self) -> int:
        return len(self.slots)


class InsertResult(NamedTuple):
    """`cached_len`: as PrefixCache.insert. `state_taken`: the state slot passed in is now a node's;
    False means there was none, or the tree already freed it (surplus, or not page-aligned)."""

    cached_len: int
    state_taken: bool


def path_tokens(node: TreeNode) -> array[int]:
    """Tokens from the root through the end of ``node``."""
    keys: list[array[int]] = []
    cur: TreeNode | None = node
    while cur is not None:
        keys.append(cur.key)
        cur = cur.parent
    out = array("i")
    for k in reversed(keys):
        out.extend(k)
    return out


def owned(part: Sequence[int]) -> list[int]:
    """``part`` as a list the tree owns (a slice of a list already is a fresh one)."""
    return part if isinstance(part, list) else list(part)
