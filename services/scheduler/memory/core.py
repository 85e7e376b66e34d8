"""What happens to a request's memory, from admission to release: one ``Memory`` per worker.

``Memory`` is the only thing the batcher, elastic control and metrics see of the worker's pools.
It composes:

- **slots and rows** (``SlotAllocator``, ``RowAllocator``): always;
- **the prefix tree** (``tree.PrefixTree``; one that keeps nothing with the cache off): token
  prefixes to KV slots, and to states when the model has recurrent layers;
- **a state track** (``states.StateTrack``) when the worker has a state pool: working states,
  copy-on-write, checkpoint forks, donation;
- **a host tier** (``host_tier.HostTierPlanner``) when the worker has a host pool: host pages (and states),
  loads at admission, backups and L3 puts by the write policy, L3 prefetch by the stop policy.

The life of a request's memory, one verb per point (the batcher calls them in this order):

    admit        a row; the longest cached prefix (device, then host) locked and adopted
    hold         wait for an L3 prefetch first? (host tier)
    chunk_limit  cut a prefill chunk at the next state checkpoint (state track)
    start        slots for the first chunk, and the working state
    extend       slots for the next tokens (whole pages; evicts unlocked cache when short)
    truncate     give back the slots of a step's rejected draft tokens (speculative decoding)
    planned      the step being planned computes up to here: fork the state if a checkpoint
    take_ops     the step's cache ops, in the order ``ops.step_ops`` gives and explains
    on_results   the worker acknowledged the step's host / L3 jobs
    commit_chunk a committed prefill chunk enters the tree (siblings can match it)
    commit_fork  a committed checkpoint enters the tree with its state
    release      finished, aborted or retracted: computed pages to the tree, the rest freed

Outside a request's life: ``set_limits`` and ``drain`` move the elastic pools' limits, ``flush``
drops everything cached that no request holds (the tier benchmarks force a tier with it; no
endpoint exposes it yet), ``check_idle`` checks the books.

Ownership of a request's slots (``req.mem``, see ``request_memory.py``): ``slots[:cache_len]``
belong to the tree and are locked by the request; ``slots[cache_len:]`` are the request's until it
caches or frees them.
Invariants, checked when idle (``check_idle``): ``free + evictable + protected == size`` for the KV
pool, for the state pool, and (with ``reserved``) for the host pools.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from services.common.step import CacheOp, JobResult, ReleaseRow
from services.scheduler.memory.allocator import RowAllocator, SlotAllocator
from services.scheduler.memory.base import CacheKey, EventSink
from services.scheduler.memory.host import match_key
from services.scheduler.memory.host_tier import HostTierPlanner
from services.scheduler.memory.ops import step_ops
from services.scheduler.memory.request_memory import Fork
from services.scheduler.memory.states import StateTrack
from services.scheduler.memory.tree import PrefixTree

if TYPE_CHECKING:
    from services.scheduler.request import Req


@dataclass(frozen=True, slots=True)
class Usage:
    size: int
    free: int
    evictable: int
    protected: int

    @property
    def used_by_requests(self) -> int:
        return self.size - self.free - self.evictable - self.protected


class Memory:
    """Slots, rows, the prefix tree and the optional state track and host tier of one worker."""

    def __init__(
        self, slots: SlotAllocator, rows: RowAllocator, tree: PrefixTree,
        states: StateTrack | None = None, host: HostTierPlanner | None = None,
    ) -> None:
        self.slots, self.rows, self.tree, self.states, self.host = slots, rows, tree, states, host
        self.page_size = slots.page_size
        self.caching = tree.keep
        self.evicted = 0  # slots evicted from the tree so far
        self._released_rows: list[CacheOp] = []

    def follow(self, on_tree: EventSink | None, on_host_page: Callable[[bytes, bool], None] | None) -> bool:
        """Report what the cache gains and loses: the tree's insert and evict events and the host
        pool's pages by key (for WatchCache). False with the cache off (nothing to report)."""
        if not self.caching:
            return False
        self.tree.on_event = on_tree
        if self.host is not None:
            self.host.follow_pages(on_host_page)
        return True

    @property
    def size(self) -> int:
        """Slots the accounting covers: the allocator's limit plus a shrinking tail still held."""
        return self.slots.size + self.slots.shrink_pending

    # -- admission ------------------------------------------------------------------------------
    match_key = staticmethod(match_key)

    def admit(self, req: Req) -> int | None:
        """Give ``req`` a row and lock the longest cached prefix (device, then what the host tier
        brings back); None when no row is free. Undo with ``abandon``."""
        row = self.rows.alloc()
        if row is None:
            return None
        req.mem.row = row
        key = self.match_key(req)
        n = self._match_device(req, key)
        if self.host is not None:
            n = self.host.extend_match(req, key, n)
        req.mem.cache_len = req.mem.planned_len = n
        if self.states is not None:
            self.states.plan_checkpoints(req)
        return n

    def _match_device(self, req: Req, key: CacheKey) -> int:
        m = self.tree.match(key)
        req.mem.branch_len, req.mem.matched_state = m.kv_len, m.state
        n = len(m.slots)
        if n:
            self.tree.lock(m.node)
            req.mem.lock, req.mem.slots = m.node, list(m.slots)
        req.mem.cache_len = req.mem.planned_len = n
        return n

    def prefix_len(self, req: Req) -> int:
        """How much of ``req.seq`` is usable now without a recompute (no locking, no hit counted;
        for longest-prefix-first ordering and sibling waits)."""
        key = self.match_key(req)
        if self.host is not None:
            return self.host.prefix_len(key)
        return len(self.tree.match_prefix(key).slots)

    def hold(self, req: Req) -> bool:
        """Whether ``req`` should wait (for its L3 prefetch) before admission."""
        return self.host is not None and self.host.hold(req)

    def chunk_limit(self, req: Req, n: int) -> int:
        return n if self.states is None else self.states.chunk_limit(req, n)

    def start(self, req: Req, n: int, reserve: int) -> bool:
        """Slots for the admitted request's first ``n`` tokens, keeping ``reserve`` for others'
        decodes, and its working state; False when memory is short (``abandon`` it)."""
        if self.available() - reserve < n or not self.extend(req, n):
            return False
        return self.states is None or self.states.start(req)

    def abandon(self, req: Req) -> None:
        """Undo an ``admit`` whose request was not scheduled (its row was never sent)."""
        self._cache_and_release(req)
        if req.mem.row is not None:
            self.rows.free(req.mem.row)
            req.mem.row = None

    def branch_hint(self, req: Req, pos: int) -> None:
        """A sibling waits for ``req``'s prefix up to ``pos`` (a checkpoint there pays)."""
        if self.states is not None:
            self.states.add_branch_hint(req, pos)

    # -- slots ----------------------------------------------------------------------------------
    def extend(self, req: Req, n: int) -> bool:
        """Give ``req`` slots for its next ``n`` tokens: the rest of its last page first, then new
        whole pages (token i always sits at offset i % page_size of a page, so pages can be
        shared). The unused tail of the last page stays the request's until it is released."""
        got: list[int] = []
        ps = self.page_size
        if ps > 1 and req.mem.slots and req.computed % ps:
            last = req.mem.slots[-1]
            got = list(range(last + 1, last + 1 + min(ps - 1 - last % ps, n)))
        rest = n - len(got)
        if rest:
            new = self.alloc(rest)
            if new is None:
                return False
            got += new[:rest]
        req.mem.slots.extend(got)
        return True

    def truncate(self, req: Req, n: int) -> None:
        """``req`` keeps the slots of its first ``n`` tokens (speculative decoding: the KV of the
        drafts a step rejected is void). Pages wholly past ``n`` are freed; the rest of the page
        holding token ``n - 1`` stays the request's, as after ``extend``."""
        rm = req.mem
        if not rm.cache_len <= n <= req.computed:
            raise ValueError(f"truncate {req.rid} to {n} tokens: outside [{rm.cache_len}, {req.computed}]")
        ps = self.page_size
        keep = -(-n // ps) * ps  # to the end of the last page in use
        self.free_pages(rm.slots[keep:])
        del rm.slots[n:]
        rm.planned_len = min(rm.planned_len, n)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` slots (rounded to whole pages by the allocator), evicting unlocked cache if needed."""
        got = self.slots.alloc(n)
        if got is None:
            self.evict(n - self.slots.available + self.page_size)
            got = self.slots.alloc(n)
        return got

    def evict(self, n: int) -> None:
        if self.host is not None:
            self.evicted += self.host.evict_device(n)
        else:
            self.evicted += self.tree.evict(n)  # frees through the allocator callback

    def free_pages(self, slots: list[int]) -> None:
        """Free every slot of the pages ``slots`` touch (a request's own pages are wholly its own)."""
        ps = self.page_size
        if ps > 1 and slots:
            slots = [p * ps + i for p in sorted({s // ps for s in slots}) for i in range(ps)]
        if slots:
            self.slots.free(slots)

    def available(self) -> int:
        """Slots a new request could get: free now plus evictable."""
        return self.slots.available + self.tree.evictable_size

    # -- the step -------------------------------------------------------------------------------
    def planned(self, req: Req, end: int) -> Fork | None:
        """The step being planned brings ``req`` to ``end`` tokens and sends its row (no longer
        dirty): fork its state there if that is a checkpoint (returns the fork to commit with the
        step)."""
        req.mem.planned_len = end
        req.mem.row_dirty = False
        return None if self.states is None else self.states.planned(req, end)

    def drop(self, req: Req) -> None:
        """``req`` leaves the queue before admission: stop its L3 prefetch (a fetch in flight still
        releases its pages on its ack)."""
        if req.mem.prefetch is not None:
            req.mem.prefetch.abort()

    def take_ops(self, resize: list[CacheOp]) -> list[CacheOp]:
        """The cache ops of the step being planned, ``resize`` (elastic pools) included."""
        forks, state_ops = self.states.take() if self.states is not None else ([], [])
        evicted, host_ops = self.host.take_ops() if self.host is not None else ([], [])
        rows, self._released_rows = self._released_rows, []
        return step_ops(evicted, resize, forks, host_ops, state_ops, rows)

    def on_results(self, results: list[JobResult]) -> None:
        if self.host is not None:
            self.host.on_results(results)

    def handed_over(self, req: Req) -> bool:
        """Whether ``req``'s prompt is as far in the kvstore (L3) as it will get: every whole page
        of it acknowledged there, or no host / L3 job left that could add one (no host tier, a
        backup refused, pages evicted first). A prefill-role scheduler ends the request then."""
        return self.host is None or self.host.in_l3(CacheKey(req.prompt, req.cache_salt))

    @property
    def pending(self) -> bool:
        """Memory will come free without any request finishing (host jobs in flight or queued)."""
        return self.host is not None and self.host.memory_pending

    # -- commit ---------------------------------------------------------------------------------
    def commit_chunk(self, req: Req) -> None:
        """Insert a running request's computed whole pages into the tree after a prefill chunk, so
        siblings can match it while this request goes on, and move its lock down to the new end.
        With states, prefixes enter the tree only with a state: at forks (``commit_fork``)."""
        if self.states is not None or not self.caching:
            return
        computed, m = min(req.computed, len(req.prompt) + len(req.output)), req.mem.cache_len
        aligned = self.tree.aligned_len(computed)
        if aligned <= m:
            return
        key = CacheKey(req.seq[:aligned], req.cache_salt)
        self._lock_inserted(req, key, self.tree.insert(key, req.mem.slots[:aligned]))
        if self.host is not None:
            self.host.cached(key)

    def commit_fork(self, req: Req, fork: Fork) -> None:
        """The step that computed ``fork`` is committed: put ``tokens[:pos]`` and the fork into the
        tree and move ``req``'s lock down to it."""
        if fork not in req.mem.forks:  # released (finished, aborted, retracted) meanwhile: slot freed
            return
        req.mem.forks.remove(fork)
        assert self.states is not None
        if fork.pos <= req.mem.cache_len:  # already cached up to here (a deeper node is locked): surplus
            self.states.pool.free(fork.slot)
            return
        key = CacheKey(req.seq[: fork.pos], req.cache_salt)
        res = self.tree.insert_checkpoint(key, req.mem.slots[: fork.pos], fork.slot)
        self.states.counters.fork_inserted += res.state_taken
        self._lock_inserted(req, key, res.cached_len)
        if res.state_taken:
            self.states.hold_until_sent(req, fork)
        if res.state_taken and self.host is not None:
            self.host.cached(key)

    def _lock_inserted(self, req: Req, key: CacheKey, cached: int) -> None:
        """``req``'s ``key`` was just inserted (the tree held ``cached`` tokens of it before): move
        the lock down to the key's end, switch to the tree's slots and free the duplicates
        ``[cache_len, cached)`` (``req.mem.row_dirty`` makes the batcher resend the worker's row)."""
        rm = req.mem
        n, m = len(key.tokens), rm.cache_len
        dup = rm.slots[m:cached]
        new = self.tree.match_prefix(key)
        assert len(new.slots) == n, (len(new.slots), n)
        self.tree.lock(new.node)
        if rm.lock is not None:
            self.tree.unlock(rm.lock)
        rm.lock, rm.cache_len = new.node, n
        if dup:
            rm.slots[:n] = new.slots
            rm.row_dirty = True
            self.free_pages(dup)

    # -- release --------------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """The request is done with its memory (finished, aborted or retracted): its computed whole
        pages go to the tree, the rest is freed, and its row is released on the worker."""
        self._cache_and_release(req)
        if req.mem.row is not None:
            self.rows.free(req.mem.row)
            self._released_rows.append(ReleaseRow(req.mem.row))
            req.mem.row = None

    def _cache_and_release(self, req: Req) -> None:
        # Only known tokens whose KV a planned step writes (a slot granted for a sample still in
        # flight has no id yet; one granted in a plan that then retracted the request was never
        # sent), and only whole pages; everything past that stays the request's to free. With
        # states, the working state is donated when it sits exactly at the end of what is cached.
        rm = req.mem
        own, m = rm.mamba_slot, rm.cache_len
        computed = min(rm.planned_len, len(req.prompt) + len(req.output))
        aligned = self.tree.aligned_len(computed)
        donate = self.states is not None and own is not None and rm.planned_len == aligned
        to_free = rm.slots[m:]
        if aligned > m and self.caching:
            key = CacheKey(req.seq[:aligned], req.cache_salt)
            # Ownership of a donated state passes to the tree whether it keeps it or not.
            res = self.tree.insert_checkpoint(key, rm.slots[:aligned], own if donate else None)
            cached, taken = res.cached_len, res.state_taken
            if taken and self.states is not None:
                self.states.counters.donated += 1
            # [m, cached) duplicate what the tree already holds; [cached, aligned) now belong to it.
            to_free = rm.slots[m:cached] + rm.slots[aligned:]
            if self.host is not None and (self.states is None or taken):
                self.host.cached(key)
        else:
            donate = False
        if rm.lock is not None:
            self.tree.unlock(rm.lock)
        self.free_pages(to_free)
        if self.states is not None:
            self.states.release(req, donated=donate)
        rm.lock, rm.slots, rm.cache_len, rm.planned_len = None, [], 0, 0

    def forget(self, req: Req) -> None:
        """The worker died with the request's memory: drop every reference without freeing."""
        rm = req.mem
        rm.slots, rm.cache_len, rm.lock, rm.row, rm.planned_len = [], 0, None, None, 0
        rm.mamba_slot, rm.forks, rm.checkpoints, rm.branch_hints = None, [], [], []
        rm.prefetch = None

    # -- elastic pools --------------------------------------------------------------------------
    def set_limits(self, kv_slots: int, states: int) -> None:
        """Move the allocators' limits: grow at once, shrink lazily (see ``allocator.py``)."""
        self.slots.resize(kv_slots)
        if self.states is not None:
            self.states.pool.resize(states)

    def drain(self) -> None:
        """Evict cached entries holding slots above a pending shrink's target (cheapest first)."""
        while not self.slots.shrink_done and self.tree.evictable_size:
            self.evicted += self.tree.evict(self.slots.shrink_pending)
        st = self.states
        while st is not None and st.tree is not None and not st.pool.shrink_done and st.tree.state_evictable:
            st.counters.evicted += st.tree.evict_states(st.pool.shrink_pending)

    def shrink_done(self) -> tuple[bool, bool]:
        """(KV, states): no slot at or above the allocator's limit is held any more."""
        return self.slots.shrink_done, self.states is None or self.states.pool.shrink_done

    def live(self) -> tuple[int, int]:
        """(KV slots, states) held by requests or locked in the tree: what a shrink cannot take."""
        u = self.usage()
        st = self.states
        m_live = 0
        if st is not None:
            m_live = st.pool.size + st.pool.shrink_pending - st.pool.available
            m_live -= st.tree.state_evictable if st.tree is not None else 0
        return u.size - u.free - u.evictable, m_live

    @property
    def rows_free(self) -> int:
        return self.rows.available

    def flush(self, host: bool = False) -> bool:
        """Drop every cached entry that no request holds (what a cache flush would do): the
        device's KV pages and states, and with ``host`` the host tier's pages and states too.
        True when nothing is left cached or held (every pool wholly free)."""
        self.evicted += self.tree.evict(self.tree.evictable_size)
        if self.states is not None:
            self.states.counters.evicted += self.tree.evict_states(self.tree.state_evictable)
        t = self.tree
        empty = not (t.evictable_size or t.state_evictable or t.state_protected) and self.slots.available == self.size
        if self.states is not None:
            empty = empty and self.states.pool.available == self.states.pool.size
        if host and self.host is not None:
            empty = self.host.flush() and empty
        return empty

    @property
    def cache_page(self) -> int:
        """Tokens per page of the prefix tree, the host tier and L3 (a multiple of ``page_size``)."""
        return self.tree.page_size

    # -- accounting -----------------------------------------------------------------------------
    def usage(self) -> Usage:
        return Usage(self.size, self.slots.available, self.tree.evictable_size, self.tree.protected_size)

    def stats(self) -> dict[str, dict[str, int]]:
        """For metrics, by the parts composed: ``state_slots`` (by owner) and ``state_events``
        with a state track; ``host_pages`` (by state) and ``host_events`` with a host tier."""
        out: dict[str, dict[str, int]] = {}
        if self.states is not None:
            out["state_slots"] = self.states.owners()
            out["state_events"] = asdict(self.states.counters)
        if self.host is not None:
            out["host_pages"] = self.host.host_pages()
            out["host_events"] = asdict(self.host.counters)
        return out

    def check_idle(self) -> None:
        """With no request holding memory: every pool's books balance (raises AssertionError)."""
        u = self.usage()
        if u.free + u.evictable + u.protected != u.size:
            raise AssertionError(f"KV accounting broken when idle: {u}")
        if self.states is not None:
            self.states.check_idle()
        if self.host is not None:
            self.host.check_idle()
