"""The chaos run's accounting (benchmarks/chaos_stats.py, chaos_report.py, the fault schedule of
chaos.py) on synthetic data: what counts as duplicated, skipped, wrong or lost, the gap a fault
leaves in a stream, and an RSS slope that a restart does not bend."""

from __future__ import annotations

import math

import pytest

from benchmarks.chaos import ChaosConfig, schedule
from benchmarks.chaos_load import Outcome, Prompt
from benchmarks.chaos_report import FaultRecord, RssSample, summarize, tables
from benchmarks.chaos_stats import gap_across, is_prefix, percentile, slope_within, verdict

WANT = [5, 6, 7, 8, 9, 10]


@pytest.mark.parametrize(
    ("got", "expected"),
    [
        (WANT, "ok"),
        ([5, 6, 7, 8, 7, 8, 9, 10], "duplicated"),  # 7, 8 sent again after a resume
        ([5, 5, 6, 7, 8, 9, 10], "duplicated"),
        ([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10], "duplicated"),  # the whole stream twice
        ([5, 6, 9, 10], "skipped"),  # 7, 8 lost
        ([5, 6, 7, 8, 9, 11], "wrong"),
        ([5, 6, 7, 1, 2, 8, 9, 10], "wrong"),  # inserted, but not a repeat of what came before
        ([], "skipped"),
    ],
)
def test_verdict(got: list[int], expected: str) -> None:
    assert verdict(got, WANT) == expected


def test_verdict_on_text() -> None:
    assert verdict("the cat sat sat on", "the cat sat on") == "duplicated"
    assert verdict("the cat sat on", "the cat sat on") == "ok"
    assert verdict("the dog sat on", "the cat sat on") == "wrong"
    assert is_prefix("the ca", "the cat") and not is_prefix("the co", "the cat")


def test_gap_across_a_fault() -> None:
    times = [1.0, 1.1, 1.2, 6.5, 6.6]
    assert gap_across(times, sent=0.9, t=3.0) == pytest.approx(5.3)  # 1.2 -> 6.5
    assert gap_across(times, sent=0.9, t=0.95) == pytest.approx(0.1)  # from the sending to the first token
    assert gap_across(times, sent=4.0, t=3.0) is None  # sent after the fault
    assert gap_across(times, sent=0.9, t=7.0) is None  # done before it
    assert gap_across([], sent=0.9, t=3.0) is None


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(range(101), 99) == pytest.approx(99.0)
    assert percentile([4.0], 99) == 4.0
    assert math.isnan(percentile([], 50))


def test_slope_within_ignores_restarts() -> None:
    """Two process lives growing 1 MiB per 100 s each, the second starting 300 MiB lower: the
    shared slope is the growth (36 MiB/h), not the drop a plain fit would see."""
    first = [(t, 400.0 + t / 100) for t in range(0, 200, 2)]
    second = [(t, 100.0 + t / 100) for t in range(200, 400, 2)]
    assert slope_within([first, second]) == pytest.approx(0.01)
    assert slope_within([[(5.0, 1.0)]]) is None  # one point: no slope
    assert slope_within([[(5.0, 1.0), (5.0, 2.0)]]) is None  # x does not vary


def test_a_five_minute_run_hits_every_service_with_both_signals() -> None:
    faults = schedule(ChaosConfig(minutes=5))
    assert [f.at for f in faults] == [15.0 + 30 * k for k in range(10)]
    pairs = {(f.target.split("-")[0], f.action) for f in faults}
    assert pairs == {(t, a) for t in ("worker", "scheduler", "tokenizer", "kvstore", "etcd") for a in ("kill", "stop")}
    hour = schedule(ChaosConfig(minutes=60))
    assert len(hour) == 120
    assert {(f.target, f.action) for f in hour} >= {(f"{s}{r}", a) for s in ("worker", "scheduler")
                                                   for r in ("", "-1") for a in ("kill", "stop")}  # fmt: skip


def test_spared_services_are_stopped_never_killed() -> None:
    spare = "worker-1,scheduler-1,tokenizer,kvstore,etcd"
    hour = schedule(ChaosConfig(minutes=60, spare=spare))
    assert len(hour) == 120
    assert {f.target for f in hour if f.action == "kill"} == {"worker", "scheduler"}
    assert {f.target for f in hour if f.action == "stop"} == {*spare.split(","), "worker", "scheduler"}
    with pytest.raises(ValueError, match="worker-2"):
        ChaosConfig(spare="worker-2")


