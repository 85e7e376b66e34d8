"""Tokenizer service configuration (frozen; see ``services.common.config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.common.config import ConfigError


def _h(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    model: str = field(default="", metadata=_h("Hugging Face model directory (tokenizer files, config.json)"))
    model_name: str = field(default="", metadata=_h("served model name; empty = directory name"))
    host: str = field(default="127.0.0.1", metadata=_h("address to listen on"))
    advertise_host: str = field(default="", metadata=_h(
        "the host other services reach this one at, registered in etcd; "
        "empty = --host, or this machine's IP when --host is a wildcard (0.0.0.0)"
    ))
    port: int = field(default=50051, metadata=_h("public port; 0 picks a free one"))
    http_port: int = field(default=8000, metadata=_h("OpenAI-compatible HTTP port; 0 = off, -1 = pick a free one"))
    api_key: str = field(default="", metadata=_h("API keys (comma-separated) required on /v1/* and gRPC; empty = none"))
    api_key_file: str = field(default="", metadata=_h("a file of API keys, one per line"))
    instance_id: str = field(default="", metadata=_h("etcd instance id; empty = tokenizer-<port>"))
    etcd: str = field(default="", metadata=_h("etcd endpoint host:port; empty = use --scheduler"))
    scheduler: str = field(default="", metadata=_h("a fixed scheduler address instead of discovery"))
    scheduler_wait_s: float = field(default=5.0, metadata=_h("how long a request waits for a scheduler to register"))
    resume_wait_s: float = field(default=10.0, metadata=_h(
        "how long a request whose scheduler was lost (mid-stream or before it answered) waits for another, or "
        "the restarted one, to take it (then UNAVAILABLE); covers a `strata up --restart on-failure` restart"
    ))
    router_policy: Literal["kv", "round_robin", "least_load"] = field(default="kv", metadata=_h(
        "which discovered scheduler serves a request: kv (most of the prompt cached, weighed against "
        "load), least_load, round_robin"
    ))
    router_load_weight: float = field(
        default=32.0, metadata=_h("kv / least_load routing: prompt tokens one running request weighs as")
    )
    tool_call_parser: Literal["hermes", "qwen3_coder"] = field(default="hermes", metadata=_h(
        "how the model writes tool calls: hermes (Qwen3: JSON in tool_call tags) or qwen3_coder (Qwen3-Coder's "
        "function / parameter XML); the HTTP API parses calls, and constrains tool_choice required / named, in it"
    ))
    reasoning_parser: Literal["none", "qwen3"] = field(default="none", metadata=_h(
        "qwen3: a chat answer's leading think block becomes reasoning_content (HTTP API); none: it stays in content"
    ))
    front_processes: int = field(default=1, metadata=_h(
        "processes serving the public gRPC and HTTP ports: this one and N-1 more it starts, each routing its own "
        "requests (one Python process streams ~20k tokens/s); connections are spread over them"
    ))
    front_index: int = field(default=0, metadata=_h(
        "this process's place among --front-processes (set by the first for the others; leave 0)"
    ))
    http_fd: int = field(default=-1, metadata=_h(
        "serve HTTP on this inherited listening socket (set by the first front process for the others)"
    ))
    metrics_port: int = field(default=-1, metadata=_h(
        "Prometheus port; -1 = off, 0 = pick; front process i (--front-processes) serves on this + i"
    ))
    trace_exporter: Literal["none", "console", "file", "otlp"] = field(default="none", metadata=_h("spans"))
    trace_target: str = field(default="", metadata=_h("file path or OTLP endpoint for spans"))
    log_level: str = field(default="info", metadata=_h("debug, info, warning, error"))
    tls_cert: str = field(default="", metadata={"help": "TLS certificate (PEM); mutual TLS with tls_ca"})
    tls_key: str = field(default="", metadata={"help": "its private key (PEM)"})
    tls_ca: str = field(default="", metadata={"help": "CA of the services' certificates; empty = plaintext"})

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("model: a Hugging Face model directory is required")
        if not self.etcd and not self.scheduler:
            raise ConfigError("etcd or scheduler: one is needed to find a scheduler")
        if self.resume_wait_s < 0:
            raise ConfigError(f"resume_wait_s: must be >= 0, got {self.resume_wait_s}")
        if self.router_load_weight < 0:
            raise ConfigError(f"router_load_weight: must be >= 0, got {self.router_load_weight}")
        if self.front_processes < 1:
            raise ConfigError(f"front_processes: must be >= 1, got {self.front_processes}")
        if not 0 <= self.front_index < self.front_processes:
            raise ConfigError(f"front_index: must be in [0, {self.front_processes}), got {self.front_index}")
        if not -1 <= self.http_port <= 65535:
            raise ConfigError(f"http_port: must be -1 (pick), 0 (off) or a port, got {self.http_port}")
