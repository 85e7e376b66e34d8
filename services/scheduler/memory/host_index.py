"""A host-tier index by key: which host page (or host state slot) holds which chained hash.

The host tier (``memory/host_tier.py``) keeps its host (L2) pool as two of these, one over KV
pages and one over states, beside the device's prefix tree: a prefix is found on the host by
walking its page hashes (``services.common.page_hash``) until the first miss, so no tree is
needed. Entries are kept least recently used first; ``touch`` refreshes a run of pages so that its
*first* page ends up most recent (a prefix's deeper pages are evicted before the pages they depend
on). With ``lfu`` eviction takes the entries touched least often first (least recent on ties).

    reserve(n) ──▶ reserved (the caller's) ──add(key, i)──▶ entry ──evict──▶ free
                                         └──release(i)──▶ free       pin/unpin: never evicted

Accounting, checked by ``check``: ``available + evictable + protected + reserved == size``
(protected: entries with a pin). Not thread-safe: the scheduler's loop is the only caller.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from services.scheduler.memory.host_alloc import HostPageAllocator


@dataclass(slots=True)
class HostEntry:
    index: int  # the host page or host state slot
    pins: int = 0  # jobs reading it (a load, an L3 put) or relying on it (a prefetch's prefix)
    l3: bool = False  # a put of it was acknowledged
    hits: int = 0  # touches (LFU)


class HostIndex:
    """Host pages (or host state slots) by key, LRU first; see the module docstring."""

    def __init__(self, alloc: HostPageAllocator, *, lfu: bool = False) -> None:
        self._alloc = alloc
        self.lfu = lfu
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()
        self._pinned = 0  # entries with pins > 0
        self.reserved = 0  # indexes handed out by reserve and not yet added or released
        self.evictions = 0
        self.on_change: Callable[[bytes, bool], None] | None = None  # (key, added): a key came or went

    # -- queries --------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._alloc.num_pages

    def get(self, key: bytes) -> HostEntry | None:
        return self._entries.get(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def protected(self) -> int:
        return self._pinned

    @property
    def evictable(self) -> int:
        return len(self._entries) - self._pinned

    def run(self, keys: Sequence[bytes], start: int) -> int:
        """The end of the run of present keys from ``keys[start]`` (``start`` when it is absent)."""
        end = start
        while end < len(keys) and keys[end] in self._entries:
            end += 1
        return end

    # -- recency --------------------------------------------------------------------------------
    def touch(self, keys: Sequence[bytes]) -> None:
        """Make these entries the most recent, ``keys[0]`` most of all (missing keys are skipped)."""
        for key in reversed(keys):
            e = self._entries.get(key)
            if e is not None:
                e.hits += 1
                self._entries.move_to_end(key)

    # -- space ----------------------------------------------------------------------------------
    def reserve(self, n: int) -> list[int] | None:
        """``n`` free indexes, evicting unpinned entries least recent first; None (nothing evicted)
        when even evicting every unpinned entry would not free enough."""
        if n <= 0:
            return []
        short = n - self._alloc.available
        if short > self.evictable:
            return None
        if short > 0:
            self.evict(short)
        got = self._alloc.alloc(n)
        assert got is not None
        self.reserved += n
        return got

    def evict(self, n: int) -> int:
        """Drop up to ``n`` unpinned entries, least recent first; returns how many went."""
        free = ((k, e) for k, e in self._entries.items() if not e.pins)
        if self.lfu:  # fewest touches first; the entries' order (LRU first) breaks ties
            victims = [k for _, _, k in heapq.nsmallest(n, ((e.hits, i, k) for i, (k, e) in enumerate(free)))]
        else:
            victims = [k for k, _ in itertools.islice(free, n)]
        for key in victims:
            self._alloc.free([self._entries.pop(key).index])
            if self.on_change is not None:
                self.on_change(key, False)
        self.evictions += len(victims)
        return len(victims)

    def release(self, indexes: Iterable[int]) -> None:
        """Give reserved indexes back unused (a failed or short job)."""
        idx = list(indexes)
        self._alloc.free(idx)
        self.reserved -= len(idx)

    def add(self, key: bytes, index: int) -> bool:
        """A reserved index now holds ``key``'s bytes: index it as most recent. False (the index is
        freed) when ``key`` is already held elsewhere."""
        self.reserved -= 1
        if key in self._entries:
            self._alloc.free([index])
            self._entries.move_to_end(key)
            return False
        self._entries[key] = HostEntry(index)
        if self.on_change is not None:
            self.on_change(key, True)
        return True

    # -- pins -----------------------------------------------------------------------------------
    def pin(self, keys: Iterable[bytes]) -> list[bytes]:
        """Pin the present ones among ``keys``; returns them (to unpin later)."""
        got = []
        for key in keys:
            e = self._entries.get(key)
            if e is not None:
                e.pins += 1
                self._pinned += e.pins == 1
                got.append(key)
        return got

    def unpin(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            e = self._entries[key]  # a pinned entry is never evicted
            if e.pins <= 0:
                raise ValueError("unpin of an entry that is not pinned")
            e.pins -= 1
            self._pinned -= e.pins == 0

    def check(self) -> None:
        """The accounting identity (see the module docstring); raises AssertionError."""
        pinned = sum(1 for e in self._entries.values() if e.pins)
        if pinned != self._pinned:
            raise AssertionError(f"host index: {self._pinned} pinned counted, {pinned} found")
        total = self._alloc.available + self.evictable + self.protected + self.reserved
        if total != self.size:
            raise AssertionError(
                f"host index: available {self._alloc.available} + evictable {self.evictable} + protected "
                f"{self.protected} + reserved {self.reserved} != {self.size}"
            )
