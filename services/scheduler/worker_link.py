"""How the scheduler reaches a worker: one long-lived ``Step`` stream, or the engine in-process.

Both links have the same interface, so the loop cannot tell them apart; the benchmark compares
them side by side. ``send`` may be called again before the previous step's ``recv`` (overlap):
results come back in order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from services.common import step_codec
from services.common.errors import Unavailable
from services.common.server import CHANNEL_OPTIONS
from services.common.step import StepRequest, StepResult, WorkerInfo
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

    async def recv(self) -> StepResult:
        """The result of the oldest unanswered step; raises WorkerGone if the worker died."""

    async def close(self) -> None: ...


class GrpcWorkerLink:
    """A worker over gRPC: ``GetInfo`` once, then one bidirectional ``Step`` stream."""

    def __init__(self, address: str, interceptors: list[Any] | None = None) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
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
    """The worker engine in this process (for benchmarks and tests): steps run in a thread so the
    event loop stays responsive, one at a time, in order."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.info: WorkerInfo = engine.info
        self._pending: asyncio.Queue[asyncio.Future[StepResult]] = asyncio.Queue(MAX_IN_FLIGHT)
        self._lock = asyncio.Lock()

    async def _run(self, step: StepRequest) -> StepResult:
        async with self._lock:
            return await asyncio.to_thread(self._engine.step, step)

    async def send(self, step: StepRequest) -> None:
        await self._pending.put(asyncio.ensure_future(self._run(step)))

    async def recv(self) -> StepResult:
        fut = await self._pending.get()
        return await fut

    async def close(self) -> None:
        while not self._pending.empty():
            self._pending.get_nowait().cancel()
