"""The elastic-memory orchestrator: budget, live usage, idle give-back, phase changes, sharing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.orchestrator import Demand, Need, Orchestrator, ResizePlan, Share, split_shares

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


# A hybrid worker of the elastic benchmark's shape: 4 KiB KV slots, 840 KiB states, a floor of
# one long request's KV, one state.
BENCH_KV, BENCH_STATE = 4096, 860160


def bench_like(budget: int, **kw: object) -> Orchestrator:
    return Orchestrator(budget, BENCH_KV, BENCH_STATE, min_kv_slots=2064, min_mamba_slots=1, page_bytes=PAGE,
                        kv_slot_multiple=4, idle_s=2.0, **kw)  # type: ignore[arg-type]


def short_queue(n: int) -> list[Need]:
    return [Need(48, 1)] * n  # 32 prompt + 16 new tokens, one state each


def test_wants_stop_at_the_reservations_so_an_unreachable_want_squeezes_nothing() -> None:
    # 64 states reserved; 100 waiting requests want 125 states with headroom.
    o = bench_like(96 * MIB, max_kv_slots=24576, max_mamba_slots=64)
    d = busy(kv_wait=100 * 48, m_wait=100)
    assert o.want(d).mamba_slots == 64
    plan = step(o, d)
    # The KV want (100 requests * 48 slots * 1.25) fits beside 64 states: it is not cut to make
    # room for states the Mamba pool could never map.
    assert plan == ResizePlan(_round4(100 * 48 * 1.25), 64)
    assert o.bytes_of(plan) <= 96 * MIB


def _round4(x: float) -> int:
    return -(-int(x) // 4) * 4


def test_squeezed_budget_goes_to_whole_requests() -> None:
    """24 MiB: the KV floor (one long request) leaves room for 19 states. Short requests need a
    state each and little KV: every byte that can hold a state should, not be split by bytes
    of unmet want (which gave the KV pool bytes no admitted request could use)."""
    budget = 24 * MIB
    o = bench_like(budget, max_kv_slots=24576, max_mamba_slots=128)
    plan = step(o, Demand.of_queue(0, 0, short_queue(64), 0.0))
    kv_floor_bytes = 2064 * BENCH_KV
    most_states = (budget - kv_floor_bytes) // BENCH_STATE  # 19
    assert plan.mamba_slots == most_states
    assert plan.kv_slots >= 2064 and o.bytes_of(plan) <= budget
    # Without the queue (aggregate demand only) the split is by bytes of unmet want: fewer states.
    o2 = bench_like(budget, max_kv_slots=24576, max_mamba_slots=128)
    assert step(o2, busy(kv_wait=64 * 48, m_wait=64)).mamba_slots < most_states


def test_squeezed_long_requests_get_kv_for_whole_requests() -> None:
    """The long phase at 24 MiB: two 2,064-slot requests fit with their states, a third does not."""
    o = bench_like(24 * MIB, max_kv_slots=24576, max_mamba_slots=128)
    plan = step(o, Demand.of_queue(0, 0, [Need(2064, 1)] * 6, 0.0))
    assert plan.kv_slots >= 2 * 2064 and plan.mamba_slots >= 2
    assert o.bytes_of(plan) <= 24 * MIB


def test_busy_squeezed_split_holds_while_requests_come_and_go() -> None:
    """Requests finishing and being replaced, decoded tokens accumulating: as long as the current
    capacities serve what a new split would, nothing moves (the old proportional split resized
    at every change of the live counts: 17 <-> 19 states and back, every wave)."""
    o = bench_like(24 * MIB, max_kv_slots=24576, max_mamba_slots=128)
    step(o, Demand.of_queue(0, 0, short_queue(64), 0.0))
    first = o.current
    plans = 0
    waiting = 128
    for i in range(200):
        running = first.mamba_slots - (2 if i % 17 == 16 else 0)  # two just finished
        kv_live = running * (33 + i % 16)
        waiting = max(0, waiting - (2 if i % 17 == 0 else 0))
        free_rows = 64 - running
        d = Demand.of_queue(kv_live, running, short_queue(min(waiting, free_rows)), 0.0)
        plan = o.propose(d)
        if plan is not None:
            plans += 1
            o.applied(plan)
    assert plans == 0, o.current


def test_busy_squeezed_split_holds_while_running_requests_decode() -> None:
    """Twenty running requests decode while long requests wait that the budget cannot add: what is
    left over beside them is spread by unmet want, a share that drifts as their KV grows. The
    current split serves the same requests, so nothing moves (without the hold, a state went
    from Mamba to KV and back)."""
    o = make(budget=8 * MIB)
    long = [Need(6000, 1)] * 10
    step(o, Demand.of_queue(0, 0, [Need(150, 1)] * 20 + long, 0.0))
    first = o.current
    for i in range(200):
        assert o.propose(Demand.of_queue(20 * (100 + i // 2), 20, long, 0.0)) is None, i
    assert o.current == first


def test_busy_squeezed_split_moves_when_live_kv_outgrows_it() -> None:
    """The hold must not starve running requests: when their KV fills the pool while states sit
    unused, and the request that waits cannot fit anyway, KV grows into those states' bytes."""
    o = bench_like(24 * MIB, max_kv_slots=24576, max_mamba_slots=128)
    cur = step(o, Demand.of_queue(0, 0, short_queue(64), 0.0))  # 19 states, KV at its floor
    # Every KV slot held, 3 states unused, a long request waits that the budget cannot add.
    d = Demand.of_queue(cur.kv_slots, 16, [Need(2064, 1)], 0.0)
    plan = o.propose(d)
    assert plan is not None and plan.kv_slots > cur.kv_slots and plan.mamba_slots >= 16
    assert o.bytes_of(plan) <= 24 * MIB


