"""How the scheduler reaches a worker: one long-lived ``Step`` stream, or the engine in-process.

Both links have the same interface, so the loop cannot tell them apart; the benchmark compares
them side by side. ``send`` may be called again before the previous step's ``recv`` (overlap):
results come back in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from services.common import step_codec, tls
from services.common.errors import Unavailable
from services.common.server import CHANNEL_OPTIONS
from services.common.step import LateMasks, StepRequest, StepResult, WorkerInfo
from strata.worker.v1 import worker_pb2 as wpb
from strata.worker.v1 import worker_pb2_grpc as wgrpc

# Steps in flight at once: 2 is enough for overlap (N running, N+1 queued).
MAX_IN_FLIGHT = 4


class WorkerGone(Unavailable):
    """The worker's stream broke; everything it held is lost."""


class WorkerLink(Protocol):
    info: WorkerInfo

    async def send(self, step: StepRequest) -> None:
        """Queue a step for execution (at most MAX_IN_FLIGHT unanswered)."""

    async def send_masks(self, masks: LateMasks) -> None:
        """Late bitmasks of the step that is waiting for them (sent right after the previous
        step's result was committed)."""

    async def recv(self) -> StepResult:
        """The result of the oldest unanswered step; raises WorkerGone if the worker died."""

    async def close(self) -> None: ...


class GrpcWorkerLink:
    """A worker over gRPC: ``GetInfo`` once, then one bidirectional ``Step`` stream."""

    def __init__(self, address: str, interceptors: list[Any] | None = None) -> None:
        self.address = address
        self._channel = tls.channel(address, CHANNEL_OPTIONS, interceptors)
        self._stub = wgrpc.WorkerStub(self._channel)
        self._outbox: asyncio.Queue[wpb.StepRequest | None] = asyncio.Queue(MAX_IN_FLIGHT)
        self._call: Any = None
        self.info: WorkerInfo

    async def connect(self, timeout_s: float = 10.0) -> WorkerInfo:
        try:
            info = await self._stub.GetInfo(wpb.GetInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise WorkerGone(f"worker {self.address} is not reachable: {e.details()}") from e
        self.info = step_codec.info_from_pb(info)
        self._call = self._stub.Step(self._requests())
        return self.info

    async def _requests(self) -> AsyncIterator[wpb.StepRequest]:
        while True:
            item = await self._outbox.get()
            if item is None:
                return
            yield item

    async def send(self, step: StepRequest) -> None:
        await self._outbox.put(step_codec.step_to_pb(step))

    async def send_masks(self, masks: LateMasks) -> None:
        await self._outbox.put(step_codec.late_masks_to_pb(masks))

    async def recv(self) -> StepResult:
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise WorkerGone(f"worker {self.address} failed: {e.code().name}: {e.details()}") from e
        if msg is grpc.aio.EOF:
            raise WorkerGone(f"worker {self.address} closed its step stream")
        return step_codec.result_from_pb(msg)

    async def close(self) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self._outbox.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        await self._channel.close()


class InProcessWorkerLink:
    """The worker engine in this process (for benchmarks and tests). One dedicated thread runs
    steps in order from a queue, so a step sent while the previous one runs starts the moment it
    ends (overlap works in-process too); results come back to the event loop in order."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.info: WorkerInfo = engine.info
        self._loop = asyncio.get_running_loop()
        self._todo: queue.Queue[StepRequest | None] = queue.Queue(MAX_IN_FLIGHT)
        self._masks: queue.Queue[LateMasks] = queue.Queue(MAX_IN_FLIGHT)
        self._done: asyncio.Queue[StepResult | BaseException] = asyncio.Queue()
        # Steps that were already queued when the worker finished the previous one (overlap
        # working: the worker never waited for the scheduler), out of all steps run.
        self.steps_ready = 0
        self.steps_run = 0
        self._thread = threading.Thread(target=self._serve, name="in-process-worker", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (step := self._todo.get()) is not None:
            try:
                out: StepResult | BaseException = self._engine.step(step, self._late_masks)
            except BaseException as e:  # handed to recv(), which raises it in the loop
                out = e
            self.steps_run += 1
            # Sampled before this result is posted: only a step sent ahead of it (overlap) counts.
            if not self._todo.empty():
                self.steps_ready += 1
            try:
                self._loop.call_soon_threadsafe(self._done.put_nowait, out)
            except RuntimeError:  # the event loop is gone: nobody is waiting for results
                return

    def _late_masks(self) -> LateMasks:
        return self._masks.get(timeout=60.0)

    async def send(self, step: StepRequest) -> None:
        await asyncio.to_thread(self._todo.put, step)

    async def send_masks(self, masks: LateMasks) -> None:
        await asyncio.to_thread(self._masks.put, masks)

    async def recv(self) -> StepResult:
        out = await self._done.get()
        if isinstance(out, BaseException):
            raise out
        return out

    async def close(self) -> None:
        await asyncio.to_thread(self._todo.put, None)
        await asyncio.to_thread(self._thread.join, 10.0)
