"""The kvstore's frozen configuration: where it listens, how much it holds, how it streams.

Built once at start by ``services.common.config`` (defaults ← ``--config`` file ← flags) and
validated in ``__post_init__``, so a ``KVStoreConfig`` that exists is one the server can run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.common.config import ConfigError
from services.common.server import MAX_MESSAGE_BYTES

MiB = 1024 * 1024

# Room for protobuf framing (keys, tags, lengths) on top of the page bytes of one message.
_FRAMING_BYTES = 1 * MiB


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class KVStoreConfig:
    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    advertise_host: str = field(default="", metadata=_help(
        "the host other services reach this one at, registered in etcd; "
        "empty = --host, or this machine's IP when --host is a wildcard (0.0.0.0)"
    ))
    port: int = field(default=0, metadata=_help("port to listen on; 0 picks a free one"))
    capacity_bytes: int = field(
        default=256 * MiB, metadata=_help("cap on stored page bytes; least recently used pages are evicted")
    )
    backend: Literal["memory", "file"] = field(
        default="memory", metadata=_help("where pages live: process memory, or files under --path")
    )
    path: str = field(default="", metadata=_help("directory of the file backend (created if missing)"))
    max_page_bytes: int = field(
        default=64 * MiB, metadata=_help("largest page accepted; larger ones are INVALID_ARGUMENT")
    )
    batch_bytes: int = field(
        default=4 * MiB, metadata=_help("target bytes per streamed Get message (a larger page goes alone)")
    )
    etcd: str = field(default="", metadata=_help("etcd endpoint host:port to register with; empty = none"))
    instance_id: str = field(default="", metadata=_help("id under which this instance registers in etcd"))
    metrics_port: int = field(default=-1, metadata=_help("Prometheus metrics port; -1 = off, 0 = pick"))
    log_level: Literal["debug", "info", "warning", "error"] = field(
        default="info", metadata=_help("logging level")
    )
    trace_exporter: str = field(default="none", metadata=_help("OpenTelemetry exporter: none, console, otlp"))
    trace_target: str = field(default="", metadata=_help("file path or OTLP endpoint for spans"))
    tls_cert: str = field(default="", metadata={"help": "TLS certificate (PEM); mutual TLS with tls_ca"})
    tls_key: str = field(default="", metadata={"help": "its private key (PEM)"})
    tls_ca: str = field(default="", metadata={"help": "CA of the services' certificates; empty = plaintext"})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first unusable key."""
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: {self.port} is not in 0..65535")
        if self.capacity_bytes < 1:
            raise ConfigError(f"capacity_bytes: must be >= 1, got {self.capacity_bytes}")
        if self.max_page_bytes < 1:
            raise ConfigError(f"max_page_bytes: must be >= 1, got {self.max_page_bytes}")
        if self.batch_bytes < 1:
            raise ConfigError(f"batch_bytes: must be >= 1, got {self.batch_bytes}")
        # A streamed message holds at most max(batch_bytes, one page) of page bytes; it must fit
        # under the channel's message cap or the peer would reject it mid-stream.
        largest = max(self.batch_bytes, self.max_page_bytes) + _FRAMING_BYTES
        if largest > MAX_MESSAGE_BYTES:
            raise ConfigError(
                f"max_page_bytes / batch_bytes: a message of {largest} bytes would exceed the gRPC "
                f"message cap of {MAX_MESSAGE_BYTES} bytes; lower them"
            )
        if self.backend == "file" and not self.path:
            raise ConfigError("path: the file backend needs a directory (--path)")
        if self.metrics_port < -1 or self.metrics_port > 65535:
            raise ConfigError(f"metrics_port: {self.metrics_port} is not -1 (off) or in 0..65535")
