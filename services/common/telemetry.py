"""OpenTelemetry tracing for Strata services: one trace id per request across every gRPC hop.

Usage in a service's entry point, before building its servers and channels::

    setup_tracing("scheduler", cfg.trace_exporter, cfg.trace_target)
    server = grpc.aio.server(interceptors=[*server_interceptors(), ...])
    channel = grpc.aio.insecure_channel(addr, interceptors=client_interceptors())
    ...
    shutdown_tracing()  # flushes buffered spans

Contracts:
- The process's provider lives here, not in OpenTelemetry's global: use ``get_tracer`` from this
  module (safe to call at import time; it follows later ``setup_tracing`` calls). Leaving the global
  alone lets tests build several providers in one process without OpenTelemetry's override warning.
- With exporter "none" (the default state) tracing costs nearly nothing: no interceptors are
  returned, ``get_tracer`` yields a no-op tracer and ``inject_context`` returns ``{}``.
- Interceptors carry W3C ``traceparent``/``tracestate`` in gRPC metadata (opentelemetry-
  instrumentation-grpc's aio interceptors, verified with unary, server-streaming and bidi calls in
  tests/services/test_telemetry.py). Streaming server handlers must be async generators (``yield``), not
  ``context.write`` coroutines: the server interceptor iterates the handler.
- A request multiplexed inside a stream (the worker's Step carries many requests) carries its own
  context as a ``dict[str, str]`` field: ``inject_context`` on the sender, ``extract_context`` on the
  receiver, then ``get_tracer(...).start_as_current_span(name, context=ctx)``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, cast

import grpc
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

log = logging.getLogger(__name__)

Exporter = Literal["none", "console", "file", "otlp"]
EXPORTERS: tuple[Exporter, ...] = ("none", "console", "file", "otlp")

_NOOP_TRACER = trace.NoOpTracer()
_provider: TracerProvider | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file, flushed after every batch.

    Fields: trace_id, span_id, parent_id (hex; parent_id null for a root), name, service, kind,
    start_ns, end_ns (Unix epoch nanoseconds), status, attributes. Several processes may append to
    the same file: each line is written with a single ``write`` on an ``O_APPEND`` file.
    """

    def __init__(self, path: Path | str) -> None:
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._path.open("a", encoding="utf-8")
        self._lock = threading.Lock()  # spans end on gRPC and executor threads too

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """The JSON-ready form of a finished span used by ``JsonLinesSpanExporter``."""
    ctx = span.get_span_context()
    assert ctx is not None, "a finished SDK span always has a context"
    parent = span.parent
    return {
        "trace_id": trace.format_trace_id(ctx.trace_id),
        "span_id": trace.format_span_id(ctx.span_id),
        "parent_id": trace.format_span_id(parent.span_id) if parent is not None else None,
        "name": span.name,
        "service": span.resource.attributes.get(SERVICE_NAME),
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()},
    }


def build_tracer_provider(service_name: str, exporter: Exporter, target: str = "") -> TracerProvider | None:
    """A provider exporting to ``exporter``, or None for "none".

    ``target`` is the file path for "file" and the collector address (``host:port``) for "otlp";
    "console" writes JSON spans to stderr (stdout belongs to the CLI).
    """
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown trace exporter {exporter!r}; expected one of {', '.join(EXPORTERS)}")
    if exporter == "none":
        return None
    if exporter in ("file", "otlp") and not target:
        what = "a file path" if exporter == "file" else "a collector host:port"
        raise ValueError(f"trace exporter {exporter!r} needs a target ({what})")
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    if exporter == "file":
        # Synchronous export: the file is complete as soon as a span ends (tests and `strata trace`).
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(target)))
    elif exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    else:
        # Imported here: the OTLP exporter pulls in its own gRPC stack, unneeded otherwise.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=target, insecure=True), schedule_delay_millis=500)
        )
    return provider


def from_environment(exporter: Exporter, target: str, env: Mapping[str, str] = os.environ) -> tuple[Exporter, str]:
    """The exporter and target after OpenTelemetry's standard variables: a flag that was set wins;
    otherwise ``OTEL_TRACES_EXPORTER`` (otlp, console, none) and ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
    / ``OTEL_EXPORTER_OTLP_ENDPOINT`` apply; ``OTEL_SDK_DISABLED=true`` turns tracing off."""
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return "none", ""
    if exporter == "none":
        wanted = env.get("OTEL_TRACES_EXPORTER", "none").split(",")[0].strip().lower()
        exporter = cast(Exporter, wanted) if wanted in ("otlp", "console") else "none"
    if exporter == "otlp" and not target:
        target = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        target = target.removeprefix("http://").removeprefix("https://").rstrip("/")
        target = target or "localhost:4317"  # the OTLP/gRPC default
    return exporter, target


def setup_tracing(service_name: str, exporter: Exporter, target: str = "") -> None:
    """Install this process's tracer provider (replacing and flushing a previous one); the
    standard ``OTEL_*`` variables fill in what the flags leave unset (``from_environment``)."""
    global _provider
    exporter, target = from_environment(exporter, target)
    provider = build_tracer_provider(service_name, exporter, target)
    shutdown_tracing()
    _provider = provider
    log.info("tracing service=%s exporter=%s target=%s", service_name, exporter, target or "-")


def shutdown_tracing() -> None:
    """Flush and stop the installed provider; tracing is "none" afterwards."""
    global _provider
    provider, _provider = _provider, None
    if provider is not None:
        provider.shutdown()


def tracing_enabled() -> bool:
    return _provider is not None


class _DeferredTracer(trace.Tracer):
    """Resolves the installed provider on each use, so module-level tracers follow ``setup_tracing``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cached: tuple[TracerProvider, trace.Tracer] | None = None

    def _tracer(self) -> trace.Tracer:
        provider = _provider
        if provider is None:
            return _NOOP_TRACER
        cached = self._cached
        if cached is None or cached[0] is not provider:
            cached = (provider, provider.get_tracer(self._name))
            self._cached = cached
        return cached[1]

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return self._tracer().start_span(*args, **kwargs)

    # Forwards every argument unchanged, hence the looser signature than the ABC's.
    @contextmanager
    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Iterator[trace.Span]:  # type: ignore[override]
        with self._tracer().start_as_current_span(*args, **kwargs) as span:
            yield span


def get_tracer(name: str) -> trace.Tracer:
    """A tracer bound to whatever provider is installed when it is used (a no-op under "none")."""
    return _DeferredTracer(name)


def server_interceptors(provider: TracerProvider | None = None) -> list[grpc.aio.ServerInterceptor]:
    """Interceptors that continue the caller's trace in a SERVER span around each handler.

    ``provider`` defaults to the installed one; returns ``[]`` when tracing is off.
    """
    provider = provider or _provider
    if provider is None:
        return []
    return [aio_server_interceptor(tracer_provider=provider)]


def client_interceptors(provider: TracerProvider | None = None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that open a CLIENT span per call and send its context as ``traceparent`` metadata.

    ``provider`` defaults to the installed one; returns ``[]`` when tracing is off.
    """
    provider = provider or _provider
    if provider is None:
        return []
    interceptors: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(tracer_provider=provider)
    return interceptors


def inject_context(context: Context | None = None) -> dict[str, str]:
    """The W3C trace headers of ``context`` (default: the current one); ``{}`` when no span is active."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def extract_context(carrier: Mapping[str, str]) -> Context:
    """The context a peer sent with ``inject_context``; an empty carrier yields a fresh root context."""
    return propagate.extract(dict(carrier))
