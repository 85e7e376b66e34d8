"""The batcher when a lone decoding request finds the KV pool full (no model)."""

from __future__ import annotations

import pytest

from services.common.step import GREEDY
from services.common.validation import Generation
from services.scheduler.batcher import Batcher, BatchLimits
from services.scheduler.memory import Memory, MemoryConfig, device_memory
from services.scheduler.request import Req

EOS = 0


def _lone_request_filling_the_pool() -> tuple[Batcher, Req]:
    """A request whose 8-token prompt fills an 8-slot pool: its first decode has no slot."""
    mem = device_memory(8, 2, 1, MemoryConfig(cache="radix"))
    b = Batcher(mem, BatchLimits(max_prefill_tokens=64, max_running=2), frozenset({EOS}), 256)
    req = Req("a", [1, 2, 3, 4, 5, 6, 7, 8], Generation(GREEDY, 4, (), frozenset(), True, None, False, 0), seed=0)
    b.waiting.append(req)
    plan = b.plan()
    assert plan is not None and [len(ri.input_ids) for ri in plan.step.reqs] == [8]
    b.commit(plan, [(9, None)])
    return b, req


def test_a_lone_decode_waits_for_pages_that_host_jobs_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in CI (test_tp_services, Qwen3-Next under a wave with L3 backups): pages held by host
    jobs in flight come free with their step, so the request waits for them instead of the
    scheduler failing its step as if the pool were too small."""
    b, req = _lone_request_filling_the_pool()
    monkeypatch.setattr(Memory, "pending", property(lambda self: True))
    assert b.plan() is None  # nothing to run now; the request is still running, not failed
    assert b.running == [req] and not req.finished


def test_a_lone_decode_with_nothing_to_wait_for_fails_loudly() -> None:
    b, _ = _lone_request_filling_the_pool()
    with pytest.raises(AssertionError, match="single running request"):
        b.plan()
