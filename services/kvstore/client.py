"""The client other services import to reach a kvstore: pages in, pages out, batched.

Every method raises ``KVStoreUnavailable`` when the store cannot be reached (down, unreachable,
too slow for the deadline); callers treat that as a miss and recompute, never as a failure of the
request. Other refusals (a bad key, an oversize page) raise ``KVStoreError`` with the status code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from types import TracebackType

import grpc

from services.common import telemetry, tls
from services.common.server import CHANNEL_OPTIONS
from services.kvstore.backends import BackendStats, PutResult
from strata.kvstore.v1 import kvstore_pb2 as pb
from strata.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

DEFAULT_BATCH_BYTES = 4 * 1024 * 1024

# Statuses that mean "the store is not there right now", as opposed to "the store said no".
_UNAVAILABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class KVStoreError(Exception):
    """The store refused a call; ``code`` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"kvstore {code.name}: {message}")
        self.code = code


class KVStoreUnavailable(KVStoreError):
    """The store could not be reached in time; treat as a miss."""


def _translate(e: grpc.aio.AioRpcError, address: str) -> KVStoreError:
    code = e.code()
    if code in _UNAVAILABLE_CODES:
        return KVStoreUnavailable(code, f"{address}: {e.details()}")
    return KVStoreError(code, e.details() or "")


Pages = Sequence[tuple[bytes, bytes]]


def batch_pages(pages: Pages, batch_bytes: int) -> Iterator[list[tuple[bytes, bytes]]]:
    """Split pages, in order, into batches of at most ``batch_bytes`` (key + data bytes); a page
    larger than ``batch_bytes`` travels alone. Empty input yields nothing."""
    batch: list[tuple[bytes, bytes]] = []
    size = 0
    for key, data in pages:
        page_size = len(key) + len(data)
        if batch and size + page_size > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append((key, data))
        size += page_size
    if batch:
        yield batch


class KVStoreClient:
    """One grpc.aio channel to one kvstore. Use ``async with`` or call ``close``.

    ``timeout_s`` is the deadline of each call (a whole Put or Get stream included).
    """

    def __init__(self, address: str, *, batch_bytes: int = DEFAULT_BATCH_BYTES, timeout_s: float = 30.0) -> None:
        if batch_bytes < 1:
            raise ValueError(f"batch_bytes must be >= 1, got {batch_bytes}")
        self.address = address
        self._batch_bytes = batch_bytes
        self._timeout_s = timeout_s
        self._channel = tls.channel(address, CHANNEL_OPTIONS, telemetry.client_interceptors())
        self._stub = pb_grpc.KVStoreStub(self._channel)

    async def put(self, pages: Pages) -> PutResult:
        """Store pages, many per message; returns how many were stored and evicted. Pages in
        batches sent before a failure stay stored."""

        async def requests() -> AsyncIterator[pb.PutRequest]:
            for batch in batch_pages(pages, self._batch_bytes):
                yield pb.PutRequest(pages=[pb.Page(key=k, data=d) for k, d in batch])

        try:
            response = await self._stub.Put(requests(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, self.address) from e
        return PutResult(response.stored, response.evicted)

    async def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The data of each key in order, None where missing."""
        if not keys:
            return []
        out: list[bytes | None] = []
        try:
            async for response in self._stub.Get(pb.GetRequest(keys=keys), timeout=self._timeout_s):
                for page, found in zip(response.pages, response.found, strict=True):
                    out.append(page.data if found else None)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, self.address) from e
        if len(out) != len(keys):
            raise KVStoreError(grpc.StatusCode.INTERNAL, f"asked for {len(keys)} pages, got {len(out)}")
        return out

    async def exists(self, keys: Sequence[bytes]) -> int:
        """How many keys, from the first, the store holds without a gap."""
        try:
            response = await self._stub.Exists(pb.ExistsRequest(keys=keys), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, self.address) from e
        return response.count

    async def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored."""
        try:
            response = await self._stub.Exists(pb.ExistsRequest(keys=keys, each=True), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, self.address) from e
        if len(response.present) != len(keys):
            raise KVStoreError(grpc.StatusCode.INTERNAL, f"asked about {len(keys)} keys, got {len(response.present)}")
        return list(response.present)

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Remove pages (missing keys are ignored); returns how many were removed."""
        try:
            response = await self._stub.Delete(pb.DeleteRequest(keys=keys), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, self.address) from e
        return response.deleted

    async def stats(self) -> BackendStats:
        try:
            s = await self._stub.Stats(pb.StatsRequest(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, self.address) from e
        return BackendStats(s.used_bytes, s.capacity_bytes, s.pages, s.hits, s.misses, s.evictions, s.backend)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
