"""The worker's connection to the kvstore shards (L3), usable from the engine's thread.

The engine runs steps in a worker thread; the shards are reached with grpc.aio on the event loop
that called ``start``. ``KVStorePort`` hands each put or get to that loop and returns a
``concurrent.futures.Future`` the engine waits on after its forward pass. Shards come from etcd
(a ``Discovery``) or a fixed address list; keys are placed by rendezvous hashing
(``ShardedKVStore``): a shard that is down or missing reads as a miss and a put to it is skipped,
never an error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence

from services.common.discovery import Discovery
from services.kvstore.sharded import MembershipSource, ShardedKVStore


class KVStorePort:
    """Implements ``host_ops.L3Port``. ``shards``: an etcd endpoint ("host:port", discovered), a
    list of kvstore addresses, or any membership source. Call ``start`` and ``close`` on the
    event loop that should carry the transfers."""

    def __init__(self, shards: str | Sequence[str] | MembershipSource, timeout_s: float = 5.0) -> None:
        self._discovery = Discovery(shards, "kvstore") if isinstance(shards, str) else None
        source: MembershipSource | Sequence[str] = (
            self._discovery if self._discovery is not None
            else shards if not isinstance(shards, Sequence) else list(shards)
        )
        self._store = ShardedKVStore(source, timeout_s=timeout_s)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._discovery is not None:
            await self._discovery.start()

    async def close(self) -> None:
        await self._store.close()
        if self._discovery is not None:
            await self._discovery.stop()
        self._loop = None

    def put(self, pages: list[tuple[bytes, bytes]]) -> concurrent.futures.Future[int]:
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
