"""The multiplexed tokenizer <-> scheduler stream, piece by piece: the scheduler's collector
(``services.scheduler.session.Session``: a step's events for every request as one message) and the
tokenizer's reader (``services.tokenizer.session``: the message split back into per-request
chunks). The real processes are exercised by the end-to-end, fault and replica tests."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import InvalidArgument, Unavailable
from services.common.step import GREEDY, TokenLogprob
from services.common.validation import Generation
from services.scheduler.request import FailEvent, Finish, FinishEvent, Req, TokenEvent
from services.scheduler.session import Session
from services.tokenizer.session import Chunk, Inbox, SchedulerSession
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.v1 import strata_pb2 as pb


def _req(rid: str, prompt_len: int = 4, cached: int = 2) -> Req:
    gen = Generation(GREEDY, 8, (), frozenset(), False, None, False, 0)
    req = Req(rid, list(range(prompt_len)), gen, seed=0)
    req.cached_tokens = cached
    return req


class _Loop:
    """The two loop verbs a session uses, recorded."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.forgotten: list[str] = []

    def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        return True

    def forget(self, rid: str) -> None:
        self.forgotten.append(rid)


async def _idle() -> None:
    await asyncio.sleep(3600)


def _session() -> tuple[Session, _Loop]:
    loop = _Loop()
    return Session(loop.abort, loop.forget), loop


def test_a_step_of_many_requests_is_one_message_of_columns() -> None:
    async def run() -> None:
        s, loop = _session()
        reqs = {h: _req(f"r{h}") for h in (1, 2, 3)}
        for h, r in reqs.items():
            s.open(h, _idle, 0.0)
            s.running(h, r, lambda: None)
        lp = TokenLogprob(9, -0.5, ((9, -0.5), (4, -1.5)))
        reqs[1].emit(TokenEvent((7,)))
        reqs[2].emit(TokenEvent((8, 9), (lp, lp)))
        reqs[1].emit(TokenEvent((10,)))
        reqs[3].emit(FinishEvent(Finish.LENGTH, 4, 3, 2))
        assert s.wake.is_set()
        msg = s.take()
        assert msg is not None and not s.wake.is_set() and s.take() is None
        assert list(msg.handles) == [1, 2] and list(msg.counts) == [2, 2]
        assert list(msg.token_ids) == [7, 10, 8, 9]
        assert [(x.handle, len(x.logprobs)) for x in msg.logprobs] == [(2, 2)]
        assert msg.logprobs[0].logprobs[0].top[1].token_id == 4
        assert [(x.handle, x.usage.cached_tokens) for x in msg.started] == [(1, 2), (2, 2)]
        (end,) = msg.ends
        assert (end.handle, end.finish_reason, end.usage.completion_tokens, end.status_code) == (
            3, pb.FINISH_REASON_LENGTH, 3, 0
        )
        assert loop.forgotten == ["r3"] and 3 not in s.entries and reqs[3].sink is None
        reqs[1].emit(TokenEvent((11,)))
        again = s.take()
        assert again is not None and list(again.token_ids) == [11] and not again.started  # started once

    asyncio.run(run())


def test_failures_carry_the_status_generate_would_return() -> None:
    async def run() -> None:
        s, _ = _session()
        s.open(1, _idle, 0.0)
        s.fail(1, InvalidArgument("input_ids: 900 is out of range"))
        s.open(2, _idle, 0.0)
        s.running(2, _req("r2"), lambda: None)
        s.entries[2].req.emit(FailEvent(Unavailable("the worker was lost")))  # type: ignore[union-attr]
        msg = s.take()
        assert msg is not None
        by = {e.handle: e for e in msg.ends}
        assert by[1].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "input_ids" in by[1].error
        assert by[2].status_code == grpc.StatusCode.UNAVAILABLE.value[0] and by[2].finish_reason == 0
        s.open(3, _idle, 0.0)
        first = s.entries[3]
        with pytest.raises(ValueError, match="already running"):  # the servicer ends the session: INVALID_ARGUMENT
            s.open(3, _idle, 0.0)
        assert s.entries[3] is first and not s.pending  # the running request is untouched

    asyncio.run(run())


