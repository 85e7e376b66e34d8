"""The tokenizer's side of ``Scheduler/Session``: every request to one scheduler over one stream.

One ``SchedulerSession`` per scheduler address, opened on first use: requests are submitted on
it under a session-local handle and their events come back batched, one message per scheduler
step for all of them (``services/scheduler/session.py``). A reader task splits each message into
per-request ``Chunk``s and hands them to the request's ``Inbox``; a request that falls behind
finds several chunks waiting and takes them merged, so a slow client gets fewer, larger writes
instead of a backlog of one-token messages. If the stream breaks (the scheduler died or
restarted) every request on it ends with the stream's status, marked ``lost`` when the scheduler
went away (the servicer then resumes it elsewhere), and the next request opens a new session.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc
from strata.v1 import strata_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Chunk:
    """What one request got since its previous chunk: tokens (with logprobs when asked), and its
    end when it ended (``end.status_code`` non-zero: it failed with that gRPC status). ``lost``:
    the end is the session's, which broke with the scheduler (UNAVAILABLE), not the request's own:
    the request may go on elsewhere from the tokens it got."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    end: spb.RequestEnd | None = None
    lost: bool = False
    prompt: pb.PromptLogprobs | None = None  # the scored prompt (with the first tokens, or the end)


class Inbox:
    """One request's chunks, filled by the session's reader and drained by the request's task."""

    __slots__ = ("_abort", "_items", "_waiter", "cached_tokens", "ended", "handle")

    def __init__(self, handle: int, abort: Callable[[int], None]) -> None:
        self.handle = handle
        self.cached_tokens = 0  # prompt tokens the scheduler served from cache (known once started)
        self.ended = False
        self._abort = abort
        self._items: list[Chunk] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, chunk: Chunk) -> None:
        self._items.append(chunk)
        if chunk.end is not None:
            self.ended = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next(self) -> Chunk:
        """Everything that arrived since the last call, merged into one chunk (waits for some)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        if len(items) == 1:
            return items[0]
        merged = Chunk()
        for c in items:
            merged.token_ids += c.token_ids
            merged.logprobs += c.logprobs
            merged.end = merged.end or c.end
            merged.lost = merged.lost or c.lost
            merged.prompt = merged.prompt or c.prompt
        return merged

    def close(self) -> None:
        """The request's task is done with it: abort the request unless it ended."""
        if not self.ended:
            self.ended = True
            self._abort(self.handle)


class SchedulerSession:
    """One ``Session`` stream to one scheduler, shared by every request routed there."""

    def __init__(self, stub: sgrpc.SchedulerStub, address: str) -> None:
        self.address = address
        self._stub = stub
        self._handles = itertools.count(1)
        self._inboxes: dict[int, Inbox] = {}
        self._out: asyncio.Queue[spb.SessionRequest | None] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self.broken = False

    def submit(self, request: spb.GenerateRequest, trace_context: dict[str, str], timeout_s: float | None) -> Inbox:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read(), name=f"session {self.address}")
        handle = next(self._handles)
        inbox = self._inboxes[handle] = Inbox(handle, self._abort)
        sub = spb.SessionSubmit(handle=handle, request=request, trace_context=trace_context, timeout_s=timeout_s or 0)
        self._out.put_nowait(spb.SessionRequest(submit=sub))
        return inbox

    def _abort(self, handle: int) -> None:
        if self._inboxes.pop(handle, None) is not None and not self.broken:
            self._out.put_nowait(spb.SessionRequest(abort=handle))

    async def _requests(self) -> AsyncIterator[spb.SessionRequest]:
        while (m := await self._out.get()) is not None:
            yield m

    async def _read(self) -> None:
        call = self._stub.Session(self._requests())
        try:
            async for msg in call:
                self._dispatch(msg)
            code, details = grpc.StatusCode.UNAVAILABLE, f"scheduler {self.address} ended the session"
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or e.code().name
            if code == grpc.StatusCode.INTERNAL:
                # gRPC's core reports some connections cut mid-stream as INTERNAL ("Internal error
                # from Core": a scheduler SIGKILLed while a message was in flight, seen in CI):
                # the scheduler is as gone as with UNAVAILABLE, and its requests go on elsewhere.
                code, details = grpc.StatusCode.UNAVAILABLE, f"session with scheduler {self.address} broke: {details}"
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "the tokenizer is stopping"
            call.cancel()
        self._fail_all(code, details)

    def _dispatch(self, msg: spb.SessionEvents) -> None:
        inboxes = self._inboxes
        for s in msg.started:
            inbox = inboxes.get(s.handle)
            if inbox is not None:
                inbox.cached_tokens = s.usage.cached_tokens
        chunks: dict[int, Chunk] = {}
        ids = list(msg.token_ids)
        at = 0
        for handle, n in zip(msg.handles, msg.counts, strict=True):
            chunks[handle] = Chunk(ids[at : at + n])
            at += n
        for lp in msg.logprobs:
            if lp.handle in chunks:
                chunks[lp.handle].logprobs = list(lp.logprobs)
        for scored in msg.prompt_logprobs:
            chunks.setdefault(scored.handle, Chunk()).prompt = scored.prompt
        for end in msg.ends:
            chunk = chunks.get(end.handle)
            if chunk is None:
                chunk = chunks[end.handle] = Chunk()
            chunk.end = end
        for handle, chunk in chunks.items():
            inbox = inboxes.get(handle)
            if inbox is not None:
                inbox.put(chunk)
                if chunk.end is not None:
                    del inboxes[handle]

    def _fail_all(self, code: grpc.StatusCode, details: str) -> None:
        """The stream is gone: every request on it ends with its status; new ones go elsewhere."""
        self.broken = True
        inboxes, self._inboxes = self._inboxes, {}
        lost = code == grpc.StatusCode.UNAVAILABLE  # the scheduler went away (not: we are stopping)
        for inbox in inboxes.values():
            end = spb.RequestEnd(handle=inbox.handle, status_code=code.value[0], error=details)
            inbox.put(Chunk(end=end, lost=lost))
        if inboxes:
            log.info("session with scheduler %s ended (%s: %s): %d requests failed", self.address, code.name,
                     details, len(inboxes))  # fmt: skip

    async def close(self, gone: bool = False) -> None:
        """End the stream. ``gone``: its scheduler left discovery (its lease lapsed: dead, or
        frozen past the lease's TTL), so its requests end ``lost`` and are resumed elsewhere, as
        when the stream breaks; otherwise the tokenizer is stopping and they end CANCELLED."""
        if gone:
            self._fail_all(grpc.StatusCode.UNAVAILABLE, f"scheduler {self.address} left discovery")
        self._out.put_nowait(None)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
