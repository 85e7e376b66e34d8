"""Prometheus metrics: each service declares its metrics on a ``CollectorRegistry`` it owns.

Owning the registry (instead of prometheus_client's process-global ``REGISTRY``) lets tests build a
service twice in one process without "Duplicated timeseries" errors, and lets ``strata up`` run
several services in one process with separate endpoints. A service does::

    class SchedulerMetrics:
        def __init__(self, registry: CollectorRegistry) -> None:
            m = MetricFactory(registry, "scheduler")
            self.queue_length = m.gauge("queue_length", "Requests waiting, by queue.", ["queue"])
            self.step_seconds = m.histogram("step_seconds", "Wall time of one step.", buckets=STEP_BUCKETS_S)

    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry)
    port = start_metrics_server(cfg.metrics_port, registry)

Metric names are ``strata_<service>_<name>``; counters get prometheus_client's ``_total`` suffix.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)

log = logging.getLogger(__name__)

# Counters and histograms would each carry a `_created` timestamp series beside `_total`; scrapers
# show it as a duplicate metric and no Strata dashboard uses it.
disable_created_metrics()

# Step and request latencies in seconds: sub-millisecond CPU steps up to multi-second prefills.
STEP_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

# Per-request latencies (queue time, TTFT, end to end): milliseconds to minutes.
REQUEST_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
# Prompt and generation lengths in tokens.
LENGTH_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True, slots=True)
class MetricFactory:
    """Declares metrics named ``strata_<service>_<name>`` on one registry."""

    registry: CollectorRegistry
    service: str

    def _name(self, name: str) -> str:
        return f"strata_{self.service}_{name}"

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self._name(name), doc, labelnames=labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self._name(name), doc, labelnames=labels, registry=self.registry)

    def histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = STEP_BUCKETS_S
    ) -> Histogram:
        return Histogram(self._name(name), doc, labelnames=labels, buckets=buckets, registry=self.registry)


def start_metrics_server(port: int, registry: CollectorRegistry, host: str = "127.0.0.1") -> int:
    """Serve ``registry`` at ``http://<host>:<port>/metrics`` from a daemon thread.

    ``port`` 0 picks a free port. Returns the bound port. Raises ``OSError`` if the port is taken.
    The server lives as long as the process (services never stop it before exiting).
    """
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    bound: int = httpd.server_port
    log.info("metrics at http://%s:%d/metrics", host, bound)
    return bound


def serve_metrics(port: int, host: str, registry: CollectorRegistry) -> str:
    """Start the metrics endpoint unless ``port`` is -1; returns the ``metrics=host:port`` field a
    service adds to its READY line (the supervisor lists it), or ``""`` when off."""
    if port < 0:
        return ""
    return f" metrics={host}:{start_metrics_server(port, registry, host)}"


def render(registry: CollectorRegistry) -> str:
    """The text exposition of ``registry`` (what a scrape returns); handy in tests and `strata stats`."""
    return generate_latest(registry).decode()
