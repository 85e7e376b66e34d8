"""Small helpers shared by the radix-tree caches: key conversion, fast prefix comparison, checks.

Pure functions over `array('i')` keys. `common_prefix` is the hot-path comparison: array slice
equality is a C memcmp, so a long edge is compared in a few C passes and only a mismatching edge
pays for a bisection down to `_SCAN_CHUNK` tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Protocol

# Below this many tokens a Python scan is cheaper than more rounds of slicing.
_SCAN_CHUNK = 32


def as_array(tokens: Sequence[int]) -> array[int]:
    """`tokens` as array('i'), without copying when it already is one."""
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens
    return array("i", tokens)


def common_prefix(key: array[int], pos: int, edge: array[int], limit: int) -> int:
    """Length of the common prefix of key[pos:pos+limit] and edge[:limit]; limit <= len(edge)."""
    if key[pos : pos + limit] == (edge if limit == len(edge) else edge[:limit]):
        return limit
    # Invariant: the first `lo` tokens agree, and a mismatch lies in [lo, hi).
    lo, hi = 0, limit
    while hi - lo > _SCAN_CHUNK:
        mid = (lo + hi) // 2
        if key[pos + lo : pos + mid] == edge[lo:mid]:
            lo = mid
        else:
            hi = mid
    for i in range(lo, hi):
        if key[pos + i] != edge[i]:
            return i
    return hi


def child_key(tokens: array[int], pos: int, page_size: int) -> int | bytes:
    """The dict key of the child whose edge starts at tokens[pos]: its first token, or its first
    page as bytes when page_size > 1 (children of one node differ in their first page)."""
    if page_size == 1:
        return tokens[pos]
    return tokens[pos : pos + page_size].tobytes()


def check(cond: bool, msg: str) -> None:
    """Raise AssertionError(msg) unless cond. Not `assert`: sanity checks must also run under -O."""
    if not cond:
        raise AssertionError(msg)


class _PathNode(Protocol):
    parent: Any
    lock_ref: int
    key: array[int]


def lock_path(node: _PathNode) -> int:
    """Add one reference to every node from ``node`` up to (not including) the root; returns how
    many tokens became locked (nodes whose count went 0 -> 1)."""
    newly = 0
    while node.parent is not None:
        if node.lock_ref == 0:
            newly += len(node.key)
        node.lock_ref += 1
        node = node.parent
    return newly


def unlock_path(node: _PathNode) -> int:
    """Drop one reference along the same path; returns how many tokens became unlocked."""
    released = 0
    while node.parent is not None:
        node.lock_ref -= 1
        if node.lock_ref == 0:
            released += len(node.key)
        node = node.parent
    return released
