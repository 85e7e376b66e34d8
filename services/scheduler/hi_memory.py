"""KV memory of a worker with a host pool: the hierarchical radix cache in the loop.

``HiMemory`` is ``KVMemory`` whose prefix cache is ``HiRadixCache`` (device L1 + host L2, and the
kvstore L3 through jobs). It turns the tree's jobs into step ops and the worker's
acknowledgements back into tree calls:

- **admission** (``match``): the device prefix is locked as usual; a host-only continuation is
  loaded back into freshly allocated slots (``HostLoad``) and the request starts after it. The
  load is acknowledged when it is planned: the op runs in the step's op phase, before that step's
  forward and every later step, so nothing can read the slots before the bytes are there, and a
  step that fails takes the worker's whole pool view with it (the loop rebuilds it);
- **L3 prefetch** (``hold``): when the kvstore holds at least ``prefetch_threshold`` pages beyond
  the local match (``req.l3_pages``, looked up at submission), host pages are reserved and an
  ``L3Get`` is sent; the request waits as its stop policy says (best_effort: not at all;
  wait_complete: until the acknowledgement; timeout: at most ``prefetch_timeout_s``). The pages
  that arrived join the tree as host-resident, and the next admission loads them like any host hit;
- **writes**: backups (``HostBackup``) and puts (``L3Put``) the write policy or an eviction
  wants are sent with the next step (``take_tier_ops``) and acknowledged from its ``StepResult.jobs``
  (``on_results``); until then their device slots / host pages stay pinned. In-flight backups,
  puts and prefetches are bounded by ``max_inflight_jobs`` (back-pressure: further writes wait on
  their nodes, further prefetches are skipped).

Every job is acknowledged exactly once (the tree raises on a second ack); the worker's results for
loads are ignored, since loads are acknowledged when planned. Invariants when idle: device
``free + evictable + protected == size`` and host ``available + host_evictable + host_protected ==
host pages``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from services.common.page_hash import HashNamespace
from services.common.step import CacheOp, HostBackup, HostLoad, JobResult, L3Get, L3Put
from services.scheduler.cache.hiradix import HiRadixCache
from services.scheduler.cache.hiradix_policy import PrefetchTracker, StopPolicy, WritePolicy, should_prefetch
from services.scheduler.cache.hiradix_types import BackupJob, HiMatch, PutJob
from services.scheduler.host_alloc import HostPageAllocator
from services.scheduler.memory import KVMemory
from services.scheduler.request import Req

log = logging.getLogger(__name__)


class TieredMemory(Protocol):
    """What the batcher asks of a memory with host and L3 tiers (``HiMemory``, ``HybridHiMemory``)."""

    def hold(self, req: Req) -> bool:
        """Whether ``req`` should wait (for its L3 prefetch) before admission."""
        ...

    def take_tier_ops(self) -> list[CacheOp]:
        """The host and L3 ops for the step being planned."""
        ...

    def on_results(self, results: list[JobResult]) -> None:
        """Acknowledge the jobs of a committed step."""
        ...

    @property
    def memory_pending(self) -> bool:
        """Memory will come free without any request finishing (jobs in flight or queued)."""
        ...


@dataclass(frozen=True, slots=True)
class HiConfig:
    """The scheduler's hierarchical-cache settings (the pool sizes come from the worker)."""

    write_policy: WritePolicy = "write_through"
    prefetch_policy: StopPolicy = "wait_complete"
    prefetch_threshold: int = 1  # pages L3 must hold beyond the local match to fetch them
    prefetch_timeout_s: float = 2.0
    max_inflight_jobs: int = 64


@dataclass(slots=True)
class HiCounters:
    load_tokens: int = 0  # tokens brought back from the host at admission
    prefetch_pages: int = 0  # pages asked of L3
    prefetched_pages: int = 0  # pages that arrived from L3
    backup_pages: int = 0
    put_pages: int = 0
    failed_jobs: int = 0


def wait_for_prefetch(req: Req, start: Callable[[Req, float], PrefetchTracker | None]) -> bool:
    """Whether ``req`` should wait for its L3 prefetch, started by ``start(req, now)`` on the first
    call (None: no prefetch pays, do not wait); the tracker's stop policy decides after that."""
    t: PrefetchTracker | None = req.prefetch
    now = time.monotonic()
    if t is None:
        t = start(req, now)
        if t is None:
            return False
    t.expire(now)
    return not t.may_admit(now)


