"""The host tier, one design for every model kind: KV pages (and, for models with recurrent layers,
states) in hash-keyed host indexes beside the device's prefix tree, and the kvstore (L3) behind.

Keys. The tree is paged in host pages, so every node (and checkpoint) is whole ones. A page is
keyed by its chained hash ``h_i`` (``services.common.page_hash``); the state right after page ``i``
by ``state_key(h_i)``. On the host (L2) each kind has a ``HostIndex``; in L3 they are plain kvstore
keys. A prefix is found on the host by walking its hashes until the first miss: no second tree.

Flows (each op is acknowledged by the worker in ``StepResult.jobs``; a *group* is the one or two
ops, pages and state, of one backup / put / prefetch, finished when all its ops are):

- **admission** (``extend_match``): after the device match (``n`` tokens; with states, KV reach
  ``d >= n`` through tombstones) the host run of pages from ``d`` is found; the prefix is extended
  to its end (with states: to the deepest host state ``q`` whose pages are all local). Pages
  ``[d, q)`` are loaded into new slots (``HostLoad``), the state into a new state slot
  (``StateLoad``), the prefix is inserted into the device tree, locked and served like a device
  hit. Loads are acknowledged when planned (the step stream runs them before any reader, ``ops.py``);
  the host entries they read stay pinned until the worker's acknowledgement.
- **writes**, by the write policy: ``write_through`` backs a prefix up when it enters the tree
  (with states: when a state does, with the pages before it the host lacks); ``write_through_selective``
  when a match hits it a second time; ``write_back`` only when the device evicts it: the tree hands
  over each node it removes, its pages and state are copied to the host by ops that go *first* in
  the step (before anything can overwrite or release the slots just freed). A backed-up prefix is
  locked on the device until acknowledged (write-back: its slots are free but nothing runs before
  the copy). With L3, an ``L3Put`` of what a backup added follows its acknowledgement.
- **L3 prefetch** (``hold``): ``Req.mem.l3_pages`` is the L3 hit in pages (with states: the deepest
  stored state with every page before it, ``l3_lookup``). When it exceeds the local reach by
  ``prefetch_threshold`` pages, the missing pages (and the state) are fetched into reserved host
  pages, the host pages the fetch continues are pinned, and the request waits as the stop policy
  says. The leading pages that arrived join the host index (the state too when every page did).

Groups in flight plus backups queued are bounded by ``max_inflight_jobs``; beyond it a backup, put
or prefetch is skipped and counted (``refused``). Host eviction is LRU or LFU (the tree's policy).
Invariant when idle: ``available + evictable + protected + reserved == size`` per host index.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.common.page_hash import HashNamespace, extend_hashes, namespace_seed, state_key
from services.common.step import CacheOp, HostLoad, JobResult, StateLoad
from services.scheduler.memory import host_writes
from services.scheduler.memory.base import CacheHandle, CacheKey
from services.scheduler.memory.host import HiConfig, HiCounters, match_key, wait_for_prefetch
from services.scheduler.memory.host_alloc import HostPageAllocator
from services.scheduler.memory.host_index import HostIndex
from services.scheduler.memory.host_jobs import Group, group_ops
from services.scheduler.memory.host_policy import PrefetchTracker, should_prefetch
from services.scheduler.memory.states import StateTrack
from services.scheduler.memory.tree import PrefixTree

if TYPE_CHECKING:
    from services.scheduler.request import Req


class HostTierPlanner:
    """The scheduler's side of the host tier (see the module docstring): the host indexes, the
    write and prefetch policies, and the host / L3 ops they plan for the worker (``HostOpRunner``)
    to run. Only ``Memory`` calls it.

    ``host_writes.py`` (the write policy's functions over the tier) uses the write bookkeeping,
    public for it: ``backlog`` (backups waiting for a job slot), ``incoming`` (keys a backup is
    writing), ``puts`` (acknowledged backups to put to L3), ``busy`` (groups in flight), and
    ``full()``, ``send()``, ``hashes()``, ``skey()``."""

    def __init__(
        self, tree: PrefixTree, states: StateTrack | None, *, host_pages: int, host_states: int,
        namespace: HashNamespace, state_layout: str, l3: bool, cfg: HiConfig,
        alloc: Callable[[int], list[int] | None], free_pages: Callable[[list[int]], None],
    ) -> None:
        """``alloc`` / ``free_pages``: ``Memory``'s (slots for loads, evicting when short)."""
        if host_pages < 1 or (states is not None and host_states < 1):
            raise ValueError(f"a host tier needs host pages (and host states with states), got {host_pages} / "
                             f"{host_states}")
        if states is not None and not state_layout:
            raise ValueError("state_layout must be non-empty (it is part of every state key)")
        if namespace.cache_salt:
            raise ValueError("namespace.cache_salt must be empty: each extra key salts its own chain")
        self.tree, self.states, self.cfg = tree, states, cfg
        self.tree_page = tree.page_size
        self._alloc, self._free_pages = alloc, free_pages
        lfu = tree.eviction == "lfu"
        self.kv_host = HostIndex(HostPageAllocator(host_pages), lfu=lfu)
        self.state_host = HostIndex(HostPageAllocator(host_states if states is not None else 0), lfu=lfu)
        self.namespace, self.state_layout, self.l3 = namespace, state_layout, l3
        self.tier_ops: list[CacheOp] = []  # loads and prefetches planned since the last step
        self.first_ops: list[CacheOp] = []  # write-back copies of what this plan evicted
        self.backlog: list[tuple[CacheHandle, CacheKey, int | None]] = []  # (locked node, key, state slot)
        self.puts: list[tuple[list[bytes], bytes | None]] = []  # acked backups to put to L3
        self._groups: dict[int, Group] = {}  # job id -> its group
        self._loads: dict[int, tuple[list[bytes], list[bytes]]] = {}  # load job id -> pinned keys
        self.busy = 0  # groups in flight (bounded by cfg.max_inflight_jobs with the backlog)
        self.incoming: set[bytes] = set()  # keys a backup is writing to the host
        self._ids = itertools.count(1)
        self.counters = HiCounters()
        if cfg.write_policy == "write_back":
            tree.on_remove = lambda *node: host_writes.evicted(self, *node)

    def follow_pages(self, on_change: Callable[[bytes, bool], None] | None) -> None:
        """Report each KV page key the host pool gains (True) or loses (False)."""
        self.kv_host.on_change = on_change

    # -- keys -----------------------------------------------------------------------------------
    def hashes(self, key: CacheKey) -> list[bytes]:
        base = self.namespace
        return extend_hashes(namespace_seed(base.model_fingerprint, base.layout, key.extra), key.tokens, self.tree_page)

    def skey(self, page_hash: bytes) -> bytes:
        return state_key(page_hash, self.state_layout)

    def _reach(self, keys: list[bytes], n: int, d: int) -> tuple[int, int]:
        """``(e, q)`` in pages: the end of the host's run of pages from the device's KV reach ``d``,
        and how far a load can serve past the device's ``n`` (without states: to ``e``; with them:
        the deepest host state whose pages are all local), or 0."""
        ps = self.tree_page
        e = self.kv_host.run(keys, d // ps)
        if self.states is None:
            return e, e if e * ps > n else 0
        for q in range(max(d // ps, e), n // ps, -1):
            if self.skey(keys[q - 1]) in self.state_host:
                return e, q
        return e, 0

    def _kv_reach(self, key: CacheKey, n: int) -> int:
        return len(self.tree.kv_path(key)) if self.states is not None else n

    # -- admission ------------------------------------------------------------------------------
    def extend_match(self, req: Req, key: CacheKey, n: int) -> int:
        """``req`` holds a locked device match of ``n`` tokens of ``key``: extend it with what the
        host holds (loads planned, the tree and the lock updated); returns the new length."""
        if n and self.cfg.write_policy == "write_through_selective" and self.tree.hits(req.mem.lock) >= 2:
            host_writes.want(self, CacheKey(key.tokens[:n], key.extra))
        keys = self.hashes(key)
        _, q = self._reach(keys, n, self._kv_reach(key, n))
        return (self._load(req, key, keys, q) or n) if q else n

    def in_l3(self, key: CacheKey) -> bool:
        """Whether ``key``'s whole pages are as far in L3 as they will get: all acknowledged
        there, or no job left that could add one (no L3, a refused backup, evicted pages)."""
        if not self.l3 or not self.memory_pending:
            return True
        return all((e := self.kv_host.get(k)) is not None and e.l3 for k in self.hashes(key))

    def prefix_len(self, key: CacheKey) -> int:
        """Tokens of ``key`` usable now (device and host), changing nothing."""
        n = self.tree.match(key, touch=False).length
        _, q = self._reach(self.hashes(key), n, self._kv_reach(key, n))
        return max(n, q * self.tree_page)

    def _load(self, req: Req, key: CacheKey, keys: list[bytes], q: int) -> int:
        """Bring pages ``[d, q)`` (and the state after page ``q``) from the host, insert them into
        the device tree and serve the request from there; 0 when there is no room."""
        ps, n, end = self.tree_page, req.mem.cache_len, q * self.tree_page
        skey = self.skey(keys[q - 1]) if self.states is not None else None
        pins = self.kv_host.pin(keys[:q])  # making room below must not drop what this load reads
        spins = self.state_host.pin([skey]) if skey is not None else []
        state = self.states.alloc() if self.states is not None else None
        got = self._alloc(end - n) if end > n and (state is not None or self.states is None) else []
        dev = self.tree.kv_path(key)[:end] if self.states is not None else req.mem.slots[:n]
        d = len(dev)
        if got is None or (self.states is not None and state is None) or self.kv_host.run(keys, d // ps) < q:
            self._unpin(pins, spins)
            if got:
                self._free_pages(got)
            if state is not None and self.states is not None:
                self.states.pool.free(state)
            return 0
        new, spare = got[: end - d], got[end - d :]
        if spare:
            self._free_pages(spare)
        if new:
            job = next(self._ids)
            host_pages = tuple(self.kv_host.get(k).index for k in keys[d // ps : q])  # type: ignore[union-attr]
            self.tier_ops.append(HostLoad(job, host_pages, tuple(new)))
            self._loads[job], pins = (pins, []), []
        if state is not None and skey is not None:
            job = next(self._ids)
            sentry = self.state_host.get(skey)
            assert sentry is not None
            self.tier_ops.append(StateLoad(job, (sentry.index,), (state,)))
            self.state_host.touch([skey])
            self.counters.state_loads += 1
            self._loads[job], pins, spins = (pins, spins), [], []
        self._unpin(pins, spins)  # held by a load's ack above, or not needed
        self.kv_host.touch(keys[:q])
        pkey = CacheKey(key.tokens[:end], key.extra)
        res = self.tree.insert_checkpoint(pkey, dev + new, state)
        assert res.cached_len == d, (res.cached_len, d)
        m = self.tree.match(pkey)
        assert len(m.slots) == end
        self.tree.lock(m.node)
        if req.mem.lock is not None:
            self.tree.unlock(req.mem.lock)
        req.mem.lock, req.mem.slots, req.mem.matched_state = m.node, list(m.slots), m.state
        req.mem.branch_len = max(req.mem.branch_len, end)
        self.counters.load_tokens += len(new)
        return end

    def hold(self, req: Req) -> bool:
        """Whether ``req`` should wait for its L3 prefetch (starting one when it pays)."""
        return wait_for_prefetch(req, self._start_prefetch)

    def _start_prefetch(self, req: Req, now: float) -> PrefetchTracker | None:
        if not self.l3 or req.mem.l3_pages <= 0:
            return None
        ps = self.tree_page
        key = match_key(req)
        keys = self.hashes(key)
        top = min(req.mem.l3_pages, len(keys))
        n = self.tree.match(key, touch=False).length
        d = self._kv_reach(key, n)
        e, q = self._reach(keys, n, d)
        local = max(n // ps, q) if self.states is not None else max(n // ps, e)
        if not should_prefetch(top, local, self.cfg.prefetch_threshold):
            return None
        start = min(max(d // ps, e), top)
        if self.full() or (pages := self.kv_host.reserve(top - start)) is None:
            self.counters.refused += 1
            return None
        skey, hs = None, None
        if self.states is not None:
            got = self.state_host.reserve(1)
            if got is None:
                self.kv_host.release(pages)
                self.counters.refused += 1
                return None
            skey, hs = self.skey(keys[top - 1]), got[0]
        g = Group("prefetch", keys[start:top], pages, skey, hs)
        g.pins = self.kv_host.pin(keys[d // ps : start])
        self.send(g, self.tier_ops, get=True)
        cfg = self.cfg
        g.tracker = PrefetchTracker(len(pages) + (hs is not None), cfg.prefetch_policy, now=now,
                                    timeout_s=cfg.prefetch_timeout_s, release=lambda _: None)
        g.tracker.issue()
        req.mem.prefetch = g.tracker
        self.counters.prefetch_pages += len(pages)
        return g.tracker

    # -- writes ---------------------------------------------------------------------------------
    def cached(self, key: CacheKey) -> None:
        """``key`` (and, with states, the state after it) just entered the tree."""
        if self.cfg.write_policy == "write_through":
            host_writes.want(self, key)

    def full(self) -> bool:
        return self.busy + len(self.backlog) >= self.cfg.max_inflight_jobs

    def send(self, g: Group, ops: list[CacheOp], *, get: bool = False,
             backup_slots: tuple[tuple[int, ...], int] | None = None) -> None:
        """Put a group's ops into ``ops`` and remember its job ids."""
        ops.extend(group_ops(g, self._ids, get=get, backup_slots=backup_slots))
        for job in (g.kv_job, g.state_job):
            if job:
                self._groups[job] = g
        self.busy += 1

    # -- the step stream ------------------------------------------------------------------------
    def evict_device(self, n: int) -> int:
        """Free about ``n`` device slots (the write policy may back them up first); returns the
        slots freed now."""
        return self.tree.evict(n)  # write_back: the tree hands each removed node to host_writes.evicted

    def take_ops(self) -> tuple[list[CacheOp], list[CacheOp]]:
        """(write-back copies of what was evicted: first in the step; loads and prefetches planned
        so far, then the backups and puts due now)."""
        first, self.first_ops = self.first_ops, []
        ops, self.tier_ops = self.tier_ops, []
        backlog, self.backlog = self.backlog, []
        for node, key, state in backlog:
            host_writes.start_backup(self, node, key, state, ops)
        puts, self.puts = self.puts, []
        for keys, skey in puts:
            host_writes.start_put(self, keys, skey, ops)
        return first, ops

    def on_results(self, results: list[JobResult]) -> None:
        """Acknowledge the jobs of a committed step."""
        for r in results:
            load = self._loads.pop(r.job_id, None)
            if load is not None:
                self._unpin(*load)  # loads were acknowledged when planned; their sources are read now
                continue
            g = self._groups.pop(r.job_id, None)
            if g is None:
                continue
            if not r.ok:
                self.counters.failed_jobs += 1
            if r.job_id == g.kv_job:
                g.kv_done = min(r.pages, len(g.pages)) if g.kind == "prefetch" else (len(g.pages) if r.ok else 0)
            else:
                g.state_ok = r.ok
            g.waiting -= 1
            if not g.waiting:
                host_writes.finish(self, g)

    def _unpin(self, pins: list[bytes], spins: list[bytes]) -> None:
        self.kv_host.unpin(pins)
        self.state_host.unpin(spins)

    @property
    def memory_pending(self) -> bool:
        """Backups hold device nodes until acknowledged; loads, prefetches and puts are on their way."""
        return bool(self._groups or self._loads or self.tier_ops or self.first_ops or self.backlog or self.puts)

    @property
    def inflight(self) -> int:
        """Backups, puts and prefetches sent and not yet wholly acknowledged."""
        return self.busy

    def flush(self) -> bool:
        """Drop every host page and state no job pins; True when none is left."""
        self.kv_host.evict(len(self.kv_host))
        self.state_host.evict(len(self.state_host))
        return not (len(self.kv_host) or len(self.state_host))

    # -- accounting -----------------------------------------------------------------------------
    def host_pages(self) -> dict[str, int]:
        """Host KV pages by state (host states are counted in the events)."""
        h = self.kv_host
        return {"free": h.size - len(h) - h.reserved, "evictable": h.evictable, "protected": h.protected}

    def check_idle(self) -> None:
        """The host pools' books balance (raises AssertionError)."""
        self.kv_host.check()
        self.state_host.check()
