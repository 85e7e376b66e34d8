"""Scheduler configuration (frozen; see ``services.common.config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.common.config import ConfigError
from services.scheduler.loop import LoopConfig
from services.scheduler.memory import HiConfig
from services.scheduler.memory.host import MAX_INFLIGHT_JOBS
from services.scheduler.speculative import SpecConfig


def _h(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    host: str = field(default="127.0.0.1", metadata=_h("address to listen on"))
    advertise_host: str = field(default="", metadata=_h(
        "the host other services reach this one at, registered in etcd; "
        "empty = --host, or this machine's IP when --host is a wildcard (0.0.0.0)"
    ))
    port: int = field(default=0, metadata=_h("port to listen on; 0 picks a free one"))
    instance_id: str = field(default="", metadata=_h("etcd instance id; empty = scheduler-<port>"))
    etcd: str = field(default="", metadata=_h("etcd endpoint host:port; empty = use --worker"))
    worker: str = field(default="", metadata=_h("a fixed worker address instead of etcd discovery"))
    model: str = field(default="", metadata=_h("serve only workers of this model name (empty = any)"))
    tokenizer: str = field(default="", metadata=_h("model directory whose tokenizer compiles grammars"))
    grammar_preload: bool = field(default=True, metadata=_h(
        "load the grammar backend (xgrammar, the torch it imports, the tokenizer's tables: ~4 s of CPU, ~220 MiB) "
        "in the background once a worker is attached; false: at the first constrained request, which waits for it"))
    grammar_cache: int = field(default=64, metadata=_h("compiled grammars kept (LRU)"))
    l3_lookup: bool = field(default=True, metadata=_h("ask the kvstore shards (L3) for a prompt's pages"))
    l3_lookup_timeout_s: float = field(
        default=0.05, metadata=_h("deadline of that lookup; a slower answer counts as a miss")
    )
    cache: Literal["radix", "none"] = field(default="radix", metadata=_h("prefix cache"))
    eviction: Literal["lru", "lfu"] = field(default="lru", metadata=_h("prefix cache eviction order"))
    policy: Literal["fcfs", "lpm"] = field(default="fcfs", metadata=_h("admission order"))
    max_prefill_tokens: int = field(default=1024, metadata=_h("prompt tokens per step (chunk budget)"))
    max_running: int = field(default=256, metadata=_h("requests running at once"))
    max_waiting: int = field(
        default=4096, metadata=_h("requests queued for admission; more are refused (RESOURCE_EXHAUSTED); 0 = no limit")
    )
    worker_wait_s: float = field(default=10.0, metadata=_h(
        "how long a request waits for a worker, also after its worker was lost (then UNAVAILABLE); "
        "above the worker's lease TTL (5 s) so a replacement can join"))
    overlap: bool = field(default=True, metadata=_h("plan the next step while the worker runs this one"))
    overlap_ratio: float = field(default=20.0, metadata=_h(
        "with overlap: not behind a step that prefills so much that overlap would hide less than 1/ratio of "
        "it (a request arriving during it then waits one step less); 0 = behind every step"))
    mamba_policy: Literal["marconi", "lru"] = field(
        default="marconi", metadata=_h("hybrid models: which cached state to evict first")
    )
    checkpoint_every: int = field(
        default=0, metadata=_h("hybrid models: checkpoint the state every N prompt tokens; 0 = max_prefill_tokens")
    )
    elastic_budget_bytes: int = field(
        default=0, metadata=_h("resize the worker's KV + Mamba pools at run time within this many bytes; 0 = static")
    )
    elastic_shared_budget: str = field(
        default="", metadata=_h("share --elastic-budget-bytes with other schedulers under this name in etcd")
    )
    elastic_idle_s: float = field(default=5.0, metadata=_h("elastic pools: give memory back after this long idle"))
    elastic_min_kv_slots: int = field(
        default=0, metadata=_h("elastic pools: KV slots kept even when idle; 0 = the context length")
    )
    hicache_write_policy: Literal["write_through", "write_through_selective", "write_back"] = field(
        default="write_through", metadata=_h("hierarchical cache: when device pages are copied to the host (and L3)")
    )
    hicache_prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = field(
        default="wait_complete", metadata=_h("hierarchical cache: how long a request waits for its L3 prefetch")
    )
    hicache_prefetch_threshold: int = field(
        default=1, metadata=_h("hierarchical cache: fetch from L3 when it holds this many pages beyond the local hit")
    )
    hicache_prefetch_timeout_s: float = field(
        default=2.0, metadata=_h("hierarchical cache: the wait of the 'timeout' prefetch policy")
    )
    hicache_max_inflight: int = field(
        default=MAX_INFLIGHT_JOBS, metadata=_h("hierarchical cache: backups, puts and prefetches in flight at once")
    )
    speculative_algorithm: Literal["", "ngram", "draft", "mtp"] = field(default="", metadata=_h(
        "speculative decoding: 'ngram' drafts from the request's own prompt and output (prompt lookup), "
        "'draft' has the worker's --speculative-draft-model draft, 'mtp' the checkpoint's own MTP head "
        "(worker --speculative-mtp, Qwen3-Next); verified by the worker in one forward; empty = off"))
    speculative_num_draft_tokens: int = field(default=4, metadata=_h("speculative decoding: drafts per step at most"))
    speculative_ngram_min: int = field(default=1, metadata=_h("ngram drafts: shortest suffix looked up"))
    speculative_ngram_max: int = field(default=4, metadata=_h("ngram drafts: longest suffix looked up"))
    speculative_max_batch: int = field(
        default=4, metadata=_h("speculative decoding: draft only while at most this many requests decode")
    )
    speculative_min_accepted: float = field(default=1.0, metadata=_h(
        "speculative decoding: a request whose drafts keep fewer tokens per step than this (running mean) "
        "backs off (8, 16, ... 64 decodes)"))
    speculative_adaptive: bool = field(default=True, metadata=_h(
        "speculative decoding: measure the decode token rate with drafts and without at each batch size "
        "(windows of 16 steps, the slower mode retried now and then) and draft only where it is faster; "
        "false = draft whenever the other limits allow"))
    role: Literal["both", "prefill", "decode"] = field(default="both", metadata=_h(
        "prefill/decode disaggregation: 'prefill' ends each new request after its first token once its "
        "prompt's pages are in the kvstore (the tokenizer goes on with a 'decode' replica, which loads "
        "them); 'both' serves whole requests; registered in etcd for the tokenizer's router"))
    handoff_wait_s: float = field(default=2.0, metadata=_h(
        "prefill role: how long a finished prefill waits for its pages to reach the kvstore before it "
        "is handed over anyway (the decode replica recomputes what is missing)"))
    check_invariants: bool = field(default=True, metadata=_h("check KV accounting whenever idle"))
    metrics_port: int = field(default=-1, metadata=_h("Prometheus port; -1 = off, 0 = pick"))
    trace_exporter: Literal["none", "console", "file", "otlp"] = field(default="none", metadata=_h("spans"))
    trace_target: str = field(default="", metadata=_h("file path or OTLP endpoint for spans"))
    log_level: str = field(default="info", metadata=_h("debug, info, warning, error"))
    tls_cert: str = field(default="", metadata={"help": "TLS certificate (PEM); mutual TLS with tls_ca"})
    tls_key: str = field(default="", metadata={"help": "its private key (PEM)"})
    tls_ca: str = field(default="", metadata={"help": "CA of the services' certificates; empty = plaintext"})

    def validate(self) -> None:
        if not self.etcd and not self.worker:
            raise ConfigError("etcd or worker: one is needed to find a worker")
        if self.max_prefill_tokens < 1:
            raise ConfigError("max_prefill_tokens: must be >= 1")
        if self.max_running < 1:
            raise ConfigError("max_running: must be >= 1")
        if not self.overlap_ratio >= 0:
            raise ConfigError(f"overlap_ratio: must be >= 0 (0 = pipeline behind every step), got {self.overlap_ratio}")
        if self.max_waiting < 0:
            raise ConfigError("max_waiting: must be >= 0 (0 = no limit)")
        if min(self.elastic_budget_bytes, self.elastic_idle_s, self.elastic_min_kv_slots) < 0:
            raise ConfigError("elastic_budget_bytes, elastic_idle_s and elastic_min_kv_slots: must be >= 0")
        if self.elastic_shared_budget and not (self.etcd and self.elastic_budget_bytes):
            raise ConfigError("elastic_shared_budget: needs --etcd and --elastic-budget-bytes (the shared total)")
        if self.hicache_prefetch_threshold < 1 or self.hicache_max_inflight < 1:
            raise ConfigError("hicache_prefetch_threshold and hicache_max_inflight: must be >= 1")
        if self.l3_lookup_timeout_s <= 0:
            raise ConfigError("l3_lookup_timeout_s: must be > 0")
        if self.hicache_prefetch_timeout_s < 0:
            raise ConfigError("hicache_prefetch_timeout_s: must be >= 0")
        if self.handoff_wait_s < 0:
            raise ConfigError("handoff_wait_s: must be >= 0")
        if self.checkpoint_every < 0:
            raise ConfigError("checkpoint_every: must be >= 0 (0 = max_prefill_tokens)")
        try:
            self.spec().validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def spec(self) -> SpecConfig:
        return SpecConfig(
            algorithm=self.speculative_algorithm,
            num_draft_tokens=self.speculative_num_draft_tokens,
            ngram_min=self.speculative_ngram_min,
            ngram_max=self.speculative_ngram_max,
            max_batch=self.speculative_max_batch,
            min_accepted=self.speculative_min_accepted,
            adaptive=self.speculative_adaptive,
        )

    def loop(self) -> LoopConfig:
        return LoopConfig(
            cache=self.cache,
            eviction=self.eviction,
            policy=self.policy,
            max_prefill_tokens=self.max_prefill_tokens,
            max_running=self.max_running,
            max_waiting=self.max_waiting,
            worker_wait_s=self.worker_wait_s,
            check_invariants=self.check_invariants,
            overlap=self.overlap,
            overlap_ratio=self.overlap_ratio,
            mamba_policy=self.mamba_policy,
            checkpoint_every=self.checkpoint_every,
            elastic_budget_bytes=self.elastic_budget_bytes,
            elastic_idle_s=self.elastic_idle_s,
            elastic_min_kv_slots=self.elastic_min_kv_slots,
            hicache=HiConfig(
                write_policy=self.hicache_write_policy,
                prefetch_policy=self.hicache_prefetch_policy,
                prefetch_threshold=self.hicache_prefetch_threshold,
                prefetch_timeout_s=self.hicache_prefetch_timeout_s,
                max_inflight_jobs=self.hicache_max_inflight,
            ),
            spec=self.spec(),
            handoff_wait_s=self.handoff_wait_s,
        )
