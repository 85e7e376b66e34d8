"""The host tier of a model with recurrent layers: KV pages and states in hash-keyed host indexes
beside the device's prefix tree (which must carry states).

A hybrid prefix is only usable with the recurrent state right after it, so below the device (the
tree is paged in host pages, so every checkpoint sits on a host-page boundary) the tiers keep two
kinds of object under the same chained page hashes (``services.common.page_hash``): KV pages, keyed
by the page's hash ``h_i``, and states, keyed by ``state_key(h_i)`` for the state right after page
``i`` (only at checkpoints). On the host (L2) each kind has a ``HostIndex``; in L3 they are plain
kvstore keys.

Flows (each op is acknowledged by the worker in ``StepResult.jobs``; a *group* is the one or two
ops, pages and state, of one backup / put / prefetch, finished when all its ops are):

- **write_through**: a state that enters the device tree (a fork, or a donated working state) is
  backed up with the pages before it that the host lacks: the node is locked (KV path + state),
  ``HostBackup`` + ``StateBackup`` go with the next step — after that step's fork copies, so a fork
  is read once it holds its state (``ops.py``) — and on acknowledgement the pages and the state
  join the host index and the node is unlocked. With L3, an ``L3Put`` of what is new follows.
- **admission** (``extend_match``): after the device match (``n`` tokens with a state; KV reach
  ``d`` through tombstones) the host is searched for the deepest state ``q > n`` whose pages lie
  below ``d`` or in the host's run of pages from ``d``. Pages ``[d, q)`` are loaded into new slots
  (``HostLoad``), the state into a new state slot (``StateLoad``); the prefix and that state are
  inserted into the device tree, locked and served like a device hit (the request's copy-on-write
  follows in the same step).
- **L3 prefetch** (``hold``): ``Req.l3_pages`` is the deepest state (in pages) whose pages and
  state L3 holds (``l3_lookup``). When it exceeds the local reach by ``prefetch_threshold`` pages,
  the missing pages and the state are fetched into reserved host pages (two ``L3Get``), the host
  pages the fetch continues are pinned, and the request waits as its stop policy says. The
  leading pages that arrived join the host index, and the state too when every page did.

Only ``write_through`` exists for hybrid models so far (a configured write_back / selective policy
logs a warning). Groups in flight plus backups queued are bounded by ``max_inflight_jobs``; beyond
it a backup, put or prefetch is skipped and counted (``refused``). Invariant when idle: ``available
+ evictable + protected + reserved == size`` for pages and states (``HostIndex.check``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from services.common.page_hash import HashNamespace, page_hashes, state_key
from services.common.step import CacheOp, HostLoad, JobResult, StateLoad
from services.scheduler.cache.base import CacheHandle, CacheKey
from services.scheduler.cache.hiradix_policy import PrefetchTracker, should_prefetch
from services.scheduler.cache.host_index import HostIndex
from services.scheduler.cache.tree import PrefixTree
from services.scheduler.host_alloc import HostPageAllocator
from services.scheduler.hybrid_host_jobs import Group, group_ops, land
from services.scheduler.memory.host import HiConfig, HiCounters, match_key, wait_for_prefetch
from services.scheduler.memory.states import StateTrack
from services.scheduler.request import Req

log = logging.getLogger(__name__)


class IndexHostTier:
    def __init__(
        self, tree: PrefixTree, states: StateTrack, *, host_pages: int, host_states: int,
        namespace: HashNamespace, state_layout: str, l3: bool, cfg: HiConfig,
        alloc: Callable[[int], list[int] | None], free_pages: Callable[[list[int]], None],
    ) -> None:
        """``alloc`` / ``free_pages``: ``Memory``'s (slots for loads, evicting when short)."""
        if host_pages < 1 or host_states < 1:
            raise ValueError(f"a hybrid host tier needs host pages and host states, got {host_pages} / {host_states}")
        if not state_layout:
            raise ValueError("state_layout must be non-empty (it is part of every state key)")
        if cfg.write_policy != "write_through":
            log.warning("hybrid models back states up write_through; write policy %r not used", cfg.write_policy)
        self.tree, self.states, self.cfg = tree, states, cfg
        self.tree_page = tree.page_size
        self._alloc, self._free_pages = alloc, free_pages
        self.kv_host = HostIndex(HostPageAllocator(host_pages))
        self.state_host = HostIndex(HostPageAllocator(host_states))
        self.namespace = namespace
        self.state_layout = state_layout
        self.l3 = l3
        self.tier_ops: list[CacheOp] = []  # loads and prefetches planned since the last step
        self._backlog: list[tuple[CacheHandle, CacheKey, int]] = []  # (locked node, key, state slot)
        self._puts: list[tuple[list[bytes], bytes | None]] = []  # acked backups to put to L3
        self._groups: dict[int, Group] = {}  # job id -> its group
        self._busy = 0  # groups in flight (bounded by cfg.max_inflight_jobs with the backlog)
        self._incoming: set[bytes] = set()  # keys a backup is writing to the host
        self._ids = itertools.count(1)
        self._ns: dict[str, HashNamespace] = {}
        self.counters = HiCounters()

    # -- keys -----------------------------------------------------------------------------------
    def _hashes(self, key: CacheKey) -> list[bytes]:
        ns = self._ns.get(key.extra)
        if ns is None:
            base = self.namespace
            ns = self._ns[key.extra] = HashNamespace(base.model_fingerprint, base.layout, cache_salt=key.extra)
        return page_hashes(key.tokens, self.tree_page, ns)

    def _skey(self, page_hash: bytes) -> bytes:
        return state_key(page_hash, self.state_layout)

    def _host_reach(self, keys: list[bytes], n: int, d: int) -> tuple[int, int]:
        """``(e, q)`` in pages: the end of the host's run of pages from the device's KV reach
        ``d``, and the deepest state ``q`` past the device's served prefix ``n`` whose pages are
        all local (below ``max(d, e)``), or 0."""
        ps = self.tree_page
        e = self.kv_host.run(keys, d // ps)
        for q in range(max(d // ps, e), n // ps, -1):
            if self._skey(keys[q - 1]) in self.state_host:
                return e, q
        return e, 0

    # -- admission ------------------------------------------------------------------------------
    def extend_match(self, req: Req, key: CacheKey, n: int) -> int:
        keys = self._hashes(key)
        _, q = self._host_reach(keys, n, len(self.tree.kv_path(key)))
        return (self._load(req, key, keys, q) or n) if q else n

    def prefix_len(self, key: CacheKey) -> int:
        return self.tree.match(key).length

    def _load(self, req: Req, key: CacheKey, keys: list[bytes], q: int) -> int:
        """Bring pages ``[d, q)`` and the state after page ``q`` from the host, insert them into
        the device tree and serve the request from there; 0 when there is no room."""
        ps, n = self.tree_page, req.cache_len
        end = q * ps
        state = self.states.alloc()
        if state is None:
            return 0
        got = self._alloc(end - n) if end > n else []
        if got is None:
            self.states.pool.free(state)
            return 0
        dev = self.tree.kv_path(key)[:end]  # again: making room may have evicted tombstones
        d = len(dev)
        if d < end and self.kv_host.run(keys, d // ps) < q:
            self._free_pages(got)
            self.states.pool.free(state)
            return 0
        new, spare = got[: end - d], got[end - d :]
        if spare:
            self._free_pages(spare)
        skey = self._skey(keys[q - 1])
        sentry = self.state_host.get(skey)
        assert sentry is not None
        if new:
            host_pages = tuple(self.kv_host.get(k).index for k in keys[d // ps : q])  # type: ignore[union-attr]
            self.tier_ops.append(HostLoad(next(self._ids), host_pages, tuple(new)))
        self.tier_ops.append(StateLoad(next(self._ids), (sentry.index,), (state,)))
        self.kv_host.touch(keys[:q])
        self.state_host.touch([skey])
        pkey = CacheKey(key.tokens[:end], key.extra)
        res = self.tree.insert_checkpoint(pkey, dev + new, state)
        assert res.cached_len == d, (res.cached_len, d)
        m = self.tree.match(pkey)
        assert len(m.slots) == end
        self.tree.lock(m.node)
        if req.lock is not None:
            self.tree.unlock(req.lock)
        req.lock, req.slots, req.matched_state = m.node, list(m.slots), m.state
        req.branch_len = max(req.branch_len, end)
        self.counters.load_tokens += len(new)
        self.counters.state_loads += 1
        return end

    def hold(self, req: Req) -> bool:
        """Whether ``req`` should wait for an L3 prefetch (starting one when it pays)."""
        return wait_for_prefetch(req, self._start_prefetch)

    def _start_prefetch(self, req: Req, now: float) -> PrefetchTracker | None:
        if not self.l3 or req.l3_pages <= 0 or self.tree is None:
            return None
        key = match_key(req)
        keys = self._hashes(key)
        top = min(req.l3_pages, len(keys))
        n = self.tree.match(key).length
        d = len(self.tree.kv_path(key))
        e, q = self._host_reach(keys, n, d)
        local = max(n // self.tree_page, q)
        if not should_prefetch(top, local, self.cfg.prefetch_threshold):
            return None
        if self._full():
            self.counters.refused += 1
            return None
        start = min(max(d // self.tree_page, e), top)
        pages = self.kv_host.reserve(top - start)
        if pages is None:
            self.counters.refused += 1
            return None
        hs = self.state_host.reserve(1)
        if hs is None:
            self.kv_host.release(pages)
            self.counters.refused += 1
            return None
        g = Group("prefetch", keys[start:top], pages, self._skey(keys[top - 1]), hs[0])
        g.pins = self.kv_host.pin(keys[d // self.tree_page : start])
        self._send(g, self.tier_ops, get=True)
        cfg = self.cfg
        g.tracker = PrefetchTracker(len(pages) + 1, cfg.prefetch_policy, now=now, timeout_s=cfg.prefetch_timeout_s,
                                    release=lambda _: None)
        g.tracker.issue()
        req.prefetch = g.tracker
        self.counters.prefetch_pages += len(pages)
        return g.tracker

    # -- writes ---------------------------------------------------------------------------------
    def cached(self, key: CacheKey) -> None:
        """A state entered the device tree at the end of ``key``: back it up (write_through)."""
        m = self.tree.match(key)
        if m.length != len(key.tokens) or m.state is None:
            return
        if self._full():
            self.counters.refused += 1
            return
        self.tree.lock(m.node)
        self._backlog.append((m.node, key, m.state))

    def take_ops(self) -> list[CacheOp]:
        """Loads and prefetches planned so far, then the backups and puts due now."""
        ops, self.tier_ops = self.tier_ops, []
        backlog, self._backlog = self._backlog, []
        for node, key, slot in backlog:
            self._start_backup(node, key, slot, ops)
        puts, self._puts = self._puts, []
        for keys, skey in puts:
            self._start_put(keys, skey, ops)
        return ops

    def _start_backup(self, node: CacheHandle, key: CacheKey, slot: int, ops: list[CacheOp]) -> None:
        ps = self.tree_page
        keys = self._hashes(key)
        skey = self._skey(keys[-1])
        missing = [i for i, k in enumerate(keys) if k not in self.kv_host and k not in self._incoming]
        need_state = skey not in self.state_host and skey not in self._incoming
        if not missing and not need_state:  # the host has it all, or is getting it
            self.tree.unlock(node)
            return
        pages = self.kv_host.reserve(len(missing))
        hs = self.state_host.reserve(1) if need_state and pages is not None else []
        if pages is None or hs is None:  # no host room that is not pinned
            if pages:
                self.kv_host.release(pages)
            self.counters.refused += 1
            self.tree.unlock(node)
            return
        slots = self.tree.kv_path(key)
        assert len(slots) == len(key.tokens), "a locked node keeps its path"
        g = Group("backup", [keys[i] for i in missing], pages, skey if hs else None, hs[0] if hs else None)
        g.node = node
        self._incoming.update(g.keys)
        if g.skey is not None:
            self._incoming.add(g.skey)
        dev = tuple(s for i in missing for s in slots[i * ps : (i + 1) * ps])
        self._send(g, ops, backup_slots=(dev, slot))

    def _start_put(self, keys: list[bytes], skey: bytes | None, ops: list[CacheOp]) -> None:
        keys = [k for k in keys if (e := self.kv_host.get(k)) is not None and not e.l3]
        se = self.state_host.get(skey) if skey is not None else None
        if se is not None and se.l3:
            se = None
        if not keys and se is None:
            return
        if self._full():
            self.counters.refused += 1
            return
        g = Group("put", keys, [self.kv_host.get(k).index for k in keys],  # type: ignore[union-attr]
                   skey if se is not None else None, se.index if se is not None else None)
        g.pins = self.kv_host.pin(keys)
        g.spins = self.state_host.pin([skey]) if se is not None and skey is not None else []
        self._send(g, ops)

    def _full(self) -> bool:
        return self._busy + len(self._backlog) >= self.cfg.max_inflight_jobs

    def _send(self, g: Group, ops: list[CacheOp], *, get: bool = False,
              backup_slots: tuple[tuple[int, ...], int] | None = None) -> None:
        """Put a group's ops into ``ops`` and remember its job ids."""
        ops.extend(group_ops(g, self._ids, get=get, backup_slots=backup_slots))
        for job in (g.kv_job, g.state_job):
            if job:
                self._groups[job] = g
        self._busy += 1

    # -- acknowledgements -----------------------------------------------------------------------
    def on_results(self, results: list[JobResult]) -> None:
        """Acknowledge the jobs of a committed step (load results are ignored: see the docstring)."""
        for r in results:
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
                self._finish(g)

    def _finish(self, g: Group) -> None:
        self._busy -= 1
        got, state_ok = land(g, self.kv_host, self.state_host)
        if g.kind == "put":
            self.counters.put_pages += got
            self.counters.state_puts += state_ok
        elif g.kind == "backup":
            self._incoming.difference_update(g.keys)
            self._incoming.discard(g.skey or b"")
            assert g.node is not None and self.tree is not None
            self.tree.unlock(g.node)
            self.counters.backup_pages += got
            self.counters.state_backups += state_ok
            if self.l3 and (got or state_ok):
                self._puts.append((g.keys[:got], g.skey if state_ok else None))
        elif g.kind == "prefetch":
            self.counters.prefetched_pages += got
            self.counters.states_prefetched += state_ok
            assert g.tracker is not None
            g.tracker.on_done(got + state_ok)

    @property
    def memory_pending(self) -> bool:
        """Backups hold device nodes until acknowledged; loads, prefetches and puts are on their way."""
        return bool(self._groups or self.tier_ops or self._backlog or self._puts)

    @property
    def inflight(self) -> int:
        """Backups, puts and prefetches sent and not yet wholly acknowledged."""
        return self._busy

    # -- accounting -----------------------------------------------------------------------------
    def evict_device(self, n: int) -> int:
        return self.tree.evict(n)

    def host_pages(self) -> dict[str, int]:
        """Host KV pages by state (a hybrid model's host states are counted in the events)."""
        h = self.kv_host
        return {"free": h.size - len(h) - h.reserved, "evictable": h.evictable, "protected": h.protected}

    def check_idle(self) -> None:
        self.kv_host.check()
        self.state_host.check()
