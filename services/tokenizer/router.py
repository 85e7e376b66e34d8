"""Choosing a scheduler for each request: a fixed address, or round-robin over discovered ones."""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc

from services.common import tls
from services.common.discovery import Discovery
from services.common.errors import Unavailable
from services.common.server import CHANNEL_OPTIONS
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc

SET_ASIDE_S = 5.0


class Router:
    def __init__(self, fixed: str = "", etcd: str = "", model: str = "", wait_s: float = 5.0) -> None:
        self._fixed = fixed
        self._model = model
        self._wait_s = wait_s
        self._discovery = Discovery(etcd, "scheduler") if etcd and not fixed else None
        self._channels: dict[str, tuple[grpc.aio.Channel, sgrpc.SchedulerStub]] = {}
        self._rr = itertools.count()
        self._aside: dict[str, float] = {}  # address -> until when other schedulers go first

    async def start(self) -> None:
        if self._discovery is not None:
            await self._discovery.start()

    def _addresses(self) -> list[str]:
        if self._fixed:
            return [self._fixed]
        assert self._discovery is not None
        recs = self._discovery.members().values()
        return sorted(r.address for r in recs if not self._model or not r.model or r.model == self._model)

    def count(self) -> int:
        return len(self._addresses())

    def set_aside(self, address: str) -> None:
        """Prefer other schedulers for ``SET_ASIDE_S`` (one just failed to answer)."""
        self._aside[address] = time.monotonic() + SET_ASIDE_S

    async def pick(self, exclude: set[str] | frozenset[str] = frozenset()) -> tuple[str, sgrpc.SchedulerStub]:
        """Round-robin over the schedulers not in ``exclude``, those set aside last; waits up to
        ``wait_s`` for one to register, then raises UNAVAILABLE."""
        deadline = time.monotonic() + self._wait_s
        while not (addresses := [a for a in self._addresses() if a not in exclude]):
            if time.monotonic() > deadline:
                raise Unavailable(f"no scheduler registered within {self._wait_s:g}s")
            await asyncio.sleep(0.1)
        now = time.monotonic()
        fresh = [a for a in addresses if self._aside.get(a, 0.0) <= now] or addresses
        address = fresh[next(self._rr) % len(fresh)]
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
            channel = tls.channel(address, CHANNEL_OPTIONS)
            self._channels[address] = (channel, sgrpc.SchedulerStub(channel))
        return self._channels[address][1]

    async def close(self) -> None:
        if self._discovery is not None:
            await self._discovery.stop()
        for channel, _ in self._channels.values():
            await channel.close()
