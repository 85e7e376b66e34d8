"""When the scheduler pipelines a step behind the one in flight (services/scheduler/overlap.py)."""

from __future__ import annotations

import pytest

from services.scheduler.overlap import OverlapPolicy


def _learned(scheduler_s: float, ratio: float = 20.0) -> OverlapPolicy:
    """Decode steps of 10 ms, 128-token prefill steps of 110 ms, ``scheduler_s`` of planning each."""
    p = OverlapPolicy(ratio)
    for _ in range(30):
        p.observe_scheduler(scheduler_s)
        p.observe_step(0, 0.010)
        p.observe_step(128, 0.110)
    return p


def test_nothing_learned_pipelines_behind_every_step() -> None:
    p = OverlapPolicy()
    assert p.pipeline_behind(0) and p.pipeline_behind(4096)
    p.observe_scheduler(0.001)
    p.observe_step(0, 0.010)
    assert p.pipeline_behind(4096)  # no prefill step seen yet: no per-token cost to predict with


def test_a_long_prefill_step_is_not_pipelined_behind_a_short_one_is() -> None:
    p = _learned(scheduler_s=0.001)  # overlap hides 1 ms: worth it below 20 ms of step
    assert p.predicted_s(128) == pytest.approx(0.110, rel=0.01)
    assert not p.pipeline_behind(128)
    assert p.pipeline_behind(8)  # 10 + 6 ms: still short
    assert p.pipeline_behind(0)  # decode steps always


def test_a_costly_scheduler_keeps_overlap_behind_long_steps_too() -> None:
    assert _learned(scheduler_s=0.010).pipeline_behind(128)  # 110 ms < 20 x 10 ms
    assert _learned(scheduler_s=0.001, ratio=200.0).pipeline_behind(128)
    assert _learned(scheduler_s=0.001, ratio=0.0).pipeline_behind(128)  # 0: behind every step


def test_small_prefills_do_not_teach_the_per_token_cost() -> None:
    p = OverlapPolicy()
    p.observe_step(0, 0.010)
    p.observe_step(4, 0.500)  # a 4-token chunk on a slow step: noise, not a rate
    assert p.token_s == 0.0
