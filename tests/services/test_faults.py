"""Faults and hostile input against the real stack (etcd + four service processes, public API only).

One test per finding of the outside probe (issue #18), each of which failed on the code before it:
an idle pause past the keepalive window, a 10 MB prompt, undecodable requests, a rejected duplicate
request id, a SIGKILLed worker under load, a SIGKILLed and restarted scheduler. Run alone with
``pytest tests/services/test_faults.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest

from services.common.discovery import Discovery
from services.common.etcd_proc import free_port
from services.supervisor import Stack, start_stack
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc
from tests import streams

QUIET = {"say": lambda _: None}


def _req(text: str = "hello there", n: int = 8, **kw: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=text, sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True), **kw
    )  # type: ignore[arg-type]


def _run(api: pgrpc.StrataStub, req: pb.GenerateRequest, timeout: float = 60) -> list[pb.GenerateResponse]:
    return list(api.Generate(req, timeout=timeout))


def _members(endpoint: str, kind: str) -> set[str]:
    async def go() -> set[str]:
        d = Discovery(endpoint, kind)
        await d.start()
        try:
            return {r.address for r in d.members().values()}
        finally:
            await d.stop()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def stack(plain_stack: Stack) -> Stack:  # tests/shared_stacks.py
    return plain_stack


@pytest.fixture(scope="module")
def api(stack: Stack) -> Iterator[pgrpc.StrataStub]:
    with grpc.insecure_channel(stack.child("tokenizer").address) as ch:
        yield pgrpc.StrataStub(ch)


def test_idle_past_keepalive_then_a_burst(tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 0: every channel pings every 300 ms here (as every 10 s by default): a server that
    refused pings that often would GOAWAY the scheduler's idle Step stream within seconds."""
    monkeypatch.setenv("STRATA_GRPC_KEEPALIVE_MS", "300")
    s = start_stack(tiny_qwen3, free_port(), tmp_path, **QUIET, grammar_preload=False)
    try:
        with grpc.insecure_channel(s.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)
            assert len(_run(api, _req())) >= 1
            time.sleep(6.0)  # idle: ~20 keepalive windows
            with ThreadPoolExecutor(16) as pool:
                results = list(pool.map(lambda i: _run(api, _req(f"burst {i}", 16)), range(16)))
        assert all(r[-1].usage.completion_tokens == 16 for r in results)
        log = (tmp_path / "scheduler.log").read_text()
        assert "worker lost" not in log and "too_many_pings" not in log, log[-2000:]
    finally:
        s.stop()


