"""Elastic capacity of a worker's KV pool and Mamba pool under one memory budget (pure Python).

The scheduler feeds ``Demand`` snapshots; the orchestrator proposes ``ResizePlan``s; the
scheduler drains the tails that a plan releases and sends it to the worker as a ``PoolResize``
step operation; when the worker acknowledges, the scheduler calls ``applied(plan)``.

Policy, in units of whole pages (a *unit* is the smallest slot count whose bytes are whole
pages, so every target commits and releases whole pages only), every capacity at most the
pool's reservation:

* floor  = max(minimum, live slots)         — never cut what running requests hold
* need   = max(floor, live + waiting)       — ``waiting`` counts only requests that could be
                                              admitted now (the caller caps it at the free rows)
* want   = max(floor, need * (1 + headroom))
* busy   : target = current while it serves the need, else want — sticky: capacity is kept
           while work flows and grows in headroom-sized steps (no thrash)
* idle   : target = want                    — after ``idle_s`` without work, give memory back
* over budget: cut slack above ``want`` first. If the wants still do not fit, the pools are
  *squeezed*: with the queue known (``Demand.queue``), admit the longest prefix of the queue whose
  KV slots *and* Mamba states fit together (a request needs both: bytes given to one pool for
  requests the other cannot hold are wasted), then spread what is left towards the wants;
  without it, split what is left above the floors in proportion to each pool's unmet want.
  Floors are never cut. While busy, squeezed capacities are kept as long as they serve what a
  new target would (the live slots, the same queue prefix, and the live KV's headroom — or as
  much of it as the target gives): a request finishing or a few decoded tokens do not move
  memory back and forth between the pools.
* a plan is proposed only when a target differs from the applied capacity (≥ one unit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Need(NamedTuple):
    """What one waiting request needs to be admitted and run to its end: KV slots and Mamba states."""

    kv: int
    mamba: int


@dataclass(frozen=True, slots=True)
class Demand:
    """One snapshot of what a worker's requests need (slot counts, seconds).

    ``*_live`` is what cannot be released now: slots held by running requests or locked cache
    nodes. Evictable cache is not live. ``*_waiting`` is what queued requests need to be
    admitted: only those that could be admitted now (a request that finds no free row waits for
    a running one to finish, and then takes over the memory that one frees). ``queue``, when
    given, is the same demand request by request in admission order (``*_waiting`` are its sums);
    it lets a squeezed budget go to whole requests (see ``Demand.of_queue``). ``idle_for_s`` is
    the time since the last batch ran.
    """

    kv_live: int
    kv_waiting: int
    mamba_live: int
    mamba_waiting: int
    idle_for_s: float
    queue: tuple[Need, ...] = ()

    def __post_init__(self) -> None:
        for name in ("kv_live", "kv_waiting", "mamba_live", "mamba_waiting"):
            if getattr(self, name) < 0:
                raise ValueError(f"Demand.{name} must be >= 0, got {getattr(self, name)}")
        if self.idle_for_s < 0:
            raise ValueError(f"Demand.idle_for_s must be >= 0, got {self.idle_for_s}")
        if self.queue:
            if any(n.kv < 0 or n.mamba < 0 for n in self.queue):
                raise ValueError(f"Demand.queue needs must be >= 0, got {self.queue}")
            kv, m = sum(n.kv for n in self.queue), sum(n.mamba for n in self.queue)
            if (kv, m) != (self.kv_waiting, self.mamba_waiting):
                raise ValueError(f"Demand.queue sums to KV {kv}, Mamba {m}, but kv_waiting={self.kv_waiting}, "
                                 f"mamba_waiting={self.mamba_waiting}")

    @classmethod
    def of_queue(cls, kv_live: int, mamba_live: int, queue: Sequence[Need], idle_for_s: float) -> Demand:
        """A demand whose waiting part is ``queue`` (admissible requests, in admission order)."""
        q = tuple(Need(*n) for n in queue)
        return cls(kv_live, sum(n.kv for n in q), mamba_live, sum(n.mamba for n in q), idle_for_s, q)


@dataclass(frozen=True, slots=True)
class ResizePlan:
    """Target capacities in slots; the worker applies shrinks before grows."""

    kv_slots: int
    mamba_slots: int


class Orchestrator:
    """Decides KV and Mamba pool capacities of one worker. Mutated only by ``set_budget`` and ``applied``."""

    __slots__ = ("_budget", "_current", "_headroom", "_idle_s", "_kv_bytes", "_kv_unit", "_m_bytes",
                 "_m_unit", "_max_kv", "_max_m", "_min_kv", "_min_m", "page_bytes")

    def __init__(
        self,
        total_budget_bytes: int,
        kv_bytes_per_slot: int,
        mamba_bytes_per_slot: int,
        min_kv_slots: int,
        min_mamba_slots: int,
        page_bytes: int,
        *,
        kv_slot_multiple: int = 1,
        mamba_slot_multiple: int = 1,
        idle_s: float = 30.0,
        headroom: float = 0.25,
        initial: ResizePlan | None = None,
        max_kv_slots: int | None = None,
        max_mamba_slots: int | None = None,
    ) -> None:
        """``*_slot_multiple`` adds alignment a unit must also respect (the scheduler's KV page
        size, ``ElasticPoolLayout.slot_granularity``). ``initial`` is the capacity the worker
        starts with (default: the minimums); it must fit the budget. ``max_*_slots`` are the
        pools' reservations (None: unbounded): no target exceeds them (rounded down to whole units
        that hold the minimums), so bytes a pool could never map are neither counted in its want
        nor taken from the other pool."""
        for name, value in (("kv_bytes_per_slot", kv_bytes_per_slot), ("mamba_bytes_per_slot", mamba_bytes_per_slot),
                            ("page_bytes", page_bytes), ("kv_slot_multiple", kv_slot_multiple),
                            ("mamba_slot_multiple", mamba_slot_multiple)):
            if value < 1:
                raise ValueError(f"Orchestrator.{name} must be >= 1, got {value}")
        if min_kv_slots < 0 or min_mamba_slots < 0:
            raise ValueError(f"minimum slots must be >= 0, got kv={min_kv_slots} mamba={min_mamba_slots}")
        if idle_s < 0 or headroom < 0:
            raise ValueError(f"idle_s and headroom must be >= 0, got {idle_s}, {headroom}")
        self.page_bytes = page_bytes
        self._kv_bytes, self._m_bytes = kv_bytes_per_slot, mamba_bytes_per_slot
        self._kv_unit = math.lcm(page_bytes // math.gcd(page_bytes, kv_bytes_per_slot), kv_slot_multiple)
        self._m_unit = math.lcm(page_bytes // math.gcd(page_bytes, mamba_bytes_per_slot), mamba_slot_multiple)
        self._min_kv = _round_up(min_kv_slots, self._kv_unit)
        self._min_m = _round_up(min_mamba_slots, self._m_unit)
        if (max_kv_slots is not None and max_kv_slots < min_kv_slots) or (
                max_mamba_slots is not None and max_mamba_slots < min_mamba_slots):
            raise ValueError(f"reservations (KV {max_kv_slots}, Mamba {max_mamba_slots} slots) must hold the "
                             f"minimums ({min_kv_slots}, {min_mamba_slots})")
        # In whole units, but never below the (rounded-up) minimums.
        self._max_kv = max(self._min_kv, _round_down(_UNBOUNDED if max_kv_slots is None else max_kv_slots,
                                                     self._kv_unit))
        self._max_m = max(self._min_m, _round_down(_UNBOUNDED if max_mamba_slots is None else max_mamba_slots,
                                                   self._m_unit))
        self._idle_s, self._headroom = idle_s, headroom
        self._budget = 0
        self.set_budget(total_budget_bytes)
        self._current = initial or ResizePlan(self._min_kv, self._min_m)
        cur = self._current
        if (cur.kv_slots % self._kv_unit or cur.mamba_slots % self._m_unit
                or cur.kv_slots < self._min_kv or cur.mamba_slots < self._min_m
                or cur.kv_slots > self._max_kv or cur.mamba_slots > self._max_m):
            raise ValueError(f"initial capacity {cur} must be whole units (KV {self._kv_unit}, Mamba "
                             f"{self._m_unit} slots), at least the minimums ({self._min_kv}, {self._min_m}) "
                             f"and at most the reservations")
        if self.bytes_of(cur) > total_budget_bytes:
            raise ValueError(f"initial capacity {cur} needs {self.bytes_of(cur)} bytes, "
                             f"over the budget of {total_budget_bytes}")

    # -- state ------------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def current(self) -> ResizePlan:
        """Capacities the worker has acknowledged."""
        return self._current

    @property
    def units(self) -> ResizePlan:
        """Slots per unit of each pool: every target is a multiple of these."""
        return ResizePlan(self._kv_unit, self._m_unit)

    @property
    def min_bytes(self) -> int:
        return self.bytes_of(ResizePlan(self._min_kv, self._min_m))

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget (to a shared budget's grant, ``budget_ledger``); it must hold the minimum capacities."""
        need = self._min_kv * self._kv_bytes + self._min_m * self._m_bytes
        if budget_bytes < need:
            raise ValueError(f"budget of {budget_bytes} bytes cannot hold the minimum capacities "
                             f"({self._min_kv} KV + {self._min_m} Mamba slots = {need} bytes)")
        self._budget = budget_bytes

    def applied(self, plan: ResizePlan) -> None:
        """Record that the worker now runs with ``plan``'s capacities."""
        self._current = plan

    def bytes_of(self, plan: ResizePlan) -> int:
        return plan.kv_slots * self._kv_bytes + plan.mamba_slots * self._m_bytes

    # -- policy -----------------------------------------------------------------------------
    def floor(self, d: Demand) -> ResizePlan:
        """Capacities below which live slots would be cut.

        Raises ``ValueError`` when live usage exceeds the applied capacity: slots that do not
        exist cannot be held, so the caller's bookkeeping is off.
        """
        cur = self._current
        if d.kv_live > cur.kv_slots or d.mamba_live > cur.mamba_slots:
            raise ValueError(f"live usage (KV {d.kv_live}, Mamba {d.mamba_live}) exceeds the applied capacity "
                             f"(KV {cur.kv_slots}, Mamba {cur.mamba_slots})")
        return ResizePlan(max(self._min_kv, _round_up(d.kv_live, self._kv_unit)),
                          max(self._min_m, _round_up(d.mamba_live, self._m_unit)))

    def need(self, d: Demand) -> ResizePlan:
        """Capacities that hold the live slots and the whole waiting demand, without headroom."""
        return self._fit(self.floor(d), d.kv_live + d.kv_waiting, d.mamba_live + d.mamba_waiting)

    def want(self, d: Demand) -> ResizePlan:
        """Capacities that serve the demand with headroom (ignores the budget)."""
        grow = 1.0 + self._headroom
        return self._fit(self.floor(d), math.ceil((d.kv_live + d.kv_waiting) * grow),
                         math.ceil((d.mamba_live + d.mamba_waiting) * grow))

    def _fit(self, f: ResizePlan, kv: int, m: int) -> ResizePlan:
        """``kv`` / ``m`` slots in whole units, at least the floors, at most the reservations."""
        return ResizePlan(max(f.kv_slots, min(self._max_kv, _round_up(kv, self._kv_unit))),
                          max(f.mamba_slots, min(self._max_m, _round_up(m, self._m_unit))))

    def is_idle(self, d: Demand) -> bool:
        return d.idle_for_s >= self._idle_s

    def target(self, d: Demand) -> ResizePlan:
        """The capacities this demand calls for under the current budget (see module docstring)."""
        f, n, w, cur = self.floor(d), self.need(d), self.want(d), self._current
        if self.is_idle(d):
            t = w
        else:
            # Grow only when the capacity cannot serve the need, and then with headroom, so plans
            # come geometrically spaced rather than one per arriving request.
            t = ResizePlan(cur.kv_slots if n.kv_slots <= cur.kv_slots else max(cur.kv_slots, w.kv_slots),
                           cur.mamba_slots if n.mamba_slots <= cur.mamba_slots else max(cur.mamba_slots, w.mamba_slots))
        over = self.bytes_of(t) - self._budget
        if over <= 0:
            return t
        # 1. Take back sticky slack above the wants, larger slack first.
        # (A busy pool may sit below its want: it serves its need without the headroom; no slack.)
        kv_slack = max(0, t.kv_slots - w.kv_slots) * self._kv_bytes
        m_slack = max(0, t.mamba_slots - w.mamba_slots) * self._m_bytes
        kv, m = t.kv_slots, t.mamba_slots
        for pool in (("kv", "m") if kv_slack >= m_slack else ("m", "kv")):
            if over <= 0:
                break
            if pool == "kv":
                cut = min(_round_up(over, self._kv_unit * self._kv_bytes), kv_slack) // self._kv_bytes
                kv -= cut
                over -= cut * self._kv_bytes
            else:
                cut = min(_round_up(over, self._m_unit * self._m_bytes), m_slack) // self._m_bytes
                m -= cut
                over -= cut * self._m_bytes
        if over <= 0:
            return ResizePlan(kv, m)
        # 2. Even the wants do not fit: squeeze.
        if self.bytes_of(f) >= self._budget:
            return f  # the budget was lowered under live usage: release everything but the floors
        if d.queue or not (d.kv_waiting or d.mamba_waiting):
            return self._squeeze(d, w)
        return self._spread(f, w)  # waiting demand known only in aggregate: split by unmet want

    def _squeeze(self, d: Demand, w: ResizePlan) -> ResizePlan:
        """Wants over the budget, queue known: live slots and the longest queue prefix that fits,
        the rest spread towards the wants; while busy, the current capacities are kept if they
        serve as much (same prefix, and the live KV keeps its headroom or what the target gives)."""
        base = self._base(d, self._served(d, self._budget))
        t = self._spread(base, w)
        cur = self._current
        live_kv = min(t.kv_slots, _round_up(math.ceil(d.kv_live * (1.0 + self._headroom)), self._kv_unit))
        if (not self.is_idle(d) and self.bytes_of(cur) <= self._budget and cur.mamba_slots >= base.mamba_slots
                and cur.kv_slots >= max(base.kv_slots, live_kv)):
            return cur
        return t

    def _base(self, d: Demand, k: int) -> ResizePlan:
        """Capacities that hold the live slots and the first ``k`` queued requests."""
        q = d.queue[:k]
        return self._fit(self.floor(d), d.kv_live + sum(n.kv for n in q), d.mamba_live + sum(n.mamba for n in q))

    def _served(self, d: Demand, budget: int) -> int:
        """How many queued requests (a prefix, in admission order) fit ``budget`` with the live slots."""
        f, kv, m = self.floor(d), d.kv_live, d.mamba_live
        for k, n in enumerate(d.queue):
            kv, m = kv + n.kv, m + n.mamba
            if self.bytes_of(self._fit(f, kv, m)) > budget:
                return k
        return len(d.queue)

    def _spread(self, base: ResizePlan, w: ResizePlan) -> ResizePlan:
        """``base`` (which fits the budget) plus what is left of the budget, in proportion to each
        pool's want above ``base``, in whole units."""
        spare = self._budget - self.bytes_of(base)
        kv_extra = max(0, w.kv_slots - base.kv_slots) * self._kv_bytes
        m_extra = max(0, w.mamba_slots - base.mamba_slots) * self._m_bytes
        if spare <= 0 or kv_extra + m_extra == 0:
            return base
        kv_give = _round_down(min(kv_extra, spare * kv_extra // (kv_extra + m_extra)), self._kv_unit * self._kv_bytes)
        m_give = _round_down(min(spare - kv_give, m_extra), self._m_unit * self._m_bytes)
        # Rounding may leave a unit of KV unspent that Mamba could not use: give it back to KV.
        kv_give = min(_round_down(kv_extra, self._kv_unit * self._kv_bytes),
                      _round_down(spare - m_give, self._kv_unit * self._kv_bytes))
        return ResizePlan(base.kv_slots + kv_give // self._kv_bytes, base.mamba_slots + m_give // self._m_bytes)

    def propose(self, d: Demand) -> ResizePlan | None:
        """A plan when the target differs from the applied capacity, else ``None``. Does not mutate."""
        t = self.target(d)
        return None if t == self._current else t


@dataclass(frozen=True, slots=True)
class Share:
    """One member of a shared budget, in bytes: what it cannot give up (``floor``), what would
    serve its demand (``want``), what it holds now (``held``), its minimum, and whether it is busy."""

    floor: int
    want: int
    held: int
    min_bytes: int
    busy: bool


def split_shares(total: int, shares: Sequence[Share]) -> list[int]:
    """One byte budget of ``total`` split between several workers by demand (``budget_ledger``).

    Each member gets its floor, then its want (or a share of what is left in proportion to its
    unmet want); the spare goes to busy members only, so idle members drift down to their working
    set. A member's budget never exceeds ``total - what the others hold now``: a worker grows only
    into bytes another has already released, so the committed sum never passes ``total``, whatever
    order the workers apply their plans in."""
    floors = [s.floor for s in shares]
    wants = [s.want for s in shares]
    held = [s.held for s in shares]
    spare = total - sum(floors)
    extra = [w - f for w, f in zip(wants, floors, strict=True)]
    if sum(extra) <= spare:
        budgets = list(wants)
        spare -= sum(extra)
        busy = [i for i, s in enumerate(shares) if s.busy]
        weight = sum(wants[i] for i in busy)
        for i in busy:
            budgets[i] += spare * wants[i] // weight if weight else spare // len(busy)
    else:
        total_extra = sum(extra)
        budgets = [f + max(spare, 0) * e // total_extra for f, e in zip(floors, extra, strict=True)]
    others = sum(held)
    return [max(s.min_bytes, min(b, total - (others - h))) for s, b, h in zip(shares, budgets, held, strict=True)]


_UNBOUNDED = 1 << 62  # a reservation left unset: larger than any pool


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _round_down(n: int, m: int) -> int:
    return n // m * m
