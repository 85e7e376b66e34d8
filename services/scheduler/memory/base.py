"""The prefix-cache interface the scheduler programs against (``tree.PrefixTree`` implements it).

Ownership of KV slots, the one thing every implementation must get right:

    request slots:  [ matched (tree's) | own, duplicate | own, handed to tree | own tail ]
                    0           match_len          cached            aligned        len(slots)

    - [0, match_len)        came from match_prefix: the tree's, never freed by the request.
    - [match_len, cached)   the request's copies of tokens that were already cached: the caller frees.
    - [cached, aligned)     ownership passes to the cache inside insert().
    - [aligned, ...)        the partial last page: never cached, the caller frees.

`cached` is what insert() returns; `aligned` is `aligned_len(len(tokens))`. Invariant, checked in
tests and whenever the server is idle: allocator free + evictable_size + protected_size == pool size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

FreeSlots = Callable[[list[int]], None]
"""Returns slots to the allocator; the cache calls it for slots it evicts or declines to keep."""


class CacheKey(NamedTuple):
    """Token ids plus an extra key (cache_salt, adapter id). Different extras never share nodes.

    Passing `tokens` as `array('i')` lets the radix cache skip a per-call conversion.
    """

    tokens: Sequence[int]
    extra: str = ""


class CacheHandle:
    """Opaque position in a cache (the end of a match). Only meaningful to the cache that made it."""

    __slots__ = ()


class MatchResult(NamedTuple):
    """`slots` is an owned list (never a view into the cache) of the matched prefix's KV slots."""

    slots: list[int]
    node: CacheHandle

    @property
    def length(self) -> int:
        return len(self.slots)


class CacheEvent(NamedTuple):
    """A change to what is cached, for a KV-aware router.

    `tokens` is the whole key from the root through the end of the changed segment, so the router
    can rebuild its own hash chain; the segment itself is `tokens[start:]`.
    """

    kind: Literal["insert", "evict"]
    extra: str
    start: int
    tokens: Sequence[int]


EventSink = Callable[[CacheEvent], None]


class PrefixCache(ABC):
    """A cache of KV slots keyed by token prefixes, in whole pages of `page_size` tokens.

    Contract:
    - `match_prefix` does not change what is cached, any size or any lock; it only refreshes access
      statistics (LRU time, LFU hits) along the matched path. The returned slots are only safe to
      use while the returned handle is locked: lock it before any call that may evict.
    - `insert` takes ownership of `slots[cached:aligned]` and returns `cached`, the length already
      in the cache (see the module docstring for which slots the caller still frees). If the caller
      holds a locked match of length m for this key, then `cached >= m` and the caller frees exactly
      `slots[m:cached]`.
    - `lock` / `unlock` add / remove one reference on every node from the handle to the root;
      `protected_size` grows (shrinks) by exactly the length that became locked (unlocked), and
      `evictable_size` moves the opposite way. Unlocking an unlocked handle raises ValueError.
    - `evict(n)` frees at least n slots when that many are evictable, else all that are, through
      the `free_slots` callback; locked slots are never evicted. Returns the number freed.
    """

    def __init__(self, page_size: int, free_slots: FreeSlots) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._free_slots = free_slots

    def aligned_len(self, n: int) -> int:
        """The cacheable part of an n-token key: whole pages only."""
        return n - n % self.page_size

    @abstractmethod
    def match_prefix(self, key: CacheKey) -> MatchResult: ...

    @abstractmethod
    def insert(self, key: CacheKey, slots: Sequence[int]) -> int: ...

    @abstractmethod
    def lock(self, node: CacheHandle) -> None: ...

    @abstractmethod
    def unlock(self, node: CacheHandle) -> None: ...

    @abstractmethod
    def evict(self, n: int) -> int: ...

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Slots held by the cache and not locked."""

    @property
    @abstractmethod
    def protected_size(self) -> int:
        """Slots held by the cache under at least one lock."""

    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    @abstractmethod
    def sanity_check(self) -> None:
        """Raise AssertionError if an internal invariant is broken (cheap enough for tests/idle)."""
