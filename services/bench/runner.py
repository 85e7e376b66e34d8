"""Drivers: replay a workload against one backend with bounded concurrency, record every request.

Backends (all greedy with ``ignore_eos``, so output lengths are exact):

* ``GrpcBackend``      — the public ``strata.v1.Strata/Generate`` of a running stack, over grpc.aio;
* ``InProcessBackend`` — ``SchedulerLoop`` + ``Engine`` in this process (``InProcessWorkerLink``:
  steps run in a thread); ``ProfiledEngine`` profiles that thread.

``replay`` runs the conversations of a workload: at most ``concurrency`` requests in flight, at most
``workload.max_parallel`` conversations open, requests released at ``workload.request_rate``
(Poisson, seeded). A conversation's next turn starts when its previous turn has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import itertools
import math
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from services.bench.metrics import RequestRecord
from services.bench.workloads import Turn, Workload
from services.common import validation
from services.common.errors import StrataError
from services.common.server import CHANNEL_OPTIONS
from services.common.step import StepRequest, StepResult
from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.request import FailEvent, Finish, PromptEvent, Req, TokenEvent
from services.scheduler.worker_link import InProcessWorkerLink
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc

Say = Callable[[str], None]


class Backend(Protocol):
    label: str

    async def generate(self, prompt: list[int], max_new_tokens: int, rec: RequestRecord) -> list[int]:
        """Run one greedy ``ignore_eos`` request; append to ``rec.chunks`` as tokens arrive, set
        ``rec.cached_tokens`` from the final usage, return the output ids. Raises on a failed request."""
        ...


class BackendError(RuntimeError):
    """The backend ended a request with ERROR or ABORT."""


def note_tokens(rec: RequestRecord, n: int) -> None:
    """Record that ``n`` output tokens arrived now."""
    if n <= 0:
        return
    now = time.perf_counter()
    if rec.first_token is None:
        rec.first_token = now
    rec.chunks.append((now, n))
    rec.output_tokens += n


# -- gRPC ------------------------------------------------------------------------------------------


def greedy_sampling(max_new_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)


class GrpcBackend:
    """A client of ``strata.v1.Strata`` at ``address``: many concurrent streams over ``channels``
    channels, each its own TCP connection, taken in turn (a tokenizer with several front
    processes gets a connection's streams on one of them)."""

    def __init__(self, address: str, label: str = "gRPC stack", channels: int = 1) -> None:
        self.label = label
        # Each channel its own subchannel pool: channels of equal arguments share one connection.
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)] if channels > 1 else CHANNEL_OPTIONS
        self._channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(channels)]
        self._stubs = itertools.cycle([pgrpc.StrataStub(c) for c in self._channels])

    async def generate(self, prompt: list[int], max_new_tokens: int, rec: RequestRecord) -> list[int]:
        request = pb.GenerateRequest(
            input_ids=pb.TokenIds(ids=prompt), sampling=greedy_sampling(max_new_tokens), stream=True
        )
        out: list[int] = []
        async for resp in next(self._stubs).Generate(request):
            note_tokens(rec, len(resp.token_ids))
            out += resp.token_ids
            if resp.finish_reason in (pb.FINISH_REASON_ERROR, pb.FINISH_REASON_ABORT):
                raise BackendError(f"request ended with {pb.FinishReason.Name(resp.finish_reason)}: {resp.error}")
            if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                rec.cached_tokens = resp.usage.cached_tokens
        return out

    async def close(self) -> None:
        for c in self._channels:
            await c.close()


# -- in-process ------------------------------------------------------------------------------------


class ProfiledEngine:
    """An engine whose every ``step`` runs under ``profile`` (enabled only inside the step, in the
    thread that runs it), so a profile of the engine thread can sit beside one of the event loop."""

    def __init__(self, engine: Any, profile: cProfile.Profile) -> None:
        self._engine = engine
        self._profile = profile
        self.info = engine.info

    def step(self, req: StepRequest, late_masks: Any = None) -> StepResult:
        result: StepResult = self._profile.runcall(self._engine.step, req, late_masks)
        return result


_rids = itertools.count()
# How often a waiting in-process request checks that the loop still has its engine.
_LOST_POLL_S = 1.0
# How long a stopping in-process loop may take to finish its step before it is cancelled.
_STOP_GRACE_S = 5.0
# Progress lines of a run, when a ``say`` is given.
PROGRESS_EVERY_S = 10.0


def greedy_req(prompt: list[int], max_new_tokens: int, limits: validation.Limits) -> Req:
    """A scheduler ``Req`` for a greedy ``ignore_eos`` request, validated like the servicer does."""
    gen = validation.generation(greedy_sampling(max_new_tokens), len(prompt), limits, False, 0)
    return Req(f"bench-{next(_rids)}", list(prompt), gen, seed=0)


