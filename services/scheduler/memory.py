"""The scheduler's view of one worker's KV memory: slot allocator + prefix cache + rows.

Ownership of a request's slots (see ``Req``): ``slots[:cache_len]`` belong to the cache and are
locked by the request; ``slots[cache_len:]`` belong to the request until it caches or frees them.
Invariant (checked when idle): ``free + evictable + protected == size``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.scheduler.allocator import RowAllocator, SlotAllocator
from services.scheduler.cache.base import CacheKey, NoCache, PrefixCache
from services.scheduler.cache.tree import PrefixTree
from services.scheduler.request import Req

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Usage:
    size: int
    free: int
    evictable: int
    protected: int

    @property
    def used_by_requests(self) -> int:
        return self.size - self.free - self.evictable - self.protected


class KVMemory:
    """Slots, rows and the prefix cache of one worker. Pure Python: no tensors here."""

    def __init__(
        self, num_slots: int, num_rows: int, page_size: int, cache: str, policy: str = "lru"
    ) -> None:
        self.page_size = page_size
        self.slots = SlotAllocator(num_slots, page_size)
        self.rows = RowAllocator(num_rows)
        self.evicted = 0  # slots evicted from the cache so far
        self.cache: PrefixCache = (
            PrefixTree(page_size, self.slots.free, eviction=policy)  # type: ignore[arg-type]
            if cache == "radix"
            else NoCache(page_size, self.slots.free)
        )

    @property
    def size(self) -> int:
        """Slots the accounting covers: the allocator's limit plus a shrinking tail still held."""
        return self.slots.size + self.slots.shrink_pending

    # -- matching and locking -------------------------------------------------------------------
    @staticmethod
    def match_key(req: Req) -> CacheKey:
        """What a request may match: all of ``req.seq`` but the last token, which must be computed
        (its logits are needed)."""
        seq = req.seq
        return CacheKey(seq[: len(seq) - 1], req.cache_salt)

    def match(self, req: Req) -> int:
        """Lock the longest cached prefix of ``req.seq`` (leaving at least one token to compute,
        since the last one must produce logits) and adopt its slots. Returns the matched length."""
        m = self.cache.match_prefix(self.match_key(req))
        n = len(m.slots)
        req.planned_len = n
        if n:
            self.cache.lock(m.node)
            req.lock = m.node
            req.slots = list(m.slots)
            req.cache_len = n
        return n

    def prefix_len(self, req: Req) -> int:
        """How much of ``req.seq`` is cached now (no locking; for longest-prefix-first ordering)."""
        return len(self.cache.match_prefix(self.match_key(req)).slots)

    def extend(self, req: Req, n: int) -> bool:
        """Give ``req`` slots for its next ``n`` tokens: the rest of its last page first, then new
        whole pages (token i always sits at offset i % page_size of a page, so pages can be
        shared). The unused tail of the last page stays the request's until it is released."""
        got: list[int] = []
        ps = self.page_size
        if ps > 1 and req.slots and req.computed % ps:
            last = req.slots[-1]
            got = list(range(last + 1, last + 1 + min(ps - 1 - last % ps, n)))
        rest = n - len(got)
        if rest:
            new = self.alloc(rest)
            if new is None:
                return False
            got += new[:rest]
        req.slots.extend(got)
        return True

    def _pages(self, slots: list[int]) -> list[int]:
        """Every slot of the pages ``slots`` touch (a request's own pages are wholly its own)."""
        ps = self.page_size
        if ps == 1 or not slots:
            return slots
        return [p * ps + i for p in sorted({s // ps for s in slots}) for i in range(ps)]

    def alloc(self, n: int) -> list[int] | None:
        """``n`` slots (rounded to whole pages by the allocator), evicting unlocked cache if needed."""
        got = self.slots.alloc(n)
        if got is None:
            short = n - self.slots.available + self.page_size
            self._evict(short)
            got = self.slots.alloc(n)
        return got

    def _evict(self, n: int) -> None:
        self.evicted += self.cache.evict(n)  # frees through the allocator callback

    # -- releasing ------------------------------------------------------------------------------
    def cache_and_release(self, req: Req) -> None:
        """Give the request's computed tokens to the cache (dedup frees the duplicates), unlock
        its old path, free everything the cache did not take, and forget the slots."""
        # Only known tokens whose KV a planned step writes (a slot granted for a sample still in
        # flight has no id yet; one granted in a plan that then retracted the request was never
        # sent), and only whole pages; everything past that stays the request's to free.
        computed, m = min(req.planned_len, len(req.prompt) + len(req.output)), req.cache_len
        aligned = self.cache.aligned_len(computed)
        if aligned > m:
            key = CacheKey(req.seq[:aligned], req.cache_salt)
            cached = self.cache.insert(key, req.slots[:aligned])
            # [m, cached) duplicate what the tree already holds; [cached, aligned) now belong to it.
            to_free = req.slots[m:cached] + req.slots[aligned:]
        else:
            to_free = req.slots[m:]
        if req.lock is not None:
            self.cache.unlock(req.lock)
        if to_free:
            self.slots.free(self._pages(to_free))
        req.lock = None
        req.slots = []
        req.cache_len = req.planned_len = 0

    def cache_unfinished(self, req: Req) -> None:
        """Insert a running request's computed prefix into the tree (after a prefill chunk), so
        siblings can match it while this request goes on, and move its lock down to the new end.

        Where the tree already held some of these tokens (a sibling computed them too), the
        request switches to the tree's slots and frees its duplicates; ``req.row_dirty`` then
        tells the batcher to rewrite the worker's req_to_token row before the next step.
        """
        computed, m = min(req.computed, len(req.prompt) + len(req.output)), req.cache_len
        aligned = self.cache.aligned_len(computed)
        if aligned <= m or isinstance(self.cache, NoCache):
            return
        key = CacheKey(req.seq[:aligned], req.cache_salt)
        self._lock_inserted(req, key, self.cache.insert(key, req.slots[:aligned]))

    def _lock_inserted(self, req: Req, key: CacheKey, cached: int) -> None:
        """``req``'s ``key`` was just inserted (the tree held ``cached`` tokens of it before):
        move the request's lock down to the key's end, switch it to the tree's slots and free its
        duplicates ``[cache_len, cached)`` (``req.row_dirty`` then makes the batcher resend its
        req_to_token row)."""
        n, m = len(key.tokens), req.cache_len
        dup = req.slots[m:cached]
        new = self.cache.match_prefix(key)
        assert len(new.slots) == n, (len(new.slots), n)
        self.cache.lock(new.node)  # the Mamba radix cache raises here if the node has no state
        if req.lock is not None:
            self.cache.unlock(req.lock)
        req.lock, req.cache_len = new.node, n
        if dup:
            req.slots[:n] = new.slots
            req.row_dirty = True
            self.slots.free(self._pages(dup))

    def free_row(self, req: Req) -> int | None:
        row = req.row
        if row is not None:
            self.rows.free(row)
            req.row = None
        return row

    # -- accounting -----------------------------------------------------------------------------
    def available(self) -> int:
        """Slots a new request could get: free now plus evictable."""
        return self.slots.available + self.cache.evictable_size

    def usage(self) -> Usage:
        return Usage(self.size, self.slots.available, self.cache.evictable_size, self.cache.protected_size)

    def check_idle_invariant(self) -> None:
        """With no request holding slots: free + evictable + protected == size."""
        u = self.usage()
        if u.free + u.evictable + u.protected != u.size:
            raise AssertionError(f"KV accounting broken when idle: {u}")
