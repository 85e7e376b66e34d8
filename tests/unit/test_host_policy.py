"""The host tier's pure policy pieces: the prefetch decision and the one-request prefetch tracker."""

from __future__ import annotations

import pytest

from services.scheduler.memory.host_policy import DoubleAckError, PrefetchTracker, StopPolicy, should_prefetch


def test_should_prefetch_needs_a_gain_of_threshold_pages() -> None:
    assert should_prefetch(10, 4, 6) and not should_prefetch(10, 4, 7)
    assert not should_prefetch(4, 4, 0)  # no gain is never worth a round trip
    with pytest.raises(ValueError):
        should_prefetch(-1, 0, 1)


def _tracker(policy: StopPolicy, released: list[int]) -> PrefetchTracker:
    return PrefetchTracker(3, policy, now=0.0, timeout_s=1.0, release=released.append)


def test_tracker_best_effort_admits_at_once_and_releases_on_the_ack() -> None:
    released: list[int] = []
    t = _tracker("best_effort", released)
    assert t.may_admit(0.0)
    t.issue()
    t.on_done(2)
    assert released == [2] and t.arrived == 2
    with pytest.raises(DoubleAckError):
        t.on_done(2)
    assert released == [2]


def test_tracker_wait_complete_waits_for_the_ack() -> None:
    released: list[int] = []
    t = _tracker("wait_complete", released)
    t.issue()
    assert not t.may_admit(100.0) and not t.expire(100.0)
    t.on_done(3)
    assert t.may_admit(100.0) and released == [3]


def test_tracker_timeout_admits_at_the_deadline_and_releases_once() -> None:
    released: list[int] = []
    sent = _tracker("timeout", released)
    sent.issue()
    assert not sent.may_admit(0.5) and sent.may_admit(1.0)
    assert not sent.expire(2.0) and released == []  # sent: the worker may still be writing
    sent.on_done(1)
    assert released == [1]
    unsent = _tracker("timeout", released)
    assert not unsent.expire(0.5)
    assert unsent.expire(1.0) and released == [1, 0] and not unsent.should_issue
    assert not unsent.expire(5.0)
    unsent.abort()
    with pytest.raises(DoubleAckError):
        unsent.on_done(0)
    assert released == [1, 0]


def test_tracker_abort_releases_exactly_once() -> None:
    released: list[int] = []
    unsent = _tracker("wait_complete", released)
    unsent.abort()
    unsent.abort()
    assert released == [0] and not unsent.may_admit(9.0)
    with pytest.raises(ValueError):
        unsent.issue()
    sent = _tracker("best_effort", released)
    sent.issue()
    sent.abort()
    assert released == [0]  # waits for the worker's ack
    sent.on_done(3)
    assert released == [0, 3] and not sent.may_admit(0.0)