def test_a_10mb_prompt_is_refused_at_once_and_stalls_no_one(api: pgrpc.StrataStub, stack: Stack) -> None:
    """Finding 1: the size check comes before tokenization, which runs off the event loop."""
    small = _req("a small request", 4)
    unloaded = statistics.median(_timed(api, small) for _ in range(5))
    tokenizer = psutil.Process(stack.child("tokenizer").proc.pid)  # type: ignore[union-attr]
    rss0 = tokenizer.memory_info().rss
    huge = "word " * (2 << 20)  # 10 MiB of text
    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(_refused, api, pb.GenerateRequest(text=huge))
        time.sleep(0.05)
        during = [_timed(api, small) for _ in range(3)]
        code, details, seconds = big.result()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "input.text" in details and "at most" in details
    print(f"[fault] 10 MiB prompt refused in {seconds:.3f}s; small request {statistics.median(during):.3f}s "
          f"during it vs {unloaded:.3f}s unloaded")
    assert seconds < 1.0, seconds
    assert statistics.median(during) < 2 * unloaded + 0.05, (during, unloaded)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        api.Tokenize(pb.TokenizeRequest(text=huge), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and time.monotonic() - t0 < 1.0
    growth = tokenizer.memory_info().rss - rss0
    print(f"[fault] tokenizer RSS growth {growth / 2**20:.1f} MiB")
    assert growth < 100 << 20
    assert stack.child("tokenizer").address in _members(stack.etcd_endpoint, "tokenizer")  # lease kept


def _timed(api: pgrpc.StrataStub, req: pb.GenerateRequest) -> float:
    t0 = time.perf_counter()
    _run(api, req)
    return time.perf_counter() - t0


def _refused(api: pgrpc.StrataStub, req: pb.GenerateRequest) -> tuple[grpc.StatusCode, str, float]:
    t0 = time.perf_counter()
    try:
        _run(api, req)
    except grpc.RpcError as e:
        return e.code(), e.details() or "", time.perf_counter() - t0
    raise AssertionError("accepted")


def test_undecodable_requests_are_invalid_argument_without_tracebacks(stack: Stack, api: pgrpc.StrataStub) -> None:
    """Finding 2: invalid UTF-8 in a string field and a corrupt payload, 40 times."""
    good = _req("x").SerializeToString()
    bad_utf8 = good.replace(b"x", b"\xff")
    corrupt = b"\x0a\xff\xff\xff\xff\x0f" + os.urandom(16)
    log_path = stack.child("tokenizer").log_path
    before = log_path.read_text()
    with grpc.insecure_channel(stack.child("tokenizer").address) as ch:
        raw = ch.unary_stream("/strata.v1.Strata/Generate", request_serializer=None, response_deserializer=None)
        for payload in [bad_utf8, corrupt] * 20:
            with pytest.raises(grpc.RpcError) as e:
                list(raw(payload, timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert "not a valid Generate request message" in (e.value.details() or "")
    added = log_path.read_text()[len(before) :]
    assert "Traceback" not in added
    assert added.count("undecodable request") <= 1  # rate-limited: one warning for the flood
    assert _run(api, _req())[-1].usage.completion_tokens == 8  # still serving


def test_a_rejected_duplicate_leaves_the_original_abortable(api: pgrpc.StrataStub) -> None:
    """Finding 3: duplicate id -> ALREADY_EXISTS; then Abort of that id stops the original."""
    original = api.Generate(_req("the original", 1500, request_id="dup-1", stream=True), timeout=60)
    first = next(original)
    assert first.token_ids
    with pytest.raises(grpc.RpcError) as e:
        _run(api, _req("the duplicate", 4, request_id="dup-1"))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert api.Abort(pb.AbortRequest(request_id="dup-1")).aborted
    rest = list(original)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT


def test_worker_sigkill_under_load_ends_every_stream(tiny_qwen3: Path, tmp_path: Path) -> None:
    """Finding 4: with no worker to come back, requeued requests end with UNAVAILABLE in bounded
    time (the scheduler's --worker-wait-s), never hang."""
    s = start_stack(tiny_qwen3, free_port(), tmp_path, scheduler_args=("--worker-wait-s", "2"), **QUIET,
                    grammar_preload=False)
    try:
        with grpc.insecure_channel(s.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)
            streams = [api.Generate(_req(f"stream {i}", 1800, stream=True), timeout=60) for i in range(8)]
            for st in streams:
                next(st)
            worker = s.child("worker").proc
            assert worker is not None
            t0 = time.monotonic()
            worker.send_signal(signal.SIGKILL)
            codes = []
            for st in streams:
                with pytest.raises(grpc.RpcError) as e:
                    list(st)
                codes.append(e.value.code())
            elapsed = time.monotonic() - t0
        print(f"[fault] worker SIGKILL, no other worker: 8 streams UNAVAILABLE after {elapsed:.2f}s (bound 2 s)")
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 8, codes
        assert elapsed < 2 + 3, elapsed
        assert "AssertionError" not in (tmp_path / "scheduler.log").read_text()
    finally:
        s.stop()


def test_worker_sigkill_under_16_streams_resumes_them_on_its_restart(tiny_qwen3: Path, tmp_path: Path) -> None:
    """Issue #29: the requests of a SIGKILLed worker wait (``--worker-wait-s``, 10 s) with their
    tokens so far; the restarted worker (same port, as ``strata up --restart on-failure`` restarts
    it) recomputes their context and every stream goes on: greedy, seeded and grammar-constrained
    tokens equal to an uninterrupted run, none lost or repeated, usage counting them all."""
    s = start_stack(tiny_qwen3, free_port(), tmp_path, **QUIET, grammar_preload=False)
    try:
        with grpc.insecure_channel(s.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)
            reqs = streams.mixed(16, 160)
            want = streams.run(api, reqs)
            worker = s.child("worker")
            times: dict[str, float] = {}

            def kill_and_restart(running: list[streams.Stream]) -> None:
                streams.wait_streaming(running, 10)
                assert worker.proc is not None
                times["kill"] = time.monotonic()
                worker.proc.send_signal(signal.SIGKILL)
                worker.proc.wait()
                worker.pin_ports()
                worker.start(dict(os.environ, PYTHONUNBUFFERED="1"))
                worker.wait_ready(60)
                times["ready"] = time.monotonic()

            got = streams.run(api, reqs, kill_and_restart)
        resumed = max(g.gap_after(times["kill"]) for g in got if g.times[-1] > times["kill"])
        print(f"[fault] worker SIGKILL under 16 streams: restarted in {times['ready'] - times['kill']:.2f}s, "
              f"every stream streaming again {resumed:.2f}s after the kill")
        assert [g.error for g in got] == [None] * 16
        assert [g.ids for g in got] == [w.ids for w in want]
        assert all(g.usage is not None and g.usage.completion_tokens == len(g.ids) for g in got)
        assert sum(len(g.ids) > 10 and g.times[-1] > times["ready"] for g in got) >= 12  # most were cut
        assert "16 requests requeued" in (tmp_path / "scheduler.log").read_text()
    finally:
        s.stop()


def test_worker_sigkill_with_a_second_worker_moves_the_requests(tiny_qwen3: Path, tmp_path: Path) -> None:
    """Finding 4, with somewhere to go: the requeued requests finish on the other worker."""
    s = start_stack(tiny_qwen3, free_port(), tmp_path, **QUIET, grammar_preload=False)
    try:
        first = s.child("worker")
        spare = type(first)("worker", [*first.argv], tmp_path / "worker2.log")
        spare.start(dict(os.environ, PYTHONUNBUFFERED="1"))
        spare.wait_ready(120)
        s.children.append(spare)
        with grpc.insecure_channel(s.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)
            streams = [api.Generate(_req(f"moved {i}", 400, stream=True), timeout=120) for i in range(4)]
            for st in streams:
                next(st)
            assert first.proc is not None
            first.proc.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            ends = [list(st)[-1] for st in streams]
            print(f"[fault] worker SIGKILL with a spare: 4 streams finished on it {time.monotonic() - t0:.2f}s later")
        assert all(e.finish_reason == pb.FINISH_REASON_LENGTH for e in ends)
    finally:
        s.stop()


def test_scheduler_restart_is_served_at_once_and_no_scheduler_fails_fast(tiny_qwen3: Path, tmp_path: Path) -> None:
    """Finding 5: a SIGKILLed scheduler stays registered until its lease ends; the tokenizer sets
    it aside after one refused call and uses the restarted one; with none alive a request ends
    with UNAVAILABLE in seconds, not 30: after ``--resume-wait-s`` (2 s here) while the dead one is
    still registered (it may be restarting), after ``--scheduler-wait-s`` (5 s) once none is."""
    s = start_stack(tiny_qwen3, free_port(), tmp_path, tokenizer_args=("--resume-wait-s", "2"), **QUIET,
                    grammar_preload=False)
    try:
        with grpc.insecure_channel(s.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)
            assert _run(api, _req())
            sched = s.child("scheduler")
            assert sched.proc is not None
            sched.proc.send_signal(signal.SIGKILL)
            sched.proc.wait()
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                _run(api, _req())
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            print(f"[fault] scheduler SIGKILL: next request UNAVAILABLE after {time.monotonic() - t0:.2f}s")
            assert 2.0 <= time.monotonic() - t0 < 2.0 + 1.5
            while sched.address in _members(s.etcd_endpoint, "scheduler"):  # its lease runs out
                assert time.monotonic() - t0 < 5.0 + 3.0
                time.sleep(0.25)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:  # none registered: the tokenizer waits 5 s, not 30
                _run(api, _req())
            print(f"[fault] no scheduler registered: UNAVAILABLE after {time.monotonic() - t0:.2f}s")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 5.0 + 1.5
            sched.log_path.write_text("")
            sched.start(dict(os.environ, PYTHONUNBUFFERED="1"))
            sched.wait_ready(60)
            t1 = time.monotonic()
            while True:  # the new scheduler attaches the worker, then serves
                try:
                    assert _run(api, _req())[-1].usage.completion_tokens == 8
                    break
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() - t1 < 8.0, "not served after the scheduler restarted"
                    time.sleep(0.2)
            served_after = time.monotonic() - t1
            print(f"[fault] scheduler restarted: served {served_after:.2f}s after it was ready")
            # and from then on every request is served: none goes to a dead address
            for _ in range(10):
                assert _run(api, _req())[-1].usage.completion_tokens == 8
        assert served_after < 8.0
        assert "Traceback" not in (tmp_path / "tokenizer.log").read_text()
    finally:
        s.stop()


def test_keepalive_policies_agree() -> None:
    """Finding 0, by construction: every server accepts pings as often as every client sends
    them (with or without data in flight), so no server ever answers GOAWAY too_many_pings."""
    from services.common.server import CHANNEL_OPTIONS, SERVER_OPTIONS

    client, server = dict(CHANNEL_OPTIONS), dict(SERVER_OPTIONS)
    ping_every = client["grpc.keepalive_time_ms"]
    assert client["grpc.http2.min_time_between_pings_ms"] <= ping_every
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] <= ping_every
    assert server["grpc.http2.max_ping_strikes"] == 0 and server["grpc.keepalive_permit_without_calls"] == 1


def test_overload_sheds_at_once_and_serves_the_admitted(tiny_qwen3: Path, tmp_path: Path) -> None:
    """Twice what the queue holds arrives at once: the excess gets RESOURCE_EXHAUSTED at once
    (no queueing), every admitted request completes."""
    limits = ("--max-waiting", "4", "--max-running", "2")
    s = start_stack(tiny_qwen3, free_port(), tmp_path, scheduler_args=limits, **QUIET, grammar_preload=False)
    try:
        with grpc.insecure_channel(s.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)
            _run(api, _req())  # warm

            def one(i: int) -> tuple[str, float]:
                t0 = time.perf_counter()
                try:
                    out = _run(api, _req(f"load {i}", 48))
                    return ("ok" if out[-1].usage.completion_tokens == 48 else "short"), time.perf_counter() - t0
                except grpc.RpcError as e:
                    return e.code().name, time.perf_counter() - t0

            with ThreadPoolExecutor(16) as pool:
                results = list(pool.map(one, range(16)))
        shed = [t for code, t in results if code == "RESOURCE_EXHAUSTED"]
        served = [t for code, t in results if code == "ok"]
        assert len(shed) + len(served) == 16, results
        # The waiting queue holds 4 whatever the timing; up to 2 more are served when the loop
        # moves requests to running rows before the rest arrive.
        assert shed and len(served) >= 4, results
        print(f"[fault] overload: {len(shed)} shed in {statistics.median(shed) * 1000:.0f} ms (median), "
              f"max {max(shed) * 1000:.0f} ms; {len(served)} served")
        # "At once" against this machine's own pace, not a fixed bar (CI's 2 shared cores answered
        # in 0.14 s one day): the shed answers come before the admitted requests that had to wait
        # for one of the 2 running rows, so nothing was queued behind them. (The first two admitted
        # may finish first: the tiny model produces 48 tokens in ~0.14 s, CI once saw 0.136 s against
        # a shed median of 0.18 s.)
        assert statistics.median(shed) < sorted(served)[2] and max(shed) < 1.0, (shed, served)
        with open(tmp_path / "scheduler.log") as f:
            assert "Traceback" not in f.read()
    finally:
        s.stop()


def test_etcd_restart_and_a_frozen_kvstore_do_not_stop_serving(tiny_qwen3: Path, tmp_path: Path) -> None:
    """etcd down: requests keep being served (routes are cached) and every service registers again
    once it is back. The kvstore frozen (SIGSTOP): requests degrade to recomputation and complete."""
    worker = ("--host-cache-bytes", str(8 << 20), "--l3", "true")
    s = start_stack(tiny_qwen3, free_port(), tmp_path, worker_args=worker, **QUIET, grammar_preload=False)
    try:
        with grpc.insecure_channel(s.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)
            assert s.etcd is not None
            # READY comes before the scheduler finds its worker through etcd: one request first,
            # or etcd could go before that and leave the scheduler with no worker to find.
            assert _run(api, _req("before etcd goes"))[-1].usage.completion_tokens == 8
            s.etcd.kill()
            assert _run(api, _req("while etcd is down"))[-1].usage.completion_tokens == 8
            s.etcd.start()
            t0 = time.monotonic()
            for kind in ("tokenizer", "scheduler", "worker", "kvstore"):
                while s.child(kind).address not in _members(s.etcd_endpoint, kind):
                    assert time.monotonic() - t0 < 15.0, f"{kind} did not register again"
                    time.sleep(0.25)
            print(f"[fault] etcd restart: all four services registered again {time.monotonic() - t0:.2f}s after")
            assert _run(api, _req("after etcd is back"))[-1].usage.completion_tokens == 8

            kv = s.child("kvstore").proc
            assert kv is not None
            kv.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                long_prompt = " ".join(f"fresh page {i}" for i in range(120))
                with ThreadPoolExecutor(4) as pool:
                    outs = list(pool.map(lambda i: _run(api, _req(f"{i} {long_prompt}", 8), 60), range(4)))
                frozen_s = time.monotonic() - t0
            finally:
                kv.send_signal(signal.SIGCONT)
            print(f"[fault] kvstore SIGSTOP: 4 long-prompt requests served in {frozen_s:.2f}s")
            assert all(o[-1].usage.completion_tokens == 8 for o in outs)
            assert frozen_s < 30.0
    finally:
        s.stop()
