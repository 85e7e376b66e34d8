"""The elastic-memory orchestrator: budget, live usage, idle give-back, phase changes, sharing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.orchestrator import Demand, Orchestrator, ResizePlan, SharedBudget

PAGE = 4096
KV_SLOT = 1024      # 4 slots per page
MAMBA_SLOT = 65536  # 16 pages per slot
MIB = 1 << 20


def make(budget: int = 64 * MIB, idle_s: float = 10.0, **kw: object) -> Orchestrator:
    return Orchestrator(budget, KV_SLOT, MAMBA_SLOT, min_kv_slots=64, min_mamba_slots=2, page_bytes=PAGE,
                        idle_s=idle_s, **kw)  # type: ignore[arg-type]


def busy(kv: int = 0, kv_wait: int = 0, m: int = 0, m_wait: int = 0) -> Demand:
    return Demand(kv, kv_wait, m, m_wait, idle_for_s=0.0)


def step(o: Orchestrator, d: Demand) -> ResizePlan:
    plan = o.propose(d)
    if plan is not None:
        o.applied(plan)
    return o.current


def test_units_are_whole_pages() -> None:
    o = Orchestrator(10 * MIB, 3000, 5000, 1, 1, PAGE, kv_slot_multiple=16)
    kv_unit, m_unit = o.units.kv_slots, o.units.mamba_slots
    assert kv_unit * 3000 % PAGE == 0 and kv_unit % 16 == 0
    assert m_unit * 5000 % PAGE == 0
    plan = step(o, busy(kv_wait=1000, m_wait=7))
    assert plan.kv_slots % kv_unit == 0 and plan.mamba_slots % m_unit == 0


def test_grows_to_demand_with_headroom_and_then_holds() -> None:
    o = make()
    plan = step(o, busy(kv=50, kv_wait=950, m_wait=4))
    assert plan.kv_slots >= 1250 and plan.mamba_slots >= 5
    # The same or smaller demand while busy changes nothing: no plan, no thrash.
    assert o.propose(busy(kv=800, kv_wait=200, m=4)) is None  # now live
    assert o.propose(busy(kv=100, m=1)) is None


def test_growth_plans_are_geometric_not_per_request() -> None:
    o = make(budget=512 * MIB)
    plans = 0
    for need in range(0, 20_000, 16):
        d = busy(kv=min(need, o.current.kv_slots), kv_wait=max(0, need - o.current.kv_slots), m=2)
        plan = o.propose(d)
        if plan is not None:
            o.applied(plan)
            plans += 1
    assert o.current.kv_slots >= 20_000 - 16
    assert plans <= 30  # ≈ log_1.25(20000 / 64) = 26 headroom steps, not one plan per 16 slots (1250)


def test_budget_caps_growth() -> None:
    o = make(budget=8 * MIB)
    plan = step(o, busy(kv_wait=1_000_000, m=1))
    assert o.bytes_of(plan) <= 8 * MIB
    assert plan.mamba_slots >= 2 and plan.kv_slots > 64


def test_idle_gives_memory_back_only_after_idle_s() -> None:
    o = make(idle_s=10.0)
    big = step(o, busy(kv_wait=20_000, m_wait=60))
    assert o.propose(Demand(100, 0, 1, 0, idle_for_s=9.9)) is None  # not idle yet: keep
    small = step(o, Demand(100, 0, 1, 0, idle_for_s=10.0))
    assert small.kv_slots < big.kv_slots and small.mamba_slots < big.mamba_slots
    assert small.kv_slots >= 125 and small.mamba_slots >= 2  # working set + headroom, minimums
    assert o.bytes_of(small) < o.bytes_of(big) // 10
    assert o.propose(Demand(0, 0, 0, 0, idle_for_s=100.0)) == ResizePlan(64, 2)


def test_phase_change_moves_capacity_from_kv_to_mamba() -> None:
    o = make(budget=32 * MIB)
    kv_heavy = step(o, busy(kv_wait=200_000, m_wait=4))
    assert o.bytes_of(kv_heavy) > 30 * MIB  # KV took nearly everything
    # Mamba-heavy phase: long-running hybrid requests need many states, KV use fell.
    mamba_heavy = step(o, busy(kv=2_000, m=2, m_wait=400))
    assert mamba_heavy.mamba_slots > 4 * kv_heavy.mamba_slots
    assert mamba_heavy.kv_slots < kv_heavy.kv_slots
    assert mamba_heavy.kv_slots >= 2_000  # live KV never cut
    assert o.bytes_of(mamba_heavy) <= 32 * MIB
    # And back: KV demand returns, Mamba live holds 150 states that must not be cut.
    back = step(o, busy(kv=1_000, kv_wait=100_000, m=150))
    assert back.mamba_slots >= 150 and back.kv_slots > mamba_heavy.kv_slots
    assert o.bytes_of(back) <= 32 * MIB


def test_mamba_never_below_running_requests_even_when_kv_starves() -> None:
    o = make(budget=16 * MIB)
    step(o, busy(kv=50, kv_wait=450, m_wait=200))
    plan = step(o, busy(kv=500, kv_wait=10_000_000, m=200))
    assert plan.mamba_slots >= 200
    assert o.bytes_of(plan) <= 16 * MIB


def test_lowered_budget_never_cuts_live_slots() -> None:
    o = make(budget=64 * MIB)
    step(o, busy(kv_wait=40_000, m_wait=100))
    o.set_budget(8 * MIB)
    plan = step(o, busy(kv=40_000, m=100))
    assert plan.kv_slots >= 40_000 and plan.mamba_slots >= 100  # floors win over a lowered budget
    assert o.bytes_of(plan) <= o.bytes_of(o.floor(busy(kv=40_000, m=100)))


def test_rejects_impossible_configurations() -> None:
    with pytest.raises(ValueError, match="cannot hold the minimum"):
        Orchestrator(1000, KV_SLOT, MAMBA_SLOT, 64, 2, PAGE)
    with pytest.raises(ValueError, match="whole units"):
        make(initial=ResizePlan(65, 2))
    with pytest.raises(ValueError, match="kv_live"):
        Demand(-1, 0, 0, 0, 0.0)


@settings(max_examples=150, deadline=None)
@given(
    budget_pages=st.integers(min_value=40, max_value=4000),
    kv_slot=st.sampled_from([256, 1000, 3072, 4096, 12288]),
    m_slot=st.sampled_from([4096, 10_000, 65536, 200_000]),
    steps=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 50_000), st.floats(0, 1),
                             st.integers(0, 500), st.sampled_from([0.0, 5.0, 60.0])), max_size=25),
)
def test_budget_and_live_usage_invariants(
    budget_pages: int, kv_slot: int, m_slot: int, steps: list[tuple[float, int, float, int, float]]
) -> None:
    o = Orchestrator(1 << 40, kv_slot, m_slot, min_kv_slots=8, min_mamba_slots=2, page_bytes=PAGE, idle_s=30.0)
    budget = o.min_bytes + budget_pages * PAGE  # units may be large (10 000-byte slots: 256 per unit)
    o.set_budget(budget)
    for kv_frac, kv_wait, m_frac, m_wait, idle in steps:
        cur = o.current
        # Live usage can only be what the applied capacity holds.
        d = Demand(int(cur.kv_slots * kv_frac), kv_wait, int(cur.mamba_slots * m_frac), m_wait, idle)
        plan = o.propose(d)
        if plan is None:
            continue
        assert plan != cur
        assert o.bytes_of(plan) <= budget
        assert plan.kv_slots >= d.kv_live and plan.mamba_slots >= d.mamba_live
        assert plan.kv_slots % o.units.kv_slots == 0 and plan.mamba_slots % o.units.mamba_slots == 0
        assert (plan.kv_slots * kv_slot) % PAGE == 0 and (plan.mamba_slots * m_slot) % PAGE == 0
        o.applied(plan)
        assert o.propose(d) is None  # stable: the same demand never asks for another change


def test_shared_budget_follows_demand_between_two_workers() -> None:
    total = 64 * MIB
    a, b = make(budget=total), make(budget=total)
    shared = SharedBudget(total, [a, b])

    def run(da: Demand, db: Demand, rounds: int = 3) -> None:
        for _ in range(rounds):  # a shrink acknowledged in one round frees bytes for the next
            shared.split([da, db])
            for o, d in ((a, da), (b, db)):
                step(o, d)
                assert a.bytes_of(a.current) + b.bytes_of(b.current) <= total

    # A busy, B idle: A grows into nearly the whole budget.
    run(busy(kv_wait=500_000, m_wait=10), Demand(0, 0, 0, 0, idle_for_s=100.0))
    a_busy = a.bytes_of(a.current)
    assert a_busy > 0.9 * total
    assert b.current == ResizePlan(64, 2)
    # Roles swap: A goes idle and gives back, B grows into what A released.
    run(Demand(100, 0, 1, 0, idle_for_s=100.0), busy(kv_wait=500_000, m_wait=10))
    assert a.bytes_of(a.current) < 0.05 * total
    assert b.bytes_of(b.current) > 0.9 * total
    # Both busy: each gets a real share, neither is starved.
    run(busy(kv_wait=500_000, m_wait=10), busy(kv_wait=500_000, m_wait=10), rounds=6)
    assert a.bytes_of(a.current) > 0.2 * total and b.bytes_of(b.current) > 0.2 * total


def test_shared_budget_never_grants_bytes_another_worker_still_holds() -> None:
    total = 32 * MIB
    a, b = make(budget=total), make(budget=total)
    shared = SharedBudget(total, [a, b])
    shared.split([busy(kv_wait=1_000_000), Demand(0, 0, 0, 0, 100.0)])
    step(a, busy(kv_wait=1_000_000))
    held_a = a.bytes_of(a.current)
    # B becomes busy, but A has not released anything yet: B may only use what is free now.
    budgets = shared.split([busy(kv_wait=1_000_000), busy(kv_wait=1_000_000)])
    assert budgets[1] <= total - held_a
