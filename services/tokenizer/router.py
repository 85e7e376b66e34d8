"""Choosing a scheduler for each request: a fixed address, or one of the discovered ones by a
policy (``kv_index``): ``kv`` routes to the replica whose cache holds most of the prompt, weighed
against its load, from each scheduler's ``WatchCache`` stream; ``least_load`` and ``round_robin``
ignore the cache.

Prefill/decode disaggregation: each scheduler registers a role (``both``, ``prefill``, ``decode``).
A new request goes to a replica that prefills (``prefill`` or ``both``), a continuation (after a
prefill replica's hand-over, or a resume) to one that decodes (``decode`` or ``both``); where no
replica has the role wanted, any serves.

With discovery the router follows every scheduler of the model: one ``WatchCache`` stream each,
started when it registers and dropped (with its pages) when its lease goes. A stream that breaks
or shows a gap clears that replica's pages and subscribes again (a new snapshot) after a short
backoff; meanwhile the replica is still routed to, by load only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from services.common import tls
from services.common.discovery import Discovery
from services.common.errors import Unavailable
from services.common.page_hash import PageKeying
from services.common.server import CHANNEL_OPTIONS
from services.tokenizer.kv_index import DEFAULT_LOAD_WEIGHT, Choice, Chooser, KvIndex, Policy
from services.tokenizer.session import SchedulerSession
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc

log = logging.getLogger(__name__)

SET_ASIDE_S = 5.0
WATCH_SYNC_S = 0.2  # how often the set of watched schedulers follows discovery
WATCH_RETRY_S = (0.1, 2.0)  # backoff of a broken WatchCache stream: first, most


@dataclass(slots=True)
class Ticket:
    """One request on a replica, for the router's own load accounting until the replica reports."""

    router: Router
    choice: Choice
    uncached: int
    started: bool = False
    done: bool = False

    def first_token(self) -> None:
        if not self.started and not self.done:
            self.started = True
            r = self.router.index.replicas.get(self.choice.address)
            if r is not None:
                r.sent_tokens = max(r.sent_tokens - self.uncached, 0)

    def finish(self) -> None:
        if self.done:
            return
        self.first_token()
        self.done = True
        r = self.router.index.replicas.get(self.choice.address)
        if r is not None:
            r.sent_running = max(r.sent_running - 1, 0)


