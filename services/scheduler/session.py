"""One client's many requests over one stream (``Scheduler/Session``): the events of a step for
every request of the session leave as one message.

The loop's ``commit`` emits a ``TokenEvent`` per request per step; with ``Generate`` each became a
gRPC message of its own. A session's requests emit into ``Session.push`` instead (a list append),
and ``take`` turns everything pending into one ``SessionEvents``: token ids as packed columns
(handle, count, ids), then the first usage of requests that started, then ends. Per request the
semantics stay ``Generate``'s: a failure ends that request with a status code, never the session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common import step_codec
from services.common.errors import StrataError, status_of
from services.scheduler.request import Event, FailEvent, Finish, FinishEvent, PromptEvent, Req, TokenEvent
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.v1 import strata_pb2 as pb

log = logging.getLogger(__name__)

FINISH_PB = {
    Finish.STOP: pb.FINISH_REASON_STOP,
    Finish.LENGTH: pb.FINISH_REASON_LENGTH,
    Finish.ABORT: pb.FINISH_REASON_ABORT,
    Finish.ERROR: pb.FINISH_REASON_ERROR,
}


class DeadlineExceeded(StrataError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


@dataclass(slots=True)
class _Entry:
    """A request of the session: admitting (``req`` None, ``task`` set) or running."""

    task: asyncio.Task[Any] | None = None
    req: Req | None = None
    on_end: Callable[[], None] | None = None  # called once when the request ends (span, bookkeeping)
    timer: asyncio.TimerHandle | None = None
    expired: bool = False
    started: bool = False


@dataclass(slots=True)
class Session:
    """The requests of one ``Session`` call and their pending events.

    ``push`` is called from the loop's commit (synchronously, many times a step); ``take`` from
    the call's writer once woken. ``close`` aborts whatever still runs when the call ends.
    """

    abort: Callable[[str], bool]  # SchedulerLoop.abort
    forget: Callable[[str], None]  # SchedulerLoop.forget
    entries: dict[int, _Entry] = field(default_factory=dict)
    pending: list[tuple[int, Event]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def open(self, handle: int, admit: Callable[[], Coroutine[Any, Any, None]], timeout_s: float) -> None:
        """Start admitting ``handle`` (``admit()`` runs as a task). A handle that is already running
        is ``ValueError`` and touches nothing: its events would be the running request's."""
        if handle in self.entries:
            raise ValueError(f"handle {handle} is already running in this session")
        entry = self.entries[handle] = _Entry(task=asyncio.create_task(admit()))
        if timeout_s > 0:
            entry.timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, handle)

    def running(self, handle: int, req: Req, on_end: Callable[[], None]) -> None:
        """``req`` was admitted (submitted to the loop) for ``handle``: its events come here. If the
        call ended meanwhile (``close`` cancelled the admission, but Python 3.11's
        ``asyncio.wait_for`` in the L3 lookup may swallow a cancellation that races its result),
        ``req`` is aborted and forgotten once it ends: nobody reads it, and its id must be free
        for the continuation the tokenizer sends elsewhere, or here again."""
        entry = self.entries.get(handle)
        if entry is None:
            rid = req.rid
            req.sink = lambda ev: self.forget(rid) if isinstance(ev, FinishEvent | FailEvent) else None
            self.abort(rid)
            on_end()
            return
        entry.req, entry.task, entry.on_end = req, None, on_end
        req.sink = lambda ev: self.push(handle, ev)

    def push(self, handle: int, event: Event) -> None:
        self.pending.append((handle, event))
        self.wake.set()

    def fail(self, handle: int, error: Exception) -> None:
        """``handle`` ends with ``error``'s status (before or after admission)."""
        self.push(handle, FailEvent(error))

    def cancel(self, handle: int) -> None:
        """The client aborts ``handle``."""
        entry = self.entries.get(handle)
        if entry is None:
            return
        if entry.req is not None:
            self.abort(entry.req.rid)  # the loop emits its ABORT finish
        elif entry.task is not None:
            entry.task.cancel()
            self.push(handle, FinishEvent(Finish.ABORT, 0, 0, 0))

    def _expire(self, handle: int) -> None:
        entry = self.entries.get(handle)
        if entry is None:
            return
        entry.expired = True
        entry.timer = None
        if entry.req is not None:
            self.abort(entry.req.rid)
        else:
            if entry.task is not None:
                entry.task.cancel()
            self.push(handle, FailEvent(DeadlineExceeded("the request's deadline passed")))

    def _end(self, handle: int) -> _Entry | None:
        entry = self.entries.pop(handle, None)
        if entry is None:
            return None
        if entry.timer is not None:
            entry.timer.cancel()
        if entry.req is not None:
            entry.req.sink = None
            self.forget(entry.req.rid)
        if entry.on_end is not None:
            entry.on_end()
        return entry

    def close(self) -> None:
        """The call ended: abort and forget every request still on it."""
        for handle, entry in list(self.entries.items()):
            if entry.task is not None:
                entry.task.cancel()
            if entry.req is not None and entry.req.finished is None:
                self.abort(entry.req.rid)
            self._end(handle)
        self.pending.clear()

    def take(self) -> spb.SessionEvents | None:
        """Everything pending as one message (None when nothing is)."""
        self.wake.clear()
        if not self.pending:
            return None
        events, self.pending = self.pending, []
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list[pb.TokenLogprob]] = {}
        msg = spb.SessionEvents()
        for handle, ev in events:
            if isinstance(ev, PromptEvent):
                msg.prompt_logprobs.append(spb.HandlePromptLogprobs(handle=handle, prompt=prompt_logprobs_pb(ev)))
                continue
            if isinstance(ev, TokenEvent):
                tokens.setdefault(handle, []).extend(ev.token_ids)
                if ev.logprobs:
                    logprobs.setdefault(handle, []).extend(step_codec.logprob_to_pb(lp) for lp in ev.logprobs)
                entry = self.entries.get(handle)
                if entry is not None and not entry.started and entry.req is not None:
                    entry.started = True
                    r = entry.req
                    usage = pb.Usage(prompt_tokens=len(r.prompt), completion_tokens=0, cached_tokens=r.cached_tokens)
                    msg.started.append(spb.HandleUsage(handle=handle, usage=usage))
                continue
            entry = self._end(handle)
            if entry is None:  # ended already (an abort raced the finish)
                continue
            if isinstance(ev, FinishEvent):
                if entry.expired and ev.reason == Finish.ABORT:
                    msg.ends.append(_failure(handle, DeadlineExceeded("the request's deadline passed")))
                    continue
                usage = pb.Usage(
                    prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                    cached_tokens=ev.cached_tokens,
                )  # fmt: skip
                if ev.reason == Finish.HANDOFF:
                    msg.ends.append(spb.RequestEnd(handle=handle, usage=usage, handoff=True))
                    continue
                msg.ends.append(spb.RequestEnd(
                    handle=handle, finish_reason=FINISH_PB[ev.reason], usage=usage, error=ev.error
                ))  # fmt: skip
            else:
                msg.ends.append(_failure(handle, ev.error))
        if tokens:
            msg.handles.extend(tokens)
            msg.counts.extend(len(t) for t in tokens.values())
            msg.token_ids.extend(t for ts in tokens.values() for t in ts)
            msg.logprobs.extend(spb.HandleLogprobs(handle=h, logprobs=lps) for h, lps in logprobs.items())
        return msg


def prompt_logprobs_pb(ev: PromptEvent) -> pb.PromptLogprobs:
    return pb.PromptLogprobs(
        first_token_id=ev.first_token_id,
        logprobs=[step_codec.logprob_to_pb(lp) for lp in ev.logprobs],
        ranks=ev.ranks,
    )


def _failure(handle: int, error: Exception) -> spb.RequestEnd:
    code = status_of(error)
    if code == grpc.StatusCode.INTERNAL and not isinstance(error, StrataError):
        log.error("request failed", exc_info=error)
        message = f"internal error: {type(error).__name__}: {error}"
    else:
        message = str(error)
    return spb.RequestEnd(handle=handle, status_code=code.value[0], error=message)
