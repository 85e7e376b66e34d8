"""Building and running a Strata gRPC server: interceptors, health, reflection, clean shutdown."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import config, heap_trace, tls
from services.common.errors import ErrorInterceptor

log = logging.getLogger(__name__)

C = TypeVar("C")

# Pages travel in batches of several MiB; keep headroom over the largest batch we send.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Every Strata channel pings every KEEPALIVE_MS, with or without calls in flight, and every Strata
# server accepts pings that often: the two policies must agree, or a server answers an idle
# stream's pings with GOAWAY "too_many_pings" (gRPC servers by default accept one ping per
# 5 minutes without data) and the link drops after a pause. The variable exists for tests.
KEEPALIVE_MS = int(os.environ.get("STRATA_GRPC_KEEPALIVE_MS", "10000"))
_KEEPALIVE: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", max(KEEPALIVE_MS // 2, 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_time_between_pings_ms", KEEPALIVE_MS),
]
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *_KEEPALIVE,
    # A restarted peer is reached within a second, not after backoff grown to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# No SO_REUSEPORT: gRPC sets it by default, which lets a second server bind a port in use and
# share its traffic silently; without it a taken port is an error at start.
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    *_KEEPALIVE,
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]


class Server:
    """A grpc.aio server with Strata's interceptors, health and reflection.

    ``add`` registers a servicer with its generated ``add_XServicer_to_server`` function and the
    full service name (for health and reflection); ``start`` binds and returns the port.
    """

    def __init__(
        self,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
        client_auth: bool = True,
        reuse_port: bool = False,
    ) -> None:
        """``max_receive_bytes``: larger requests get RESOURCE_EXHAUSTED from gRPC before any
        handler runs (the public port takes far less than the page batches between services).
        ``client_auth``: with TLS configured, require a client certificate from the services' CA
        (internal ports); the public port takes users, who bring API keys instead. ``reuse_port``:
        bind with ``SO_REUSEPORT``, to share the port with the other processes of one service
        (the caller checks first that nothing else holds it)."""
        self._client_auth = client_auth
        # Telemetry first so error statuses are recorded on the span; errors innermost.
        options = [*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_receive_bytes)]
        if reuse_port:
            options = [o for o in options if o[0] != "grpc.so_reuseport"] + [("grpc.so_reuseport", 1)]
        self._server = grpc.aio.server(interceptors=[*interceptors, ErrorInterceptor()], options=options)
        self._health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._names: list[str] = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]

    def add(self, add_fn: Callable[[Any, grpc.aio.Server], None], servicer: Any, full_name: str) -> None:
        add_fn(servicer, self._server)
        self._names.append(full_name)

    async def start(self, address: str) -> int:
        reflection.enable_server_reflection([*self._names, reflection.SERVICE_NAME], self._server)
        creds = tls.server_credentials(self._client_auth)
        port = self._server.add_secure_port(address, creds) if creds else self._server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind {address}")
        await self._server.start()
        await self.set_serving(True)
        return port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._names]:
            result = self._health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.set_serving(False)
        await self._server.stop(grace_s)

    async def wait(self) -> None:
        await self._server.wait_for_termination()


EVENT_LOOPS = ("uvloop", "asyncio")  # what STRATA_EVENT_LOOP may name; the first is the default


def event_loop() -> str:
    """The event loop ``STRATA_EVENT_LOOP`` names (unchecked: ``run_service`` refuses others)."""
    return os.environ.get("STRATA_EVENT_LOOP", EVENT_LOOPS[0])


def run_loop(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``main()`` to completion on the event loop ``STRATA_EVENT_LOOP`` names: ``uvloop`` (the
    default; libuv's loop, the one uvicorn and vLLM's API server run on) or ``asyncio`` (the
    standard library's). Every streamed token is a few loop callbacks in each process it crosses:
    a bare grpc.aio stream cost ~3 µs less of CPU per message on uvloop (docs/benchmarks.md, "the
    frameworks' own floors")."""
    if event_loop() == "asyncio":
        asyncio.run(main())
    else:
        uvloop.run(main())


def settle_heap() -> None:
    """Call once start-up is done: move every object alive now (modules, weights, tokenizer
    tables: hundreds of thousands) out of the garbage collector's reach. Each full collection
    walked all of them again, ~0.1 s at a time, on a token path that allocates per step."""
    gc.collect()
    gc.freeze()


def install_stop_signals(stop: asyncio.Event) -> None:
    """Set ``stop`` on SIGINT / SIGTERM (the supervisor and compose send SIGTERM)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


def setup_logging(service: str, level: str = "info") -> None:
    """Structured-enough logs: one line per event, with time, service and logger."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )


def run_service(
    name: str, cfg_cls: type[C], serve: Callable[[C, asyncio.Event], Awaitable[None]], argv: Sequence[str] | None
) -> None:
    """The ``main`` of every service: flags (or ``--config FILE``) → frozen config → logs → serve
    until SIGINT / SIGTERM. A bad configuration exits with status 2 and a message naming the key."""
    parser = argparse.ArgumentParser(prog=f"strata serve {name}")
    config.add_arguments(parser, cfg_cls)
    loop = event_loop()
    if loop not in EVENT_LOOPS:
        parser.error(f"STRATA_EVENT_LOOP: {loop!r} is not one of {', '.join(EVENT_LOOPS)}")
    try:
        cfg = config.from_args(cfg_cls, parser.parse_args(argv))
    except config.ConfigError as e:
        parser.error(str(e))
    try:
        files = [getattr(cfg, f"tls_{k}", "") for k in ("cert", "key", "ca")]
        tls.configure(tls.TlsFiles(*files))
    except config.ConfigError as e:
        parser.error(str(e))
    for key in ("model", "tokenizer"):  # the model directory a service loads (scheduler: --tokenizer)
        spec = next((f for f in dataclasses.fields(cfg) if f.name == key), None)  # type: ignore[arg-type]
        if spec is None or "directory" not in spec.metadata.get("help", ""):
            continue  # e.g. the scheduler's --model, a model name
        value = getattr(cfg, key, "")
        problem = config.model_dir_problem(value) if isinstance(value, str) and value else None
        if problem:
            parser.error(f"{key}: {problem}")
    setup_logging(name, getattr(cfg, "log_level", "info"))
    heap_trace.start_from_environment(name)

    async def run() -> None:
        stop = asyncio.Event()
        install_stop_signals(stop)
        await serve(cfg, stop)

    run_loop(run)