def _outcome(n: int, front: str, sent: float, ended: float, ids: list[int] = WANT, **kw: object) -> Outcome:
    text = "".join(map(chr, ids))
    times = [sent + 0.1 * (i + 1) for i in range(len(ids))]
    o = Outcome(n, front, "p", sent, ended, times=times, ids=list(ids), text=text, finish="length")  # type: ignore[arg-type]
    for k, v in kw.items():
        setattr(o, k, v)
    return o


RESET = "UNAVAILABLE Stream removed (recvmsg:Connection reset by peer (104))"


def test_summarize_counts_every_outcome_once() -> None:
    prompt = Prompt("p", "text", "", "q", want_ids=WANT, want_text="".join(map(chr, WANT)))
    t0 = 100.0
    kill = FaultRecord(at=10.0, target="tokenizer", action="kill", pid=1, ended=10.0, restarted_s=4.0)
    stop = FaultRecord(at=20.0, target="worker-1", action="stop", pid=2, ended=30.0)
    outcomes = [
        _outcome(0, "grpc-ids", 101.0, 102.0),  # ok
        _outcome(1, "http-completions", 101.0, 102.0),  # ok, judged by its text
        _outcome(2, "grpc-text", 103.0, 104.0, ids=[5, 6, 7, 7, 8, 9, 10]),  # duplicated
        _outcome(3, "grpc-ids", 109.0, 110.5, ids=[5, 6], finish="", error="UNAVAILABLE Socket closed"),
        _outcome(4, "grpc-ids", 112.0, 113.0, ids=[5], finish="", error="UNAVAILABLE worker lost"),  # lost
        _outcome(5, "grpc-ids", 112.0, 113.0, ids=[6], finish="", error="DEADLINE_EXCEEDED"),  # lost, wrong
        # sent into the killed tokenizer's socket 12 ms after the kill, reset 16 ms later
        _outcome(8, "grpc-ids", 110.012, 110.028, ids=[], finish="", error=RESET),
        # sent as soon after the kill, but failed otherwise, or long after it: lost
        _outcome(9, "grpc-ids", 110.012, 110.5, ids=[], finish="", error="UNAVAILABLE no worker"),
        _outcome(10, "grpc-ids", 111.5, 111.6, ids=[], finish="", error="UNAVAILABLE Socket closed"),
    ]
    tail = _outcome(7, "grpc-text", 101.0, 102.0)  # right ids, but the text lost its last token's
    tail.text = tail.text[:-1]
    outcomes.append(tail)
    stalled = _outcome(6, "grpc-ids", 119.0, 131.0)
    stalled.times = [119.5, 119.9, 130.2, 130.3, 130.4, 130.5]  # stopped across the SIGSTOP, back 0.2 s after SIGCONT
    outcomes.append(stalled)
    samples = [RssSample(float(t), "worker", 7 if t < 60 else 8, float(t if t < 60 else t - 60), 300 + t / 50)
               for t in range(0, 120, 2)]  # fmt: skip
    s = summarize(outcomes, {"p": prompt}, [kill, stop], samples, t0, warmup_s=10.0)
    assert (s.sent, s.completed, s.ok, s.duplicated, s.skipped) == (11, 5, 3, 1, 1)
    assert (s.failed, s.tokenizer_connection, s.lost, s.wrong) == (6, 2, 4, 1)
    assert s.reasons == {"UNAVAILABLE worker lost": 1, "DEADLINE_EXCEEDED": 1, "UNAVAILABLE no worker": 1,
                         "UNAVAILABLE Socket closed": 1}  # fmt: skip
    assert s.by_front["grpc-ids"] == {"sent": 8, "ok": 2, "tokenizer_connection": 2, "lost": 4}
    r = s.resume["worker stop"]
    assert (r.spanning, r.interrupted) == (1, 1)
    assert r.stalls_s == [pytest.approx(10.3)] and r.resume_s == [pytest.approx(10.2)]  # from the SIGSTOP
    assert r.moved == 0 and r.fronts == {"grpc-ids": 1}
    t = s.trends["worker"]
    assert t.restarts == 1 and t.slope_mib_per_hour == pytest.approx(72.0)  # 1 MiB per 50 s, in each life
    assert not s.goal_met
    assert "| 11 | 5 | 3 | 1 | 1 | 1 | 2 | 4 |" in tables(s, [kill, stop])
