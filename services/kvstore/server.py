"""The kvstore's gRPC face: a thin adapter from ``strata.kvstore.v1.KVStore`` to a ``Backend``.

Run in-process (``build_server`` / ``serve``, as tests and the supervisor do) or as a process:
``python -m services.kvstore.server --port 50061 --capacity-bytes 1073741824``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar, cast

import grpc
from prometheus_client import CollectorRegistry

from services.common import telemetry
from services.common.discovery import Registration as EtcdRegistration
from services.common.discovery import ServiceRecord, advertised_address
from services.common.errors import InvalidArgument
from services.common.metrics import MetricFactory, serve_metrics
from services.common.server import Server, run_service
from services.kvstore.backends import Backend, FileBackend, MemoryBackend, check_keys
from services.kvstore.config import KVStoreConfig
from strata.kvstore.v1 import kvstore_pb2 as pb
from strata.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name

# Get fetches this many pages from the backend at a time, so a huge Get never holds more than
# one group of pages (plus one outgoing message) in memory at once.
_FETCH_GROUP = 32

R = TypeVar("R")

# What ``serve`` enters once the port is bound and exits before the server stops: the lead wires
# etcd registration (cfg.etcd, cfg.instance_id) and metrics (cfg.metrics_port) in through it.
Registration = Callable[[KVStoreConfig, int], AbstractAsyncContextManager[Any]]


def make_backend(cfg: KVStoreConfig) -> Backend:
    if cfg.backend == "file":
        return FileBackend(cfg.path, cfg.capacity_bytes, max_page_bytes=cfg.max_page_bytes)
    return MemoryBackend(cfg.capacity_bytes, max_page_bytes=cfg.max_page_bytes)


def _pages_from_pb(request: pb.PutRequest) -> list[tuple[bytes, bytes]]:
    return [(page.key, page.data) for page in request.pages]


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """Converts messages to backend calls and back; all policy lives in the backend.

    Put is two-phase per message: gRPC hands over a batch only once it is fully received, and the
    whole batch is validated and then committed in one backend call, so a reader never sees part
    of a page. A stream that fails at batch k keeps batches 0..k-1 (they were complete) and
    stores nothing of batch k.
    """

    def __init__(self, backend: Backend, batch_bytes: int) -> None:
        self.backend = backend
        self._batch_bytes = batch_bytes

    async def _call(self, fn: Callable[..., R], *args: Any) -> R:
        # A disk backend must not stall every other RPC on the event loop.
        if self.backend.blocking:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def Put(self, request_iterator: AsyncIterator[pb.PutRequest], context: Any) -> pb.PutResponse:
        stored = evicted = 0
        batch_index = 0
        async for request in request_iterator:
            try:
                result = await self._call(self.backend.put_many, _pages_from_pb(request))
            except InvalidArgument as e:
                raise InvalidArgument(f"Put batch {batch_index}: {e}; earlier batches were stored") from e
            stored += result.stored
            evicted += result.evicted
            batch_index += 1
        return pb.PutResponse(stored=stored, evicted=evicted)

    async def Get(self, request: pb.GetRequest, context: Any) -> AsyncIterator[pb.GetResponse]:
        keys: Sequence[bytes] = request.keys
        check_keys(keys)
        response, size = pb.GetResponse(), 0
        for start in range(0, len(keys), _FETCH_GROUP):
            group = keys[start : start + _FETCH_GROUP]
            for key, data in zip(group, await self._call(self.backend.get_many, list(group)), strict=True):
                page_size = len(key) + (len(data) if data is not None else 0)
                # Flush before overflowing, so a message holds at most max(batch_bytes, one page).
                if size and size + page_size > self._batch_bytes:
                    yield response
                    response, size = pb.GetResponse(), 0
                if data is None:
                    response.pages.add(key=key)
                else:
                    response.pages.add(key=key, data=data)
                response.found.append(data is not None)
                size += page_size
        if response.pages:
            yield response

    async def Exists(self, request: pb.ExistsRequest, context: Any) -> pb.ExistsResponse:
        check_keys(request.keys)
        flags = await self._call(self.backend.present, list(request.keys))
        count = next((i for i, f in enumerate(flags) if not f), len(flags))
        return pb.ExistsResponse(count=count, present=flags if request.each else [])

    async def Delete(self, request: pb.DeleteRequest, context: Any) -> pb.DeleteResponse:
        check_keys(request.keys)
        return pb.DeleteResponse(deleted=await self._call(self.backend.delete_many, list(request.keys)))

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        s = self.backend.stats()
        return pb.StatsResponse(
            used_bytes=s.used_bytes,
            capacity_bytes=s.capacity_bytes,
            pages=s.pages,
            hits=s.hits,
            misses=s.misses,
            evictions=s.evictions,
            backend=s.backend,
        )


def build_server(
    cfg: KVStoreConfig, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
) -> tuple[Server, KVStoreServicer]:
    """A server with the KVStore service registered, not yet started."""
    servicer = KVStoreServicer(make_backend(cfg), cfg.batch_bytes)
    server = Server(interceptors)
    server.add(pb_grpc.add_KVStoreServicer_to_server, servicer, SERVICE_NAME)
    return server, servicer


def backend_gauges(m: MetricFactory, backend: Backend) -> None:
    """Gauges read from the backend's own counters at scrape time (the kvstore's, and a worker's
    hand-over outbox)."""
    fields = {
        "used_bytes": "Bytes of page data held.",
        "capacity_bytes": "Configured byte cap.",
        "pages": "Pages held.",
        "hits": "Pages found by Get since start.",
        "misses": "Pages missing in Get since start.",
        "evictions": "Pages evicted since start.",
    }
    for name, doc in fields.items():
        m.gauge(name, doc).set_function(lambda name=name: float(getattr(backend.stats(), name)))  # type: ignore[misc]


@contextlib.asynccontextmanager
async def etcd_registration(cfg: KVStoreConfig, port: int) -> AsyncIterator[None]:
    """Publish this shard under ``/strata/v1/services/kvstore/<id>`` for as long as it serves."""
    address = advertised_address(cfg.host, port, cfg.advertise_host)
    capacity = {"capacity_bytes": cfg.capacity_bytes, "backend": cfg.backend}
    record = ServiceRecord("kvstore", cfg.instance_id or f"kvstore-{port}", address, capacity=capacity)
    async with EtcdRegistration(cfg.etcd, record):
        yield


async def serve(cfg: KVStoreConfig, stop: asyncio.Event, registration: Registration | None = None) -> None:
    """Serve until ``stop`` is set, then stop gracefully. ``registration`` (see ``Registration``)
    is entered after the port is bound and exited before the server stops; by default the shard
    registers in etcd when ``cfg.etcd`` is set."""
    if registration is None and cfg.etcd:
        registration = etcd_registration
    exporter = cast(Any, cfg.trace_exporter)
    telemetry.setup_tracing("kvstore", exporter, cfg.trace_target.replace("{service}", "kvstore"))
    server, servicer = build_server(cfg, telemetry.server_interceptors())
    registry = CollectorRegistry()
    backend_gauges(MetricFactory(registry, "kvstore"), servicer.backend)
    metrics = serve_metrics(cfg.metrics_port, cfg.host, registry)
    port = await server.start(f"{cfg.host}:{cfg.port}")
    log.info("kvstore serving on %s:%d (%s, %d bytes)", cfg.host, port, cfg.backend, cfg.capacity_bytes)
    try:
        async with registration(cfg, port) if registration else contextlib.nullcontext():
            # The supervisor (`strata up`) waits for this line on stdout.
            print(f"READY kvstore {cfg.host}:{port}{metrics}", flush=True)
            await stop.wait()
    finally:
        await server.stop()
        telemetry.shutdown_tracing()


def main(argv: Sequence[str] | None = None) -> None:
    run_service("kvstore", KVStoreConfig, serve, argv)


if __name__ == "__main__":
    main()
