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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

log = logging.getLogger(__name__)

# Step and request latencies in seconds: sub-millisecond CPU steps up to multi-second prefills.
STEP_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


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


def start_metrics_server(port: int, registry: CollectorRegistry) -> int:
    """Serve ``registry`` at ``http://127.0.0.1:<port>/metrics`` from a daemon thread.

    ``port`` 0 picks a free port. Returns the bound port. Raises ``OSError`` if the port is taken.
    The server lives as long as the process (services never stop it before exiting).
    """
    httpd, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    bound: int = httpd.server_port
    log.info("metrics at http://127.0.0.1:%d/metrics", bound)
    return bound


def render(registry: CollectorRegistry) -> str:
    """The text exposition of ``registry`` (what a scrape returns); handy in tests and `strata stats`."""
    return generate_latest(registry).decode()
