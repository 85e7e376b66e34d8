"""Prometheus metrics and the periodic log line of the scheduler, updated once per step."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter

from services.common.metrics import REQUEST_BUCKETS_S, MetricFactory
from services.common.step import StepResult
from services.scheduler.batcher import Batcher, Plan

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        m = MetricFactory(registry, "scheduler")
        self.running = m.gauge("running_requests", "Requests holding a row (prefilling or decoding).")
        self.waiting = m.gauge("waiting_requests", "Requests queued for admission.")
        self.max_waiting = m.gauge("max_waiting_requests", "The admission queue's bound (--max-waiting; 0 = none).")
        self.shed = m.counter("shed_requests", "Requests refused with RESOURCE_EXHAUSTED: the queue was full.")
        self.token_usage = m.gauge("token_usage", "Fraction of KV slots used by running requests.")
        self.cache_slots = m.gauge("cache_slots", "KV slots held by the prefix cache.", ["state"])
        self.prompt_tokens = m.counter("prompt_tokens", "Prompt tokens admitted (first admission).")
        self.cache_hit_tokens = m.counter("cache_hit_tokens", "Prompt tokens reused from a cache.", ["tier"])
        self.generated_tokens = m.counter("generated_tokens", "Tokens sampled.")
        self.retractions = m.counter("retractions", "Requests preempted to free KV memory.")
        self.handoffs = m.counter(
            "handoffs", "Prefill role: requests handed over after their first token; outcome: stored (the prompt's "
            "pages are in the kvstore) or timeout (--handoff-wait-s passed, or the worker was lost).", ("outcome",),
        )  # fmt: skip
        self.handoff_seconds = m.histogram(
            "handoff_seconds", "Prefill role: from a request's first token to its hand-over (its pages in the kvstore)."
        )
        self.evicted_slots = m.counter("evicted_slots", "KV slots evicted from the prefix cache.")
        self.step_seconds = m.histogram("step_seconds", "Wall time of one step as seen by the scheduler.")
        self.queue_seconds = m.histogram(
            "queue_seconds", "Time from a request's arrival to its first admission.", buckets=REQUEST_BUCKETS_S
        )
        self.worker_forward_seconds = m.histogram(
            "worker_forward_seconds", "Forward time reported by the worker."
        )
        # Hybrid models only: the Mamba state pool and what the Mamba radix cache does with it.
        self.mamba_slots = m.gauge("mamba_slots", "Mamba state slots by owner.", ["owner"])
        self.mamba_events = m.counter(
            "mamba_events", "Mamba state operations: cow_copy, fork, fork_inserted, fork_skipped, "
            "donated, evicted.", ["event"],
        )
        # Workers with a host pool: the hierarchical cache.
        self.host_pages = m.gauge("host_pages", "Host (L2) pool pages by state.", ["state"])
        self.hicache_events = m.counter(
            "hicache_events", "Hierarchical cache transfers: load_tokens (host to device at admission), "
            "backup_pages, put_pages, prefetch_pages (asked of L3), prefetched_pages (arrived), failed_jobs.",
            ["event"],
        )
        # Speculative decoding.
        self.spec_events = m.counter(
            "spec_events", "Speculative decoding: verify_steps (request-steps with drafts), draft_tokens "
            "(sent), accepted_tokens (kept by the worker), windows_on / windows_off (the pacer's measured "
            "windows of decode steps with drafting on / off).", ["event"],
        )
        self.spec_draft_seconds = m.counter("spec_draft_seconds", "Time spent drafting.")
        self._last_spec: dict[str, int] = {}
        self._last_draft_s = 0.0
        self._last_hi: dict[str, int] = {}
        self._last_mamba: dict[str, int] = {}
        self._last = (0, 0, 0, 0)  # cached tokens, retractions, evicted, prompt tokens already counted
        self._last_log = time.monotonic()
        self._tokens_since_log = 0

    def observe(self, batcher: Batcher, plan: Plan, result: StepResult, step_s: float) -> None:
        u = batcher.mem.usage()
        self.running.set(len(batcher.running))
        self.waiting.set(len(batcher.waiting))
        self.token_usage.set(u.used_by_requests / max(u.size, 1))
        self.cache_slots.labels("evictable").set(u.evictable)
        self.cache_slots.labels("protected").set(u.protected)
        cached, retracted, evicted, prompt = self._last
        self.cache_hit_tokens.labels("device").inc(batcher.cached_tokens - cached)
        self.retractions.inc(batcher.retractions - retracted)
        self.evicted_slots.inc(batcher.mem.evicted - evicted)
        self.prompt_tokens.inc(batcher.prompt_tokens - prompt)
        self._last = (batcher.cached_tokens, batcher.retractions, batcher.mem.evicted, batcher.prompt_tokens)
        stats = batcher.mem.stats()
        for owner, n in stats.get("state_slots", {}).items():
            self.mamba_slots.labels(owner).set(n)
        for state, n in stats.get("host_pages", {}).items():
            self.host_pages.labels(state).set(n)
        self._last_mamba = self._count(self.mamba_events, stats.get("state_events", {}), self._last_mamba)
        self._last_hi = self._count(self.hicache_events, stats.get("host_events", {}), self._last_hi)
        if batcher.spec is not None:
            c = batcher.spec.counters
            sums = {
                "verify_steps": c.verify_steps, "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens,
            }
            if (pacer := batcher.spec.pacer) is not None:
                sums |= {"windows_on": pacer.counters.windows_on, "windows_off": pacer.counters.windows_off}
            self._last_spec = self._count(self.spec_events, sums, self._last_spec)
            self.spec_draft_seconds.inc(c.draft_s - self._last_draft_s)
            self._last_draft_s = c.draft_s
        for waited, stored in batcher.handed_over:
            self.handoffs.labels("stored" if stored else "timeout").inc()
            self.handoff_seconds.observe(waited)
        batcher.handed_over.clear()
        self.generated_tokens.inc(len(result.outputs))
        self.step_seconds.observe(step_s)
        self.worker_forward_seconds.observe(result.forward_s)
        self._tokens_since_log += len(result.outputs)
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            rate = self._tokens_since_log / (now - self._last_log)
            hit = batcher.cached_tokens / max(batcher.prompt_tokens, 1)
            log.info(
                "running=%d waiting=%d token_usage=%.2f cache_hit=%.1f%% gen_throughput=%.1f tok/s "
                "retractions=%d evicted_slots=%d",
                len(batcher.running), len(batcher.waiting), u.used_by_requests / max(u.size, 1),
                100 * hit, rate, batcher.retractions, batcher.mem.evicted,
            )  # fmt: skip
            self._last_log, self._tokens_since_log = now, 0

    @staticmethod
    def _count(counter: Counter, now: dict[str, int], last: dict[str, int]) -> dict[str, int]:
        """Add what each event's running total grew by since ``last``; returns ``now``."""
        for event, n in now.items():
            counter.labels(event).inc(n - last.get(event, 0))
        return now

    def reset(self) -> None:
        """A new batcher (worker re-attached) starts its counters from zero."""
        self._last = (0, 0, 0, 0)
        self._last_mamba = {}
        self._last_hi = {}
        self._last_spec = {}
        self._last_draft_s = 0.0