class InProcessBackend:
    """``SchedulerLoop`` attached to an ``Engine`` in this process. Use as ``async with``."""

    def __init__(self, engine: Any, cfg: LoopConfig, label: str) -> None:
        self.label = label
        self._engine = engine
        self._cfg = cfg
        self.loop: SchedulerLoop | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> InProcessBackend:
        self.loop = SchedulerLoop(self._cfg)
        self.loop.attach(InProcessWorkerLink(self._engine))
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.loop.run(self._stop))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            # A loop stuck inside a step never sees the stop event: cancel it after a grace period.
            done, _ = await asyncio.wait({self._task}, timeout=_STOP_GRACE_S)
            if not done:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        if self.loop is not None and self.loop.link is not None:
            await self.loop.link.close()

    async def generate(self, prompt: list[int], max_new_tokens: int, rec: RequestRecord) -> list[int]:
        assert self.loop is not None, "use InProcessBackend as an async context manager"
        try:
            req = greedy_req(prompt, max_new_tokens, self.loop.limits())
            self.loop.submit(req)
        except StrataError as e:
            raise BackendError(f"{type(e).__name__}: {e}") from e
        out: list[int] = []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(req.events.get(), _LOST_POLL_S)
                except TimeoutError:
                    if self.loop.link is None:  # the loop lost its engine (a failed step): no more events
                        raise BackendError("the in-process scheduler lost its engine") from None
                    continue
                if isinstance(event, TokenEvent):
                    note_tokens(rec, len(event.token_ids))
                    out += event.token_ids
                    continue
                if isinstance(event, PromptEvent):  # never asked for here
                    continue
                if isinstance(event, FailEvent):
                    raise BackendError(f"request failed: {event.error}")
                if event.reason in (Finish.ERROR, Finish.ABORT):
                    raise BackendError(f"request ended with {event.reason.name}: {event.error}")
                rec.cached_tokens = event.cached_tokens
                return out
        finally:
            self.loop.forget(req.rid)


# -- the driver ------------------------------------------------------------------------------------


class _Pacer:
    """Releases requests at ``rate``/s with exponential gaps (seeded); ``inf`` = no waiting."""

    def __init__(self, rate: float, seed: int) -> None:
        self._rate = rate
        self._rng = random.Random(f"pacer/{seed}")
        self._next = time.perf_counter()

    async def wait(self) -> None:
        if math.isinf(self._rate):
            return
        now = time.perf_counter()
        self._next = max(self._next, now) + self._rng.expovariate(self._rate)
        await asyncio.sleep(self._next - now)


async def replay(
    backend: Backend,
    workload: Workload,
    concurrency: int,
    say: Say | None = None,
    timeout_s: float | None = None,
) -> tuple[list[RequestRecord], float]:
    """Run every conversation of ``workload``; return the records and the wall time (s) from the
    first submission to the last completion. A failed turn ends its conversation. After
    ``timeout_s`` every unfinished request is cancelled and recorded as failed (a stalled backend
    costs one run, not the whole benchmark)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    in_flight = asyncio.Semaphore(concurrency)
    open_convs = asyncio.Semaphore(workload.max_parallel or len(workload.conversations) or 1)
    pacer = _Pacer(workload.request_rate, workload.seed)
    records: list[RequestRecord] = []
    total = workload.num_requests
    start = time.perf_counter()

    async def one(turn: Turn, history: list[int]) -> list[int] | None:
        prompt = turn.prompt_for(history)
        await pacer.wait()
        async with in_flight:
            rec = RequestRecord(len(prompt), turn.max_new_tokens, turn.ideal_reuse(history), time.perf_counter())
            records.append(rec)
            try:
                out = await backend.generate(prompt, turn.max_new_tokens, rec)
            except (BackendError, grpc.aio.AioRpcError) as e:
                rec.error = str(e)
                return None
            rec.finished = time.perf_counter()
        return prompt + out

    async def conversation(turns: tuple[Turn, ...]) -> None:
        async with open_convs:
            history: list[int] = []
            for turn in turns:
                seq = await one(turn, history)
                if seq is None:
                    return
                history = seq

    def progress() -> None:
        if say is not None:
            done = sum(1 for r in records if r.finished is not None)
            tokens = sum(r.output_tokens for r in records)
            say(
                f"    {backend.label}: {done}/{total} requests done, {tokens} tokens out, "
                f"{time.perf_counter() - start:.0f}s"
            )

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            progress()

    beat = asyncio.create_task(heartbeat())
    try:
        await asyncio.wait_for(asyncio.gather(*(conversation(c) for c in workload.conversations)), timeout_s)
    except TimeoutError:
        for rec in records:
            if rec.finished is None and not rec.error:
                rec.error = f"not finished after the run's timeout of {timeout_s:.0f}s"
        if say is not None:
            say(f"    {backend.label}: TIMED OUT after {timeout_s:.0f}s")
    finally:
        beat.cancel()
    progress()
    first = min((r.submitted for r in records), default=start)
    last = max((r.finished for r in records if r.finished is not None), default=first)
    return records, last - first


async def warm_up(backend: Backend, vocab_size: int, prompt_len: int = 64, requests: int = 4) -> None:
    """A few small requests so that first-call costs (allocations, lazy imports) stay out of runs."""
    with contextlib.suppress(BackendError):
        await asyncio.gather(
            *(
                backend.generate(
                    [3 + (i * 7 + j) % (vocab_size - 3) for j in range(prompt_len)],
                    4,
                    RequestRecord(prompt_len, 4, 0, time.perf_counter()),
                )
                for i in range(requests)
            )
        )