def test_deadline_and_abort_and_close() -> None:
    async def run() -> None:
        s, loop = _session()
        s.open(1, _idle, 0.05)  # expires while still admitting
        admitting = s.entries[1].task
        assert admitting is not None
        s.open(2, _idle, 0.05)
        r2 = _req("r2")
        s.running(2, r2, lambda: None)
        await asyncio.sleep(0.1)
        assert admitting.cancelled() and loop.aborted == ["r2"]
        r2.emit_abort()  # what the loop does for an aborted request
        msg = s.take()
        assert msg is not None
        assert {e.handle: e.status_code for e in msg.ends} == {
            1: grpc.StatusCode.DEADLINE_EXCEEDED.value[0], 2: grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        }
        ended: list[int] = []
        s.open(3, _idle, 0.0)
        s.running(3, _req("r3"), lambda: ended.append(3))
        s.cancel(3)
        assert loop.aborted[-1] == "r3"
        s.open(4, _idle, 0.0)
        s.running(4, _req("r4"), lambda: ended.append(4))
        s.close()  # the client went away: every request still on the session is aborted
        assert loop.aborted[-1] == "r4" and sorted(ended) == [3, 4] and not s.entries

    asyncio.run(run())


def test_the_tokenizer_splits_a_message_into_per_request_chunks() -> None:
    async def run() -> None:
        sess = SchedulerSession(None, "sched:1")  # type: ignore[arg-type]
        a, b = Inbox(1, sess._abort), Inbox(2, sess._abort)
        sess._inboxes.update({1: a, 2: b})
        lp = pb.TokenLogprob(token_id=6, logprob=-0.1)
        msg = spb.SessionEvents(
            handles=[1, 2], counts=[1, 2], token_ids=[5, 6, 7],
            logprobs=[spb.HandleLogprobs(handle=2, logprobs=[lp, lp])],
            started=[spb.HandleUsage(handle=2, usage=pb.Usage(cached_tokens=16))],
            ends=[spb.RequestEnd(handle=2, finish_reason=pb.FINISH_REASON_STOP)],
        )  # fmt: skip
        sess._dispatch(msg)
        sess._dispatch(spb.SessionEvents(handles=[1], counts=[2], token_ids=[8, 9]))
        first = await a.next()  # two messages waited: taken merged
        assert first.token_ids == [5, 8, 9] and first.end is None
        got = await b.next()
        assert got.token_ids == [6, 7] and len(got.logprobs) == 2 and got.end is not None
        assert b.cached_tokens == 16 and b.ended and 2 not in sess._inboxes
        with pytest.raises(ValueError):  # counts that do not match the handles
            sess._dispatch(spb.SessionEvents(handles=[1, 2], counts=[1], token_ids=[1]))
        sess._dispatch(spb.SessionEvents(handles=[1], counts=[1], token_ids=[10]))
        sess._fail_all(grpc.StatusCode.UNAVAILABLE, "scheduler gone")
        failed = await a.next()  # the tokens before the break, then the end, merged
        assert failed.token_ids == [10] and failed.end is not None
        assert failed.end.status_code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert failed.lost and sess.broken  # the scheduler went away: the servicer may resume it
        a.close()  # ended already: no abort is queued on a broken session
        assert sess._out.empty()

    asyncio.run(run())


def test_a_stopping_tokenizer_loses_no_request_to_resume() -> None:
    """Only a scheduler that went away (UNAVAILABLE) marks its requests lost; the tokenizer's own
    stop (CANCELLED) ends them without resuming anywhere."""

    async def run() -> None:
        sess = SchedulerSession(None, "sched:1")  # type: ignore[arg-type]
        inbox = sess._inboxes[1] = Inbox(1, sess._abort)
        sess._fail_all(grpc.StatusCode.CANCELLED, "the tokenizer is stopping")
        chunk = await inbox.next()
        assert chunk.end is not None and not chunk.lost

    asyncio.run(run())