def test_queue_must_match_the_aggregates() -> None:
    with pytest.raises(ValueError, match="queue sums"):
        Demand(0, 10, 0, 1, 0.0, (Need(5, 1),))
    d = Demand.of_queue(3, 1, [Need(5, 1), Need(7, 1)], 0.0)
    assert (d.kv_waiting, d.mamba_waiting) == (12, 2)


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


@settings(max_examples=150, deadline=None)
@given(
    budget_pages=st.integers(min_value=40, max_value=4000),
    kv_slot=st.sampled_from([256, 1000, 4096]),
    m_slot=st.sampled_from([4096, 65536, 200_000]),
    max_m=st.sampled_from([None, 4, 64]),
    steps=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.lists(st.integers(0, 3000), max_size=40),
                             st.sampled_from([0.0, 60.0])), max_size=25),
)
def test_queue_demand_invariants(
    budget_pages: int, kv_slot: int, m_slot: int, max_m: int | None, steps: list[tuple[float, float, list[int], float]]
) -> None:
    """With per-request queues (the squeezed split, the busy hold, the reservations): never over
    the budget, never below live slots or above a reservation, whole units, and stable."""
    o = Orchestrator(1 << 40, kv_slot, m_slot, min_kv_slots=8, min_mamba_slots=2, page_bytes=PAGE, idle_s=30.0,
                     max_kv_slots=200_000, max_mamba_slots=max_m)
    budget = o.min_bytes + budget_pages * PAGE
    o.set_budget(budget)
    m_unit = o.units.mamba_slots
    # A reservation is used in whole units, but never below the (rounded-up) minimum.
    m_cap = None if max_m is None else max(-(-2 // m_unit) * m_unit, max_m // m_unit * m_unit)
    for kv_frac, m_frac, queue, idle in steps:
        cur = o.current
        d = Demand.of_queue(int(cur.kv_slots * kv_frac), int(cur.mamba_slots * m_frac),
                            [Need(kv, 1) for kv in queue], idle)
        plan = o.propose(d)
        if plan is None:  # holding is allowed only within the budget (or at the floors)
            assert o.bytes_of(cur) <= budget or cur == o.floor(d)
            continue
        assert o.bytes_of(plan) <= budget or plan == o.floor(d)
        assert plan.kv_slots >= d.kv_live and plan.mamba_slots >= d.mamba_live
        assert plan.kv_slots <= 200_000 and (m_cap is None or plan.mamba_slots <= m_cap)
        assert plan.kv_slots % o.units.kv_slots == 0 and plan.mamba_slots % o.units.mamba_slots == 0
        o.applied(plan)
        assert o.propose(d) is None  # stable: the same demand never asks for another change


def split(total: int, members: list[Orchestrator], demands: list[Demand]) -> list[int]:
    """One round of a budget shared by ``members`` (what each ``BudgetLedger`` computes): every
    member's share by ``split_shares``, set as its budget."""
    shares = [Share(o.bytes_of(o.floor(d)), o.bytes_of(o.want(d)), o.bytes_of(o.current), o.min_bytes, not o.is_idle(d))
              for o, d in zip(members, demands, strict=True)]
    budgets = split_shares(total, shares)
    for o, b in zip(members, budgets, strict=True):
        o.set_budget(b)
    return budgets


def test_shared_budget_follows_demand_between_two_workers() -> None:
    total = 64 * MIB
    a, b = make(budget=total), make(budget=total)

    def run(da: Demand, db: Demand, rounds: int = 3) -> None:
        for _ in range(rounds):  # a shrink acknowledged in one round frees bytes for the next
            split(total, [a, b], [da, db])
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
    split(total, [a, b], [busy(kv_wait=1_000_000), Demand(0, 0, 0, 0, 100.0)])
    step(a, busy(kv_wait=1_000_000))
    held_a = a.bytes_of(a.current)
    # B becomes busy, but A has not released anything yet: B may only use what is free now.
    budgets = split(total, [a, b], [busy(kv_wait=1_000_000), busy(kv_wait=1_000_000)])
    assert budgets[1] <= total - held_a