class HiMemory(KVMemory):
    """``KVMemory`` over the hierarchical radix cache; see the module docstring."""

    def __init__(
        self,
        num_slots: int,
        num_rows: int,
        page_size: int,
        *,
        host_pages: int,
        host_page_tokens: int,
        namespace: HashNamespace,
        l3: bool,
        eviction: Literal["lru", "lfu"] = "lru",
        cfg: HiConfig | None = None,
    ) -> None:
        super().__init__(num_slots, num_rows, page_size, "none")
        if host_page_tokens < 1 or host_page_tokens % page_size:
            raise ValueError(f"host_page_tokens ({host_page_tokens}) must be a multiple of page_size ({page_size})")
        self.cfg = cfg or HiConfig()
        self.host = HostPageAllocator(host_pages)
        self.hi = HiRadixCache(
            host_page_tokens, self.slots.free, self.host, namespace,
            write_policy=self.cfg.write_policy, eviction=eviction, l3=l3,
            max_inflight_jobs=self.cfg.max_inflight_jobs,
        )
        self.cache = self.hi
        self.ops: list[CacheOp] = []  # loads and prefetches planned since the last step
        self._sent: dict[int, BackupJob | PutJob | PrefetchTracker] = {}
        self._evict_pending = 0  # device slots an eviction is backing up before it frees them
        self.counters = HiCounters()

    # -- admission -------------------------------------------------------------------------------
    def prefix_len(self, req: Req) -> int:
        """Tokens usable now without a recompute (device + host), without counting a hit."""
        return self.hi.match(self.match_key(req), touch=False).local_len

    def match(self, req: Req) -> int:
        key = self.match_key(req)
        m = self.hi.match(key)
        n = len(m.slots)
        if n:
            self.hi.lock(m.node)
            req.lock = m.node
            req.slots = list(m.slots)
        if m.host_len:
            n += self._load(req, m)
        req.cache_len = req.planned_len = n
        return n

    def _load(self, req: Req, m: HiMatch) -> int:
        """Bring ``m``'s host part back into new slots (``HostLoad``); 0 when no room or the
        match went stale while making room."""
        slots = self.alloc(m.host_len)
        if slots is None:
            return 0
        slots = slots[: m.host_len]
        try:
            job = self.hi.start_load(m, slots)
        except ValueError:  # evicting to make room removed part of the host match
            self.slots.free(self._pages(slots))
            return 0
        self.hi.load_done(job)  # ordered before any reader by the step stream (module docstring)
        self.ops.append(HostLoad(job.job_id, job.host_pages, job.slots))
        self.hi.lock(job.node)
        if req.lock is not None:
            self.hi.unlock(req.lock)
        req.lock = job.node
        req.slots.extend(slots)
        self.counters.load_tokens += len(slots)
        return len(slots)

    def hold(self, req: Req) -> bool:
        """Whether ``req`` should wait for an L3 prefetch (starting one when it pays)."""
        return wait_for_prefetch(req, self._start_prefetch)

    def _start_prefetch(self, req: Req, now: float) -> PrefetchTracker | None:
        hi = self.hi
        if not hi.l3_enabled or req.l3_pages <= 0:
            return None
        key = self.match_key(req)
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

    def _evict(self, n: int) -> None:
        """Make ``n`` slots free, counting those already on their way (write-back evictions whose
        backups are in flight free their slots when acknowledged), so a shortage that persists
        for a step does not evict again and again."""
        need = n - self._evict_pending
        if need > 0:
            ev = self.hi.evict_device(need)
            self.evicted += ev.freed
            self._evict_pending += ev.pending

    @property
    def memory_pending(self) -> bool:
        """Slots or pages will come free without anyone finishing: jobs are in flight or queued to
        go (a write-back eviction frees its slots when its backup is acknowledged)."""
        return bool(self._sent or self.ops or self.hi.outbox_jobs)

    # -- the step stream -------------------------------------------------------------------------
    def take_tier_ops(self) -> list[CacheOp]:
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
        """Acknowledge the jobs of a committed step."""
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
        """Jobs sent and not yet acknowledged."""
        return len(self._sent)

    # -- accounting ------------------------------------------------------------------------------
    def check_idle_invariant(self) -> None:
        super().check_idle_invariant()
        hi, host = self.hi, self.host
        if host.available + hi.host_evictable_size + hi.host_protected_size != host.num_pages:
            raise AssertionError(
                f"host accounting broken when idle: available {host.available} + evictable "
                f"{hi.host_evictable_size} + protected {hi.host_protected_size} != {host.num_pages}"
            )