def test_closing_an_unfinished_inbox_aborts_it_on_the_session() -> None:
    async def run() -> None:
        sess = SchedulerSession(None, "sched:1")  # type: ignore[arg-type]
        inbox = Inbox(7, sess._abort)
        sess._inboxes[7] = inbox
        inbox.put(Chunk([1]))
        inbox.close()
        inbox.close()
        m = sess._out.get_nowait()
        assert m is not None
        assert m.WhichOneof("kind") == "abort" and m.abort == 7 and sess._out.empty()

    asyncio.run(run())


def test_a_scheduler_that_left_discovery_loses_its_requests_to_resume() -> None:
    """Found by the chaos run (issue #29): a scheduler SIGSTOPped past its lease leaves etcd and
    the router closes its session; its requests must end ``lost`` (resumed elsewhere), not
    CANCELLED as when the tokenizer itself stops."""

    async def run() -> None:
        sess = SchedulerSession(None, "sched:1")  # type: ignore[arg-type]
        inbox = sess._inboxes[1] = Inbox(1, sess._abort)
        await sess.close(gone=True)
        chunk = await inbox.next()
        assert chunk.end is not None and chunk.lost
        assert chunk.end.status_code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "left discovery" in chunk.end.error

    asyncio.run(run())


def test_an_admission_that_ends_after_its_call_is_aborted_and_forgotten() -> None:
    """Found by the chaos run: the call ended (``close``) while a request was being admitted, and
    the admission still completed (a cancellation lost in ``asyncio.wait_for``): ``running`` found
    no entry (KeyError in a task nobody awaited) and the request ran unread, its id held for ever."""

    async def run() -> None:
        s, loop = _session()
        s.open(4, _idle, 0.0)
        s.close()
        ended: list[bool] = []
        req = _req("late")
        s.running(4, req, lambda: ended.append(True))
        assert loop.aborted == ["late"] and ended == [True] and 4 not in s.entries
        assert loop.forgotten == []  # its id stays taken until the loop has ended it
        req.emit_abort()
        assert loop.forgotten == ["late"] and s.take() is None

    asyncio.run(run())


class _BrokenCall:
    """A ``Session`` call whose stream breaks with ``code`` after one message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    def __aiter__(self) -> _BrokenCall:
        self.sent = False
        return self

    async def __anext__(self) -> spb.SessionEvents:
        if not self.sent:
            self.sent = True
            return spb.SessionEvents(handles=[1], counts=[1], token_ids=[5])
        raise self.error


class _Stub:
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details

    def Session(self, requests: object) -> _BrokenCall:
        return _BrokenCall(self.code, self.details)


@pytest.mark.parametrize(
    ("code", "lost"),
    [(grpc.StatusCode.UNAVAILABLE, True), (grpc.StatusCode.INTERNAL, True), (grpc.StatusCode.UNKNOWN, False)],
)
def test_a_session_cut_mid_stream_loses_its_requests_to_resume(code: grpc.StatusCode, lost: bool) -> None:
    """Found in CI: a scheduler SIGKILLed under 16 streams broke its session with INTERNAL ("Internal
    error from Core", gRPC's report of some connections cut mid-stream), and 6 streams failed
    instead of resuming. INTERNAL counts as the scheduler gone (reported UNAVAILABLE), as
    UNAVAILABLE does; other codes end the requests with their own status."""

    async def run() -> None:
        sess = SchedulerSession(_Stub(code, "Internal error from Core"), "sched:1")  # type: ignore[arg-type]
        inbox = sess.submit(spb.GenerateRequest(), {}, None)
        chunk = await inbox.next()
        tokens = list(chunk.token_ids)
        if chunk.end is None:
            chunk = await inbox.next()
            tokens += chunk.token_ids
        assert tokens == [5]  # what came before the break is kept
        assert chunk.end is not None and chunk.lost == lost and sess.broken
        want = grpc.StatusCode.UNAVAILABLE if lost else code
        assert chunk.end.status_code == want.value[0]
        assert ("sched:1" in chunk.end.error) == (code == grpc.StatusCode.INTERNAL)

    asyncio.run(run())