class Router:
    def __init__(
        self,
        fixed: str = "",
        etcd: str = "",
        model: str = "",
        wait_s: float = 5.0,
        policy: Policy = "kv",
        load_weight: float = DEFAULT_LOAD_WEIGHT,
    ) -> None:
        self._fixed = fixed
        self._model = model
        self._wait_s = wait_s
        self._discovery = Discovery(etcd, "scheduler") if etcd and not fixed else None
        self._channels: dict[str, tuple[grpc.aio.Channel, sgrpc.SchedulerStub]] = {}
        self._sessions: dict[str, SchedulerSession] = {}
        self._aside: dict[str, float] = {}  # address -> until when other schedulers go first
        self.index = KvIndex()
        self.chooser = Chooser(self.index, policy, load_weight)
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._sync: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._discovery is not None:
            await self._discovery.start()
            self._sync = asyncio.create_task(self._follow(), name="router: follow schedulers")

    # -- following the schedulers' caches --------------------------------------------------------
    async def _follow(self) -> None:
        while True:
            live = set(self._addresses())
            for address in live - self._watches.keys():
                self._watches[address] = asyncio.create_task(self._watch(address), name=f"watch {address}")
            for address in self._watches.keys() - live:
                self._watches.pop(address).cancel()
                self.index.drop(address)
                session = self._sessions.pop(address, None)
                if session is not None:  # its requests resume elsewhere (or here, once it registers again)
                    await session.close(gone=True)
                log.info("scheduler %s left: dropped from the cache index", address)
            await asyncio.sleep(WATCH_SYNC_S)

    async def _watch(self, address: str) -> None:
        delay = WATCH_RETRY_S[0]
        while True:
            try:
                async for m in self.stub(address).WatchCache(spb.WatchCacheRequest()):
                    r = self.index.replica(address)
                    r.running = m.load.running
                    keying = PageKeying(m.keying.page_tokens, m.keying.model_fingerprint, m.keying.layout)
                    ok = self.index.apply(
                        address, epoch=m.epoch, event_id=m.event_id, snapshot=m.snapshot, stored=m.stored,
                        removed=m.removed, keying=keying if m.snapshot and m.keying.page_tokens else None,
                    )
                    if not ok:
                        log.info("scheduler %s: cache events out of order; asking for a snapshot", address)
                        break
                    delay = WATCH_RETRY_S[0]
            except grpc.aio.AioRpcError as e:
                self.index.unknown(address)
                log.debug("scheduler %s: cache stream ended (%s)", address, e.code().name)
            await asyncio.sleep(delay)
            delay = min(delay * 2, WATCH_RETRY_S[1])

    def _addresses(self, role: str = "") -> list[str]:
        """The schedulers of the model; with ``role``, those that serve it (if there are any)."""
        if self._fixed:
            return [self._fixed]
        assert self._discovery is not None
        model = self._model
        recs = [r for r in self._discovery.members().values() if not model or not r.model or r.model == model]
        serving = [r for r in recs if r.role in ("", "both", role)] if role else recs
        return sorted(r.address for r in (serving or recs))

    def addresses(self) -> list[str]:
        """Every scheduler of the model, whatever its role."""
        return self._addresses()

    def count(self) -> int:
        return len(self._addresses())

    def set_aside(self, address: str) -> None:
        """Prefer other schedulers for ``SET_ASIDE_S`` (one just failed to answer)."""
        self._aside[address] = time.monotonic() + SET_ASIDE_S

    async def pick(
        self, exclude: set[str] | frozenset[str] = frozenset(), tokens: Sequence[int] = (), salt: str = "",
        role: str = "",
    ) -> tuple[Ticket, SchedulerSession]:
        """A scheduler for a request of ``tokens`` (its prompt) by the policy, among those not in
        ``exclude`` and not set aside (unless all are), serving ``role`` where one does; waits up to
        ``wait_s`` for one to register, then raises UNAVAILABLE. Call ``Ticket.first_token`` and
        ``Ticket.finish`` as it runs. Returns the ticket and the session (one multiplexed stream) to
        submit the request on."""
        deadline = time.monotonic() + self._wait_s
        while not (addresses := [a for a in self._addresses(role) if a not in exclude]):
            if time.monotonic() > deadline:
                raise Unavailable(f"no scheduler registered within {self._wait_s:g}s")
            await asyncio.sleep(0.1)
        now = time.monotonic()
        fresh = [a for a in addresses if self._aside.get(a, 0.0) <= now] or addresses
        choice = self.chooser.choose(fresh, tokens, salt, time.monotonic())
        r = self.index.replica(choice.address)
        uncached = len(tokens) - choice.overlap_tokens
        r.sent_tokens += uncached
        r.sent_running += 1
        return Ticket(self, choice, uncached), self.session(choice.address)

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

    def session(self, address: str) -> SchedulerSession:
        """The open session with ``address`` (a new one after the last broke)."""
        s = self._sessions.get(address)
        if s is None or s.broken:
            s = self._sessions[address] = SchedulerSession(self.stub(address), address)
        return s

    def stub(self, address: str) -> sgrpc.SchedulerStub:
        if address not in self._channels:
            # No tracing interceptor: the tokenizer opens its own CLIENT span per Generate call.
            channel = tls.channel(address, CHANNEL_OPTIONS)
            self._channels[address] = (channel, sgrpc.SchedulerStub(channel))
        return self._channels[address][1]

    async def close(self) -> None:
        tasks = [t for t in (self._sync, *self._watches.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for s in self._sessions.values():
            await s.close()
        if self._discovery is not None:
            await self._discovery.stop()
        for channel, _ in self._channels.values():
            await channel.close()
