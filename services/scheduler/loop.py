"""The scheduler's main loop: plan a step, run it on the worker, record the samples.

    while serving:
        plan   = batcher.plan()            # who runs, which tokens, which slots
        result = await worker.step(plan)   # forward + sample on the worker
        batcher.commit(plan, result)       # append tokens, stop checks, cache finished prefixes

The worker can come and go (discovery): ``attach`` rebuilds the memory view from its pools and
``detach`` requeues everything that was running, since its KV died with the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.common.page_hash import PageKeying
from services.common.step import WorkerInfo
from services.common.validation import Limits
from services.scheduler.batcher import Batcher, BatchLimits, Plan
from services.scheduler.budget_ledger import BudgetLedger
from services.scheduler.cache_events import ROUTE_PAGE_TOKENS, CacheEventLog
from services.scheduler.elastic_control import ElasticConfig, ElasticControl
from services.scheduler.memory import HiConfig, MemoryConfig, build_memory
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.overlap import OverlapPolicy
from services.scheduler.request import FailEvent, Finish, FinishEvent, Req
from services.scheduler.speculative import SpecConfig, Speculator
from services.scheduler.worker_link import WorkerGone, WorkerLink

log = logging.getLogger(__name__)

ELASTIC_TICK_S = 0.5  # how often an idle loop with elastic pools re-plans (to shrink them)
ORPHAN_CHECK_S = 0.25  # how often a loop without a worker checks its requeued requests' wait


@dataclass(frozen=True, slots=True)
class LoopConfig:
    cache: str = "radix"  # "radix" | "none"
    eviction: str = "lru"  # "lru" | "lfu"
    policy: str = "fcfs"  # "fcfs" | "lpm" (longest prefix match first)
    max_prefill_tokens: int = 1024
    max_running: int = 256
    max_waiting: int = 4096  # 0 = no limit
    worker_wait_s: float = 10.0
    check_invariants: bool = True
    overlap: bool = True  # plan step N+1 while the worker runs step N
    # ... unless step N prefills enough that overlap would hide under 1/overlap_ratio of it
    # (overlap.py); 0 = always.
    overlap_ratio: float = 20.0
    mamba_policy: str = "marconi"  # hybrid models: cached-state eviction, "marconi" | "lru"
    checkpoint_every: int = 0  # hybrid models: state checkpoint grid in tokens; 0 = max_prefill_tokens
    elastic_budget_bytes: int = 0  # KV + Mamba pool bytes, resized at run time; 0 = static pools
    elastic_idle_s: float = 5.0  # give pool memory back after this long idle
    elastic_min_kv_slots: int = 0  # the KV pool never shrinks below this; 0 = the context length
    hicache: HiConfig = field(default_factory=HiConfig)  # used when the worker has a host pool (and cache is radix)
    spec: SpecConfig = field(default_factory=SpecConfig)  # speculative decoding (off by default)
    handoff_wait_s: float = 2.0  # prefill role: the longest wait for a prompt's pages to reach L3


@dataclass(slots=True)
class Counters:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    busy_s: float = 0.0
    worker_idle_s: float = 0.0  # worker time between steps (what overlap hides)
    worker_busy_s: float = 0.0  # worker forward + sampling time


class SchedulerLoop:
    def __init__(
        self, cfg: LoopConfig, metrics: SchedulerMetrics | None = None, ledger: BudgetLedger | None = None
    ) -> None:
        """``ledger``: the elastic budget is shared with other schedulers (``cfg.elastic_budget_bytes``
        is then the shared total)."""
        self.cfg = cfg
        self.metrics = metrics
        if metrics is not None:
            metrics.max_waiting.set(cfg.max_waiting)
        self.ledger = ledger
        self.link: WorkerLink | None = None
        self.batcher: Batcher | None = None
        self.requests: dict[str, Req] = {}
        self.counters = Counters()
        self.overlap = OverlapPolicy(cfg.overlap_ratio)
        self._wake = asyncio.Event()
        self._ready = asyncio.Event()
        self._orphans: list[Req] = []  # requeued while no worker is attached
        self._detached_at = 0.0
        self.cache_events = CacheEventLog()  # what the prefix cache holds, for WatchCache

    # -- workers --------------------------------------------------------------------------------
    @property
    def info(self) -> WorkerInfo | None:
        return self.link.info if self.link is not None else None

    def attach(self, link: WorkerLink) -> None:
        """Serve with ``link``'s worker; its pools start empty."""
        info = link.info
        cfg = self.cfg
        mem = build_memory(info, MemoryConfig(
            cache=cfg.cache, eviction=cfg.eviction, state_policy=cfg.mamba_policy,
            checkpoint_every=cfg.checkpoint_every or cfg.max_prefill_tokens, hicache=cfg.hicache,
        ))
        limits = BatchLimits(
            max_prefill_tokens=self.cfg.max_prefill_tokens,
            max_running=min(self.cfg.max_running, info.num_rows),
            fcfs=self.cfg.policy == "fcfs",
        )
        batcher = Batcher(mem, limits, frozenset(info.eos_token_ids), info.context_length)
        batcher.handoff_wait_s = cfg.handoff_wait_s
        if cfg.spec.algorithm:
            if info.tp_size > 1 and cfg.spec.algorithm != "ngram":
                log.warning("speculative decoding is off: the worker runs tensor parallel, where only "
                            "--speculative-algorithm ngram drafts (a draft model or MTP head is not sharded)")
            elif cfg.spec.algorithm == "draft" and info.draft_model in ("", "mtp"):
                log.error("speculative decoding is off: --speculative-algorithm draft but the worker has no "
                          "--speculative-draft-model")
            elif cfg.spec.algorithm == "mtp" and info.draft_model != "mtp":
                log.error("speculative decoding is off: --speculative-algorithm mtp but the worker does not draft "
                          "with an MTP head (--speculative-mtp)")
            else:
                batcher.spec = Speculator(cfg.spec, info.context_length)
        if cfg.elastic_budget_bytes:
            ecfg = ElasticConfig(cfg.elastic_budget_bytes, cfg.elastic_min_kv_slots, idle_s=cfg.elastic_idle_s)
            batcher.elastic = ElasticControl(ecfg, info, mem, self.ledger)
        for req in self._orphans:  # requeued when the last worker was lost: they resume here
            if req.finished is not None:
                continue
            if (problem := self._too_large(req, info, batcher)) is not None:
                req.finished = Finish.ERROR
                req.emit(FailEvent(Unavailable(f"the worker was lost and the one that connected cannot hold "
                                               f"the request: {problem}")))
                continue
            batcher.waiting.append(req)
        self._orphans = []
        self.link, self.batcher = link, batcher
        events = self.cache_events
        if mem.follow(events.on_tree_event, events.on_host_page):
            page = info.host_page_tokens if mem.host is not None else ROUTE_PAGE_TOKENS
            events.attach(PageKeying(page, info.fingerprint, info.kv_layout or "device"))
        else:
            events.attach(None)
        if self.metrics is not None:
            self.metrics.reset()
            batcher.on_queue_wait = self.metrics.queue_seconds.observe
        self._ready.set()
        self._wake.set()
        log.info("attached worker %s: %d slots, %d rows", info.model, info.num_slots, info.num_rows)

    async def detach(self, reason: str) -> None:
        link, batcher = self.link, self.batcher
        self.link, self.batcher = None, None
        self._ready.clear()
        self._detached_at = time.monotonic()
        self.cache_events.attach(None)
        if batcher is not None:
            batcher.fail_all(reason)
            self._orphans = [r for r in batcher.waiting if not r.aborted]
            for r in batcher.waiting:
                if r.aborted:
                    r.emit_abort()
        if link is not None:
            await link.close()

    async def wait_for_worker(self) -> WorkerInfo:
        deadline = time.monotonic() + self.cfg.worker_wait_s
        while True:  # the link can drop again between the event and this task running
            try:
                await asyncio.wait_for(self._ready.wait(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise Unavailable(f"no worker connected within {self.cfg.worker_wait_s:g}s") from None
            if self.link is not None:
                return self.link.info

    def limits(self) -> Limits:
        info = self.info
        if info is None:
            raise Unavailable("no worker connected")
        return Limits(info.vocab_size, info.context_length)

    # -- requests -------------------------------------------------------------------------------
    @staticmethod
    def _too_large(req: Req, info: WorkerInfo, batcher: Batcher) -> str | None:
        """Why no wait would help ``req`` on this worker (its pool is too small), or None."""
        need = len(req.prompt) + max(req.gen.max_new_tokens - 1, 0)
        pool = info.max_slots if batcher.elastic is not None else info.num_slots
        if need <= pool:
            return None
        field = "input" if len(req.prompt) > pool else "sampling.max_new_tokens"
        return (
            f"{field}: the request needs up to {need} KV slots (prompt {len(req.prompt)} + "
            f"max_new_tokens {req.gen.max_new_tokens}) but the worker's pool has {pool}"
        )

    def submit(self, req: Req) -> None:
        info = self.info
        if info is None or self.batcher is None:
            raise Unavailable("no worker connected")
        if (problem := self._too_large(req, info, self.batcher)) is not None:
            raise InvalidArgument(problem)
        if self.cfg.max_waiting and len(self.batcher.waiting) >= self.cfg.max_waiting:
            if self.metrics is not None:
                self.metrics.shed.inc()
            raise ResourceExhausted(
                f"the scheduler is shedding load: {len(self.batcher.waiting)} requests are waiting "
                f"(max_waiting {self.cfg.max_waiting}); retry later"
            )
        self.requests[req.rid] = req
        self.counters.prompt_tokens += len(req.prompt)
        self.batcher.waiting.append(req)
        self._wake.set()

    def abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None or req.finished is not None:
            return False
        req.aborted = True
        if self.batcher is None:  # orphaned: nothing to free
            if req in self._orphans:
                self._orphans.remove(req)
            req.emit_abort()
        self._wake.set()
        return True

    def _expire_orphans(self) -> None:
        """Requests requeued when their worker was lost wait ``worker_wait_s`` for another; then
        they end with UNAVAILABLE (never an unbounded wait)."""
        if self.link is not None or not self._orphans:
            return
        if time.monotonic() - self._detached_at < self.cfg.worker_wait_s:
            return
        error = Unavailable(f"the worker was lost and none connected within {self.cfg.worker_wait_s:g}s")
        for req in self._orphans:
            if req.finished is None:
                req.finished = Finish.ERROR
                req.emit(FailEvent(error))
        log.warning("%d requeued requests ended: %s", len(self._orphans), error)
        self._orphans = []

    def forget(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def _fail_step(self, reqs: list[Req], error: str) -> None:
        """End ``reqs`` with ERROR and restart the bookkeeping from empty pools (the cache may be
        inconsistent after a failed step), requeueing every other request on the same worker."""
        for req in reqs:
            if req.finished is None:
                req.finished = Finish.ERROR
                ev = FinishEvent(Finish.ERROR, len(req.prompt), len(req.output), req.cached_tokens, error)
                req.emit(ev)
        link, batcher = self.link, self.batcher
        assert link is not None and batcher is not None
        batcher.fail_all(error)
        self._orphans = [r for r in batcher.waiting if r.finished is None and not r.aborted]
        for r in batcher.waiting:
            if r.aborted and r.finished is None:
                r.emit_abort()
        self.attach(link)

    # -- the loop -------------------------------------------------------------------------------
    async def _idle(self, batcher: Batcher, stop: asyncio.Event) -> None:
        """No step to plan and none in flight: check the books, then sleep until woken (with
        elastic pools, at most a tick, to give memory back once idle long enough)."""
        if self.cfg.check_invariants and batcher.idle:
            batcher.mem.check_idle()
        self._wake.clear()
        tick = (asyncio.sleep(ELASTIC_TICK_S),) if batcher.elastic is not None else ()
        await _first(self._wake.wait(), stop.wait(), *tick)

    async def run(self, stop: asyncio.Event) -> None:
        """Plan, send, receive, commit. With ``overlap`` the next step is planned and sent while
        the worker runs the current one (at most two in flight; not behind a long prefill step,
        overlap.py); results are committed in order, one step behind."""
        inflight: deque[tuple[Plan, float]] = deque()
        policy = self.overlap
        # The first step after the scheduler had no work reports the whole pause as worker idle
        # time; that is not a scheduling gap, so it is left out of worker_idle_s.
        from_idle = True
        while not stop.is_set():
            if self.batcher is None or self.link is None:
                inflight.clear()
                await _first(self._ready.wait(), stop.wait(), asyncio.sleep(ORPHAN_CHECK_S))
                self._expire_orphans()
                continue
            batcher, link = self.batcher, self.link
            planning, done, result, t0 = True, None, None, 0.0
            pipelined = self.cfg.overlap and (not inflight or policy.pipeline_behind(inflight[-1][0].prefill_tokens))
            depth = 2 if pipelined else 1
            try:
                own = time.perf_counter()
                plan = batcher.plan() if len(inflight) < depth else None  # plan
                own = time.perf_counter() - own
                planning = False
                if plan is not None:
                    await link.send(plan.step)  # send
                    inflight.append((plan, time.perf_counter()))
                if inflight and (plan is None or len(inflight) >= depth):
                    done, t0 = inflight.popleft()
                    result = await link.recv()  # receive
                    outs = result.outputs
                    rows = [o.row for o in outs] if any(done.drafts) else ()
                    t_commit = time.perf_counter()
                    batcher.commit(done, [(o.token_id, o.logprob) for o in outs], result.jobs, rows,
                                   result.prompt)  # commit
                    policy.observe_scheduler(own + time.perf_counter() - t_commit)
                    policy.observe_step(done.prefill_tokens, result.forward_s + result.sample_s)
                    if inflight and inflight[0][0].late:  # the next step waits for these masks
                        await link.send_masks(batcher.late_masks(inflight[0][0], link.info.vocab_size))
            except WorkerGone as e:
                log.warning("%s", e)
                inflight.clear()
                await self.detach(str(e))
                continue
            except Exception as e:
                # A bug, not a lost worker: fail loudly what the failure may have touched (a
                # failed plan: everything running) and start clean; never let the loop die
                # silently while the server keeps accepting requests.
                log.exception("planning a step failed" if planning else "step failed")
                failed = [r for p, _ in inflight for r in p.reqs] + (done.reqs if done is not None else [])
                failed += list(batcher.running) if planning else []
                inflight.clear()
                self._fail_step(failed, f"internal error {'while planning' if planning else 'in'} a step: {e!r}")
                continue
            if result is None or done is None:
                if not inflight:  # nothing to do: wait for work
                    await self._idle(batcher, stop)
                    from_idle = True
                continue  # with a step in flight: plan the next one while it runs
            step_s = time.perf_counter() - t0
            self.counters.busy_s += step_s
            self.counters.steps += 1
            self.counters.generated_tokens += len(result.outputs)
            if not from_idle:
                self.counters.worker_idle_s += result.idle_s
            if batcher.spec is not None:
                counted = not from_idle and not done.prefill_tokens
                batcher.spec.observe(done.decoding, len(result.outputs), counted)
            from_idle = False
            self.counters.worker_busy_s += result.forward_s + result.sample_s
            if self.metrics is not None:
                self.metrics.observe(batcher, done, result, step_s)
            # Let servicers stream what was just produced before planning the next step.
            await asyncio.sleep(0)


async def _first(*aws: object) -> None:
    """Wait until the first of the awaitables completes; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]  # type: ignore[call-overload]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
