"""The worker's connection to L3 (the kvstore shards and the hand-over outboxes), usable from the
engine's thread.

The engine runs steps in a worker thread; the shards are reached with grpc.aio on the event loop
that called ``start``. ``KVStorePort`` hands each put or get to that loop and returns a
``concurrent.futures.Future`` the engine waits on after its forward pass. Shards come from etcd
(an ``L3Store``: reads ask the registered outboxes first) or a fixed address list; keys are placed
by rendezvous hashing (``ShardedKVStore``): a shard that is down or missing reads as a miss and a
put to it is skipped, never an error.

``outbox``: this worker hands over directly (``--outbox-bytes``, ``services.kvstore.outbox``): its
puts go into that local store, synchronously (a copy under its lock; the bytes were snapshotted
by the op), and never to the shards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence

from services.kvstore.backends import Backend
from services.kvstore.outbox import L3Store
from services.kvstore.sharded import MembershipSource, ShardedKVStore


class KVStorePort:
    """Implements ``host_ops.L3Port``. ``shards``: an etcd endpoint ("host:port", discovered), a
    list of kvstore addresses, or any membership source. Call ``start`` and ``close`` on the
    event loop that should carry the transfers."""

    def __init__(
        self, shards: str | Sequence[str] | MembershipSource, timeout_s: float = 5.0, outbox: Backend | None = None
    ) -> None:
        if isinstance(shards, str):
            self._store = L3Store.from_etcd(shards, timeout_s=timeout_s)
        else:
            source = shards if not isinstance(shards, Sequence) else list(shards)
            self._store = L3Store(ShardedKVStore(source, timeout_s=timeout_s))
        self.outbox = outbox
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._store.start()

    async def close(self) -> None:
        await self._store.close()
        self._loop = None

    def put(self, pages: list[tuple[bytes, bytes]]) -> concurrent.futures.Future[int]:
        if self.outbox is not None:
            done: concurrent.futures.Future[int] = concurrent.futures.Future()
            try:
                done.set_result(self.outbox.put_many(pages).stored)
            except Exception as e:  # a page larger than the whole outbox: a failed job, as a refused put
                done.set_exception(e)
            return done
        return asyncio.run_coroutine_threadsafe(self._put(pages), self._running())

    def get(self, keys: list[bytes]) -> concurrent.futures.Future[list[bytes | None]]:
        return asyncio.run_coroutine_threadsafe(self._store.get(keys), self._running())

    def _running(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("KVStorePort used before start() (or after close())")
        return self._loop

    async def _put(self, pages: list[tuple[bytes, bytes]]) -> int:
        r = await self._store.put(pages)
        return len(pages) - r.skipped
