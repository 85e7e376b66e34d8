"""Worker configuration (frozen; see ``services.common.config``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from services.common.config import ConfigError, model_dir_problem
from services.common.step import HOST_PAGE_TOKENS


def _h(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: str = field(default="", metadata=_h("Hugging Face model directory (config.json, safetensors)"))
    model_name: str = field(default="", metadata=_h("name to serve it under; empty = directory name"))
    host: str = field(default="127.0.0.1", metadata=_h("address to listen on"))
    advertise_host: str = field(default="", metadata=_h(
        "the host other services reach this one at, registered in etcd; "
        "empty = --host, or this machine's IP when --host is a wildcard (0.0.0.0)"
    ))
    port: int = field(default=0, metadata=_h("port to listen on; 0 picks a free one"))
    instance_id: str = field(default="", metadata=_h("etcd instance id; empty = worker-<port>"))
    etcd: str = field(default="", metadata=_h("etcd endpoint host:port; empty = no registration"))
    device: str = field(default="cpu", metadata=_h("cpu or cuda:N"))
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata=_h("weights and KV"))
    kv_cache_bytes: int = field(default=0, metadata=_h(
        "bytes for the KV pool (64MiB, 2GiB, ...); 0 = kv_mem_fraction of the memory free after loading"))
    kv_mem_fraction: float = field(default=0.0, metadata=_h(
        "with kv_cache_bytes 0: share of free memory for the KV pool; 0 = 0.1 on CPU, 0.8 on CUDA"))
    max_rows: int = field(default=256, metadata=_h("requests the worker holds at once"))
    max_context: int = field(default=0, metadata=_h("tokens per request; 0 = the model's context length"))
    mamba_slots: int = field(default=0, metadata=_h("Mamba state slots (hybrid models); 0 = derive"))
    page_size: int = field(default=1, metadata=_h("tokens per KV page"))
    kv_max_bytes: int = field(default=0, metadata=_h(
        "elastic KV reservation in bytes: PoolResize may grow the KV pool up to it; 0 = kv_cache_bytes"))
    mamba_max_slots: int = field(default=0, metadata=_h(
        "elastic Mamba reservation in slots: PoolResize may grow the Mamba pool up to it; 0 = the starting slots"))
    host_cache_bytes: int = field(default=0, metadata=_h(
        "hierarchical cache: bytes of host memory for KV pages evicted from the device; 0 = off"))
    host_page_tokens: int = field(default=HOST_PAGE_TOKENS, metadata=_h(
        "hierarchical cache: tokens per host / kvstore page (a multiple of page_size)"))
    host_state_share: float = field(default=0.25, metadata=_h(
        "hierarchical cache, hybrid models: share of host_cache_bytes for Mamba states (the rest holds KV "
        "pages); in (0, 1)"))
    attention: Literal["cascade", "flat", "reference"] = field(default="cascade", metadata=_h(
        "attention path: cascade = requests sharing a cached prefix attend to it once per group; flat = "
        "each request on its own; reference = the slow torch reference (for comparison)"))
    threads: int = field(default=0, metadata=_h("torch threads for the forward; 0 = one per core (of --cpus)"))
    serial_step_mflops: float = field(default=100.0, metadata=_h(
        "CPU: a forward whose work is estimated under this many MFLOPs (a few decodes of a small model) runs on "
        "one of the threads, where a team would cost more CPU than it saves; 0 = every forward on every thread"))
    packed_weights: Literal["auto", "on", "off"] = field(default="auto", metadata=_h(
        "CPU, fp32: decode steps and prefill chunks multiply with oneDNN-packed copies of the linear weights "
        "(double the weights' memory); auto = each where a pass over them at its rows (2 for decode steps, 64 "
        "for prefill chunks) measures >= 10% faster than MKL at start (prefill: not slower, where decode steps "
        "keep them); decode steps of more than 8 rows with MKL-packed copies, where a pass at 32 rows measures "
        ">= 10% faster"))
    native_linear: Literal["auto", "on", "off"] = field(default="auto", metadata=_h(
        "CPU, fp32: decode steps of 1-8 rows multiply with the native 8-lane kernel; auto = at the row counts "
        "where a pass over the weights (timed at 1, 2, 4 and 8 rows, each standing for its neighbours) measures >= 10% "
        "faster than without it at start"))
    kv_populate: bool = field(default=True, metadata=_h(
        "CPU: write every page of the KV pool at start (its memory resident from then on), so that no step "
        "pays a page fault for each fresh slot it fills; off = pages commit as slots are first used"))
    cpus: str = field(default="", metadata=_h(
        "run on these CPUs only, e.g. 0-3 or 0,2 (the process and every thread it starts, the forward's "
        "included: replicas on one host on cores of their own); empty = wherever the OS schedules it"))
    cuda_graph_max_batch: int = field(default=256, metadata=_h(
        "CUDA devices: decode steps of up to this many requests replay a CUDA graph per batch size "
        "(recorded on first use) instead of launching each kernel; 0 = off. No effect on the CPU"))
    speculative_draft_model: str = field(default="", metadata=_h(
        "speculative decoding: a smaller checkpoint with the same tokenizer that drafts tokens (the "
        "scheduler's --speculative-algorithm draft); its KV takes a pool of its own with the target's slots"))
    speculative_mtp: bool = field(default=False, metadata=_h(
        "speculative decoding: draft with the checkpoint's own multi-token-prediction head (Qwen3-Next's mtp.* "
        "weights; the scheduler's --speculative-algorithm mtp); its one attention layer takes a KV pool of its "
        "own with the target's slots"))
    l3: bool = field(default=False, metadata=_h(
        "hierarchical cache: put and get pages on the kvstore shards found through etcd"))
    outbox_bytes: int = field(default=0, metadata=_h(
        "prefill/decode hand-over without the kvstore: keep this worker's L3 puts (its prompts' pages and "
        "states) in an outbox of this many bytes (LRU) instead of the shards, served to other workers on this "
        "worker's port and registered in etcd; 0 = off (puts go to the kvstore). Needs --l3"))
    metrics_port: int = field(default=-1, metadata=_h("Prometheus port; -1 = off, 0 = pick"))
    trace_exporter: Literal["none", "console", "file", "otlp"] = field(default="none", metadata=_h("spans"))
    trace_target: str = field(default="", metadata=_h("file path or OTLP endpoint for spans"))
    lease_ttl_s: float = field(default=5.0, metadata=_h("etcd lease TTL"))
    log_level: str = field(default="info", metadata=_h("debug, info, warning, error"))
    tp: int = field(default=1, metadata=_h(
        "tensor-parallel ranks: the model's heads, MLP and experts split over this many processes (gloo on "
        "the CPU); this process is rank 0 and starts the others"))
    tp_timeout_s: float = field(default=60.0, metadata=_h(
        "tensor parallel: a collective inside a step fails after this long (joining the group at start: "
        "after this or 60 s, whichever is longer)"))
    tp_rank: int = field(default=0, metadata=_h("tensor parallel, set by rank 0 for the ranks it starts"))
    tp_init: str = field(default="", metadata=_h(
        "tensor parallel, set by rank 0 for the ranks it starts: the group's tcp://host:port"))
    tls_cert: str = field(default="", metadata={"help": "TLS certificate (PEM); mutual TLS with tls_ca"})
    tls_key: str = field(default="", metadata={"help": "its private key (PEM)"})
    tls_ca: str = field(default="", metadata={"help": "CA of the services' certificates; empty = plaintext"})

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("model: a Hugging Face model directory is required")
        if self.kv_cache_bytes < 0:
            raise ConfigError("kv_cache_bytes: must be >= 0 (0 = sized from free memory)")
        if not 0.0 <= self.kv_mem_fraction < 1.0:
            raise ConfigError(f"kv_mem_fraction: must be in [0, 1), got {self.kv_mem_fraction}")
        if self.max_rows < 1:
            raise ConfigError("max_rows: must be >= 1")
        if self.page_size < 1:
            raise ConfigError("page_size: must be >= 1")
        if self.kv_max_bytes and self.kv_cache_bytes and self.kv_max_bytes < self.kv_cache_bytes:
            raise ConfigError(f"kv_max_bytes: must be 0 or >= kv_cache_bytes ({self.kv_cache_bytes})")
        if self.mamba_max_slots < 0:
            raise ConfigError("mamba_max_slots: must be >= 0")
        if self.host_cache_bytes < 0:
            raise ConfigError("host_cache_bytes: must be >= 0 (0 = no host pool)")
        if self.host_page_tokens < 1 or self.host_page_tokens % self.page_size:
            raise ConfigError(f"host_page_tokens: must be a positive multiple of page_size ({self.page_size})")
        if not 0.0 < self.host_state_share < 1.0:
            raise ConfigError(f"host_state_share: must be > 0 and < 1, got {self.host_state_share}")
        if self.threads < 0:
            raise ConfigError("threads: must be >= 0 (0 = one per core)")
        if not self.serial_step_mflops >= 0:
            raise ConfigError("serial_step_mflops: must be >= 0 (0 = never)")
        if self.cpus:
            cpu_list(self.cpus)  # raises ConfigError naming the field
        if self.cuda_graph_max_batch < 0:
            raise ConfigError(f"cuda_graph_max_batch: must be >= 0 (0 = off), got {self.cuda_graph_max_batch}")
        if self.tp < 1:
            raise ConfigError(f"tp: must be >= 1, got {self.tp}")
        if self.speculative_draft_model:
            problem = model_dir_problem(self.speculative_draft_model)
            if problem:
                raise ConfigError(f"speculative_draft_model: {problem}")
            if self.tp > 1:
                raise ConfigError("speculative_draft_model: not supported with tensor parallelism (tp > 1)")
        if self.speculative_mtp:
            from services.worker.models.qwen3_next_mtp import mtp_problem

            if self.speculative_draft_model:
                raise ConfigError("speculative_mtp: drafts with the model's own head; drop speculative_draft_model")
            if self.tp > 1:
                raise ConfigError("speculative_mtp: not supported with tensor parallelism (tp > 1)")
            if problem := mtp_problem(self.model):
                raise ConfigError(f"speculative_mtp: {problem}")
        if not 0 <= self.tp_rank < self.tp or (self.tp_rank and not self.tp_init):
            raise ConfigError(f"tp_rank: must be in [0, tp={self.tp}), and a follower needs tp_init")
        if self.tp_timeout_s <= 0:
            raise ConfigError("tp_timeout_s: must be > 0")
        if self.l3 and not (self.etcd and self.host_cache_bytes):
            raise ConfigError("l3: needs --etcd (to find the kvstore shards) and --host-cache-bytes > 0")
        if self.outbox_bytes < 0 or (self.outbox_bytes and not self.l3):
            raise ConfigError("outbox_bytes: must be >= 0, and an outbox needs --l3 (it holds L3 puts)")
        if self.outbox_bytes and self.tp > 1:
            raise ConfigError("outbox_bytes: not supported with tensor parallelism (tp > 1)")


def cpu_list(text: str) -> set[int]:
    """``--cpus``: "0-3,6" -> {0, 1, 2, 3, 6}; each CPU must be one this process may run on."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ConfigError(f"cpus: expected CPU numbers and ranges such as 0-3 or 0,2, got {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ConfigError(f"cpus: {sorted(cpus - allowed)} not among the CPUs this process may use {sorted(allowed)}")
    return cpus
