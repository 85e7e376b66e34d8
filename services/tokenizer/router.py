"""Choosing a scheduler for each request: a fixed address, or round-robin over discovered ones."""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc

from services.common.discovery import Discovery
from services.common.errors import Unavailable
from services.common.server import CHANNEL_OPTIONS
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc


class Router:
    def __init__(self, fixed: str = "", etcd: str = "", model: str = "", wait_s: float = 30.0) -> None:
        self._fixed = fixed
        self._model = model
        self._wait_s = wait_s
        self._discovery = Discovery(etcd, "scheduler") if etcd and not fixed else None
        self._channels: dict[str, tuple[grpc.aio.Channel, sgrpc.SchedulerStub]] = {}
        self._rr = itertools.count()

    async def start(self) -> None:
        if self._discovery is not None:
            await self._discovery.start()

    def _addresses(self) -> list[str]:
        if self._fixed:
            return [self._fixed]
        assert self._discovery is not None
        recs = self._discovery.members().values()
        return sorted(r.address for r in recs if not self._model or not r.model or r.model == self._model)

    async def pick(self) -> tuple[str, sgrpc.SchedulerStub]:
        deadline = time.monotonic() + self._wait_s
        while not (addresses := self._addresses()):
            if time.monotonic() > deadline:
                raise Unavailable(f"no scheduler registered within {self._wait_s:.0f}s")
            await asyncio.sleep(0.2)
        address = addresses[next(self._rr) % len(addresses)]
        return address, self.stub(address)

    async def ready(self, timeout_s: float = 1.0) -> bool:
        """Whether some scheduler answers with at least one worker connected (``/health``)."""
        for address in self._addresses():
            try:
                load = await self.stub(address).GetLoad(spb.GetLoadRequest(), timeout=timeout_s)
            except grpc.aio.AioRpcError:
                continue
            if load.workers > 0:
                return True
        return False

    def stub(self, address: str) -> sgrpc.SchedulerStub:
        if address not in self._channels:
            # No tracing interceptor: the tokenizer opens its own CLIENT span per Generate call.
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = (channel, sgrpc.SchedulerStub(channel))
        return self._channels[address][1]

    async def close(self) -> None:
        if self._discovery is not None:
            await self._discovery.stop()
        for channel, _ in self._channels.values():
            await channel.close()
