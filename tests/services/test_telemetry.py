"""Trace propagation across chained grpc.aio servers (client -> A -> B) with the file exporter."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from services.common import telemetry
from services.common.metrics import MetricFactory, render, start_metrics_server
from services.common.telemetry import (
    build_tracer_provider,
    client_interceptors,
    extract_context,
    get_tracer,
    inject_context,
    server_interceptors,
    setup_tracing,
    shutdown_tracing,
)

SERVICE = "strata.test.Echo"
UNARY, SERVER_STREAM, BIDI = (f"/{SERVICE}/{m}" for m in ("Unary", "ServerStream", "Bidi"))


def _echo_handler(downstream: grpc.aio.Channel | None) -> grpc.GenericRpcHandler:
    """Bytes-in, bytes-out echo; with a downstream channel every call is relayed to the next server."""

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if downstream is not None:
            reply: bytes = await downstream.unary_unary(UNARY)(request)
            return reply
        return b"B:" + request

    async def server_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if downstream is not None:
            async for reply in downstream.unary_stream(SERVER_STREAM)(request):
                yield reply
        else:
            for i in range(3):
                yield b"B:" + request + str(i).encode()

    async def bidi(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if downstream is not None:
            async for reply in downstream.stream_stream(BIDI)(requests):
                yield reply
        else:
            async for request in requests:
                yield b"B:" + request

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        },
    )


class Chain:
    """client -> A -> B, each side with its own provider ("client", "svc-a", "svc-b") and one span file."""

    def __init__(self, span_file: Path) -> None:
        self.span_file = span_file
        self.providers: dict[str, TracerProvider] = {}
        for name in ("client", "svc-a", "svc-b"):
            provider = build_tracer_provider(name, "file", str(span_file))
            assert provider is not None
            self.providers[name] = provider
        self._servers: list[grpc.aio.Server] = []
        self._channels: list[grpc.aio.Channel] = []

    async def _serve(self, name: str, downstream: grpc.aio.Channel | None) -> str:
        server = grpc.aio.server(interceptors=server_interceptors(self.providers[name]))
        server.add_generic_rpc_handlers((_echo_handler(downstream),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._servers.append(server)
        return f"127.0.0.1:{port}"

    def _channel(self, target: str, name: str) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(target, interceptors=client_interceptors(self.providers[name]))
        self._channels.append(channel)
        return channel

    async def start(self) -> grpc.aio.Channel:
        addr_b = await self._serve("svc-b", None)
        addr_a = await self._serve("svc-a", self._channel(addr_b, "svc-a"))
        return self._channel(addr_a, "client")

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        for server in self._servers:
            await server.stop(grace=None)
        for provider in self.providers.values():
            provider.shutdown()


def _read_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


async def _wait_spans(path: Path, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while len(spans := _read_spans(path)) < count:
        if time.monotonic() > deadline:
            pytest.fail(f"expected {count} spans in {path}, found {len(spans)}: {spans}")
        await asyncio.sleep(0.02)
    return spans


def _assert_one_chained_trace(spans: list[dict[str, Any]], method: str) -> None:
    """The four spans of one call: client CLIENT -> A SERVER -> A CLIENT -> B SERVER, one trace id."""
    assert len(spans) == 4, spans
    assert len({s["trace_id"] for s in spans}) == 1, "every hop shares the request's trace id"
    by_role = {(s["service"], s["kind"]): s for s in spans}
    chain = [("client", "CLIENT"), ("svc-a", "SERVER"), ("svc-a", "CLIENT"), ("svc-b", "SERVER")]
    assert set(by_role) == set(chain), spans
    assert by_role[chain[0]]["parent_id"] is None
    for parent, child in itertools.pairwise(chain):
        assert by_role[child]["parent_id"] == by_role[parent]["span_id"], (parent, child)
    assert all(s["name"] == method for s in spans)
    assert all(s["status"] != "ERROR" for s in spans)
    assert all(s["end_ns"] >= s["start_ns"] for s in spans)


@pytest.fixture
def span_file(tmp_path: Path) -> Path:
    return tmp_path / "spans.jsonl"


def _run_chain(span_file: Path, call: Any) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        chain = Chain(span_file)
        try:
            channel = await chain.start()
            await call(channel)
            return await _wait_spans(span_file, 4)
        finally:
            await chain.close()

    return asyncio.run(main())


def test_unary_call_is_one_trace_across_hops(span_file: Path) -> None:
    async def call(channel: grpc.aio.Channel) -> None:
        assert await channel.unary_unary(UNARY)(b"hi") == b"B:hi"

    _assert_one_chained_trace(_run_chain(span_file, call), UNARY)


def test_server_stream_is_one_trace_across_hops(span_file: Path) -> None:
    async def call(channel: grpc.aio.Channel) -> None:
        replies = [r async for r in channel.unary_stream(SERVER_STREAM)(b"s")]
        assert replies == [b"B:s0", b"B:s1", b"B:s2"]

    _assert_one_chained_trace(_run_chain(span_file, call), SERVER_STREAM)


def test_bidi_stream_is_one_trace_across_hops(span_file: Path) -> None:
    async def call(channel: grpc.aio.Channel) -> None:
        # write()/read() on the client (the worker's Step style); A relays B with a request iterator.
        stream = channel.stream_stream(BIDI)()
        replies = []
        for msg in (b"x", b"y", b"z"):
            await stream.write(msg)
            replies.append(await stream.read())
        await stream.done_writing()
        assert await stream.read() == grpc.aio.EOF
        assert replies == [b"B:x", b"B:y", b"B:z"]

    _assert_one_chained_trace(_run_chain(span_file, call), BIDI)


def test_inject_extract_round_trip(span_file: Path) -> None:
    provider = build_tracer_provider("svc-a", "file", str(span_file))
    assert provider is not None
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("request") as span:
        carrier = inject_context()
    assert set(carrier) >= {"traceparent"}
    ctx = extract_context(carrier)
    remote = trace.get_current_span(ctx).get_span_context()
    assert remote.trace_id == span.get_span_context().trace_id
    assert remote.span_id == span.get_span_context().span_id
    with tracer.start_as_current_span("step", context=ctx):
        pass
    provider.shutdown()
    spans = {s["name"]: s for s in _read_spans(span_file)}
    assert spans["step"]["trace_id"] == spans["request"]["trace_id"]
    assert spans["step"]["parent_id"] == spans["request"]["span_id"]
    assert extract_context({}) is not None and not trace.get_current_span(extract_context({})).is_recording()
    assert inject_context() == {}, "no span active: nothing to carry"


@pytest.fixture
def installed() -> Iterator[None]:
    yield
    shutdown_tracing()


def test_setup_tracing_file_and_none(span_file: Path, installed: None) -> None:
    tracer = get_tracer("strata.test")  # taken before setup: must follow the later install
    assert not telemetry.tracing_enabled()
    assert server_interceptors() == [] and client_interceptors() == []
    with tracer.start_as_current_span("off") as span:
        assert not span.is_recording()

    setup_tracing("svc-x", "file", str(span_file))
    assert telemetry.tracing_enabled()
    assert len(server_interceptors()) == 1 and len(client_interceptors()) == 4
    with tracer.start_as_current_span("on", attributes={"tokens": 3}):
        pass
    (line,) = _read_spans(span_file)  # SimpleSpanProcessor: written when the span ends
    assert line["name"] == "on" and line["service"] == "svc-x" and line["attributes"] == {"tokens": 3}

    shutdown_tracing()
    with tracer.start_as_current_span("after") as span:
        assert not span.is_recording()


def test_bad_exporter_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown trace exporter 'jaeger'"):
        build_tracer_provider("svc", "jaeger", "")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a target"):
        build_tracer_provider("svc", "file")
    assert build_tracer_provider("svc", "none") is None


def test_metrics_registries_are_independent_and_served() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    # The same service declared twice in one process (as tests do) must not collide.
    queue_a = MetricFactory(first, "scheduler").gauge("queue_length", "Requests waiting.", ["queue"])
    queue_b = MetricFactory(second, "scheduler").gauge("queue_length", "Requests waiting.", ["queue"])
    queue_a.labels(queue="waiting").set(7)
    queue_b.labels(queue="waiting").set(1)
    hits = MetricFactory(first, "scheduler").counter("cache_hit_tokens", "Reused prompt tokens.", ["tier"])
    hits.labels(tier="device").inc(5)
    assert 'strata_scheduler_queue_length{queue="waiting"} 1.0' in render(second)

    port = start_metrics_server(0, first)
    assert port > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    assert 'strata_scheduler_queue_length{queue="waiting"} 7.0' in body
    assert 'strata_scheduler_cache_hit_tokens_total{tier="device"} 5.0' in body
