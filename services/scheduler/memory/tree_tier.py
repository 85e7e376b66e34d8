"""The host tier of a dense model: host residency kept in the hierarchical radix tree
(``cache.hiradix.HiRadixCache``), which is then also ``Memory``'s device tree.

The tree hands out jobs (``BackupJob``, ``PutJob``, ``LoadJob``, ``PrefetchJob``) and this tier
turns them into step ops and the worker's acknowledgements back into tree calls (see ``host.py``
for the flows). Every job is acknowledged exactly once (the tree raises on a second ack); the
worker's results for loads are ignored, since loads are acknowledged when planned. Under
write_back an eviction backs pages up before it frees their slots: ``_evict_pending`` counts the
slots on their way, so a shortage that lasts a step does not evict again and again.
"""

from __future__ import annotations

from collections.abc import Callable

from services.common.step import CacheOp, HostBackup, HostLoad, JobResult, L3Get, L3Put
from services.scheduler.cache.base import CacheKey
from services.scheduler.cache.hiradix import HiRadixCache
from services.scheduler.cache.hiradix_policy import PrefetchTracker, should_prefetch
from services.scheduler.cache.hiradix_types import BackupJob, HiMatch, PutJob
from services.scheduler.host_alloc import HostPageAllocator
from services.scheduler.memory.host import HiConfig, HiCounters, match_key, wait_for_prefetch
from services.scheduler.request import Req


class TreeHostTier:
    def __init__(
        self, hi: HiRadixCache, host: HostPageAllocator, cfg: HiConfig,
        alloc: Callable[[int], list[int] | None], free_pages: Callable[[list[int]], None],
    ) -> None:
        """``alloc`` / ``free_pages``: ``Memory``'s (slots for loads, evicting when short)."""
        self.hi, self.pages, self.cfg = hi, host, cfg
        self._alloc, self._free_pages = alloc, free_pages
        self.ops: list[CacheOp] = []  # loads and prefetches planned since the last step
        self._sent: dict[int, BackupJob | PutJob | PrefetchTracker] = {}
        self._evict_pending = 0  # device slots an eviction is backing up before it frees them
        self.counters = HiCounters()

    # -- admission -------------------------------------------------------------------------------
    def extend_match(self, req: Req, key: CacheKey, n: int) -> int:
        m = self.hi.match(key, touch=False)
        return n + self._load(req, m) if m.host_len else n

    def prefix_len(self, key: CacheKey) -> int:
        return self.hi.match(key, touch=False).local_len

    def _load(self, req: Req, m: HiMatch) -> int:
        """Bring ``m``'s host part back into new slots (``HostLoad``); 0 when no room or the
        match went stale while making room."""
        slots = self._alloc(m.host_len)
        if slots is None:
            return 0
        slots = slots[: m.host_len]
        try:
            job = self.hi.start_load(m, slots)
        except ValueError:  # evicting to make room removed part of the host match
            self._free_pages(slots)
            return 0
        self.hi.load_done(job)  # ordered before any reader by the step stream (ops.py)
        self.ops.append(HostLoad(job.job_id, job.host_pages, job.slots))
        self.hi.lock(job.node)
        if req.lock is not None:
            self.hi.unlock(req.lock)
        req.lock = job.node
        req.slots.extend(slots)
        self.counters.load_tokens += len(slots)
        return len(slots)

    def hold(self, req: Req) -> bool:
        return wait_for_prefetch(req, self._start_prefetch)

    def _start_prefetch(self, req: Req, now: float) -> PrefetchTracker | None:
        hi = self.hi
        if not hi.l3_enabled or req.l3_pages <= 0:
            return None
        key = match_key(req)
        m = hi.match(key, touch=False)
        if not should_prefetch(req.l3_pages, m.local_len // hi.page_size, self.cfg.prefetch_threshold):
            return None
        job = hi.start_prefetch(key, m, req.l3_pages)
        if job is None:
            return None
        cfg = self.cfg
        t = PrefetchTracker(
            len(job.host_pages), cfg.prefetch_policy, now=now, timeout_s=cfg.prefetch_timeout_s,
            release=lambda n: hi.prefetch_done(job, n),
        )
        t.issue()
        self.ops.append(L3Get(job.job_id, job.hashes, job.host_pages))
        self._sent[job.job_id] = t
        req.prefetch = t
        self.counters.prefetch_pages += len(job.host_pages)
        return t

    # -- writes ----------------------------------------------------------------------------------
    def cached(self, key: CacheKey) -> None:
        """Nothing to do: the tree queues what its write policy wants as it inserts."""

    def evict_device(self, n: int) -> int:
        need = n - self._evict_pending
        if need <= 0:
            return 0
        ev = self.hi.evict_device(need)
        self._evict_pending += ev.pending
        return ev.freed

    @property
    def memory_pending(self) -> bool:
        """Slots or pages will come free without anyone finishing: jobs are in flight or queued to
        go (a write-back eviction frees its slots when its backup is acknowledged)."""
        return bool(self._sent or self.ops or self.hi.outbox_jobs)

    # -- the step stream -------------------------------------------------------------------------
    def take_ops(self) -> list[CacheOp]:
        """Loads and prefetches planned so far, then the backups and puts the tree wants now."""
        ops, self.ops = self.ops, []
        for job in self.hi.take_jobs():
            self._sent[job.job_id] = job
            if isinstance(job, BackupJob):
                ops.append(HostBackup(job.job_id, job.slots, job.host_pages))
            else:
                ops.append(L3Put(job.job_id, job.host_pages, job.hashes))
        return ops

    def on_results(self, results: list[JobResult]) -> None:
        for r in results:
            job = self._sent.pop(r.job_id, None)
            if job is None:
                continue  # a load: acknowledged when it was planned
            if not r.ok:
                self.counters.failed_jobs += 1
            if isinstance(job, BackupJob):
                if job.evict_after:
                    self._evict_pending -= len(job.slots)
                if r.ok:
                    self.counters.backup_pages += len(job.host_pages)
                    self.hi.backup_done(job)
                else:
                    self.hi.backup_failed(job)
            elif isinstance(job, PutJob):
                if r.ok:
                    self.counters.put_pages += len(job.host_pages)
                    self.hi.put_done(job)
                else:
                    self.hi.put_failed(job)
            else:
                self.counters.prefetched_pages += r.pages
                job.on_done(min(r.pages, job.pages))

    @property
    def inflight(self) -> int:
        return len(self._sent)

    # -- accounting ------------------------------------------------------------------------------
    def host_pages(self) -> dict[str, int]:
        hi = self.hi
        return {"free": self.pages.available, "evictable": hi.host_evictable_size,
                "protected": hi.host_protected_size}

    def check_idle(self) -> None:
        hi, host = self.hi, self.pages
        if host.available + hi.host_evictable_size + hi.host_protected_size != host.num_pages:
            raise AssertionError(
                f"host accounting broken when idle: available {host.available} + evictable "
                f"{hi.host_evictable_size} + protected {hi.host_protected_size} != {host.num_pages}"
            )
