"""Elastic pools in the loop: demand → orchestrator → allocator limits → ``PoolResize`` ops.

Once per plan, before anything is scheduled, ``ElasticControl.before_plan`` takes a ``Demand``
snapshot (slots held by requests or locked in the cache, what each waiting request that has a
free row to be admitted into needs, how long the loop has been idle) and asks the
``Orchestrator`` for target capacities. Then, per pool:

- **grow**: the allocator's limit moves up at once and the step being planned carries
  ``PoolResize`` as its first op (the worker validates later ops and inputs against the new
  capacity, so this very plan may hand out the new slots);
- **shrink**: lazy. The allocator stops handing out slots at or above the target at once; cached
  (evictable) entries are evicted until no slot up there is held (running requests' slots free
  themselves as they finish); only then is ``PoolResize`` sent and the memory given back.

A grow is deferred while a shrink of the other pool is still draining if sending it would put the
worker over the budget. With a ``BudgetLedger`` (one budget shared by several workers' schedulers
through etcd) the budget is what the ledger has granted this worker, and the ledger hears what
this worker holds and needs at every plan. The orchestrator hears about a capacity only when it is sent
(``applied``); steps are ordered, so the worker has it before any later step uses it. The first
plan after attaching always sends the starting capacities, so a worker whose pools were resized
by an earlier scheduler (or before a failed step) is brought back in line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from services.common.step import PoolResize, WorkerInfo
from services.scheduler.budget_ledger import BudgetLedger
from services.scheduler.memory import Memory
from services.scheduler.orchestrator import Demand, Need, Orchestrator, ResizePlan
from services.scheduler.request import Req

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ElasticConfig:
    budget_bytes: int  # KV + Mamba pool bytes this worker may hold
    min_kv_slots: int = 0  # 0 = the longest request the worker accepts (its context length)
    min_mamba_slots: int = 1  # one running request at a time can always progress
    idle_s: float = 5.0  # give memory back after this long without work
    headroom: float = 0.25


class ElasticControl:
    def __init__(
        self, cfg: ElasticConfig, info: WorkerInfo, mem: Memory, ledger: BudgetLedger | None = None
    ) -> None:
        """``ledger``: a budget shared with other workers' schedulers; ``cfg.budget_bytes`` is then
        its total, and this worker may commit only what the ledger has granted it."""
        if not info.elastic:
            log.warning("worker pools are fixed allocations: resizes are bookkeeping only")
        self.info, self.mem = info, mem
        m_bytes = info.bytes_per_mamba_slot if info.hybrid else 1
        min_kv = cfg.min_kv_slots or min(info.context_length, info.max_slots)
        min_m = max(1, cfg.min_mamba_slots) if info.hybrid else 0
        unit = info.slot_granularity
        self.orch = Orchestrator(
            cfg.budget_bytes, info.bytes_per_slot, m_bytes, min(min_kv, info.max_slots), min_m,
            info.pool_page_bytes, kv_slot_multiple=unit, mamba_slot_multiple=max(1, info.mamba_slot_granularity),
            idle_s=cfg.idle_s, headroom=cfg.headroom, max_kv_slots=info.max_slots,
            max_mamba_slots=max(min_m, info.max_mamba_slots) if info.hybrid else None,
        )
        start = ResizePlan(self._kv_start(min_kv), min_m)
        self.orch.applied(start)
        self.sent = start  # what the worker has (or will have once the steps sent so far ran)
        self._target = start
        self._limits = ResizePlan(-1, -1)
        self._set_limits()
        self._pending_op: PoolResize | None = PoolResize(start.kv_slots, start.mamba_slots)
        self._last_busy = time.monotonic()
        self.resizes = 0
        self.ledger = ledger

    def _kv_start(self, min_kv: int) -> int:
        unit = self.orch.units.kv_slots
        kv = -(-min_kv // unit) * unit
        return min(kv, self.info.max_slots)

    # -- per plan -------------------------------------------------------------------------------
    def demand(self, waiting: list[Req], busy: bool) -> Demand:
        now = time.monotonic()
        if busy:
            self._last_busy = now
        # Live = held by requests or locked in the cache: a count, not a high-water mark. Cached
        # but unlocked entries are not live (a shrink evicts them), and held slots above a shrink
        # target are waited for (the shrink is lazy), so a target may lie below a held slot.
        kv_live, m_live = self.mem.live()
        # Only the requests that find a free row can be admitted now; the others wait for running
        # requests to finish and then reuse the slots and states those free. Counting them would
        # ask for memory no request can use (and, over the budget, squeeze the other pool for it).
        # A request needs its whole length (prompt and every new token) and one working state.
        admissible = waiting[: self.mem.rows_free]
        state = 1 if self.info.hybrid else 0
        queue = [Need(len(r.prompt) + r.gen.max_new_tokens, state) for r in admissible]
        return Demand.of_queue(
            kv_live=min(kv_live, self.sent.kv_slots),
            mamba_live=min(m_live, self.sent.mamba_slots),
            queue=queue,
            idle_for_s=0.0 if busy else now - self._last_busy,
        )

    def before_plan(self, waiting: list[Req], busy: bool) -> list[PoolResize]:
        """Adjust the allocators to the orchestrator's target; the ops to put first in the step."""
        d = self.demand(waiting, busy)
        if self.ledger is not None:
            self._share(d)
        plan = self.orch.propose(d)
        if plan is not None:
            self._target = ResizePlan(min(plan.kv_slots, self.info.max_slots),
                                      min(plan.mamba_slots, self.info.max_mamba_slots))
        self._set_limits()
        self.mem.drain()
        send = self._sendable()
        if send != self.sent:
            self.sent = send
            self.orch.applied(send)
            self._pending_op = PoolResize(send.kv_slots, send.mamba_slots)
            self.resizes += 1
            self._set_limits()
            if self.ledger is not None:
                self.ledger.update_held(self.orch.bytes_of(send))
        op, self._pending_op = self._pending_op, None
        return [op] if op is not None else []

    def _share(self, d: Demand) -> None:
        """Report to the shared budget and take what it has granted as this worker's budget."""
        o, ledger = self.orch, self.ledger
        assert ledger is not None
        ledger.report(held=o.bytes_of(self.sent), floor=o.bytes_of(o.floor(d)), want=o.bytes_of(o.want(d)),
                      min_bytes=o.min_bytes, busy=not o.is_idle(d))
        o.set_budget(max(o.min_bytes, ledger.granted))

    def _set_limits(self) -> None:
        """Allocator limits: a shrink applies at once (lazily), a grow only once it is sent."""
        t, sent = self._target, self.sent
        limits = ResizePlan(min(t.kv_slots, sent.kv_slots), min(t.mamba_slots, sent.mamba_slots))
        if limits == self._limits:
            return
        self._limits = limits
        self.mem.set_limits(limits.kv_slots, limits.mamba_slots)

    def _sendable(self) -> ResizePlan:
        """Per pool: the target when it grows or its shrink has drained, else what the worker has;
        a grow waits if it would put the worker over budget beside a shrink still draining."""
        t, cur = self._target, self.sent
        kv_done, m_done = self.mem.shrink_done()
        kv_ready = t.kv_slots >= cur.kv_slots or kv_done
        m_ready = t.mamba_slots >= cur.mamba_slots or m_done
        plan = ResizePlan(t.kv_slots if kv_ready else cur.kv_slots, t.mamba_slots if m_ready else cur.mamba_slots)
        if self.orch.bytes_of(plan) > self.orch.budget_bytes:
            plan = ResizePlan(min(plan.kv_slots, cur.kv_slots), min(plan.mamba_slots, cur.mamba_slots))
        return plan
