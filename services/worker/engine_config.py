"""The engine's frozen configuration: dtype, pool budgets and the elastic reservations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from services.common.step import HOST_PAGE_TOKENS, STATES_PER_ROW

DType = Literal["float32", "bfloat16", "float16"]
AttentionPath = Literal["cascade", "flat", "reference"]
"""``cascade``: prefix-shared attention (requests sharing a slot run attend to it once per group) over
the fast path; ``flat``: the fast path, every request on its own; ``reference``: the torch reference
kernels (whole rows gathered token by token, padded to the longest) — the slow path kept for
comparison and as the truth the others are tested against."""
PackedWeights = Literal["auto", "on", "off"]
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Peak Mamba states one row can pin at once: its own running state, the locked cached state it
# matched, and the copy it donates to the tree when it checkpoints (see DESIGN §3).


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Worker engine settings, validated at construction.

    ``max_context`` ``None`` = the model's ``max_position_embeddings``; ``mamba_slots`` 0 =
    ``STATES_PER_ROW * max_rows`` (ignored for dense models).

    Elastic pools: ``kv_cache_bytes`` / ``mamba_slots`` size the pools at start;
    ``kv_max_bytes`` / ``mamba_max_slots`` size the address range reserved once, which
    ``PoolResize`` ops may grow the pools into (0 = the starting size: a pool can shrink and grow
    back, never beyond it). Without an elastic backing on the device the reservations fall back
    to the starting sizes.

    Hierarchical cache: ``host_cache_bytes`` sizes the host (L2) pool in pages of
    ``host_page_tokens`` tokens (0 = no host pool). On a hybrid model ``host_state_share`` of it
    holds Mamba states (a ``HostStatePool``) and the rest KV pages; dense models use all of it
    for pages.
    """

    device: str = "cpu"
    dtype: DType = "float32"
    kv_cache_bytes: int = 256 << 20  # 0 = kv_mem_fraction of the free memory (kv_budget.py)
    kv_mem_fraction: float = 0.0  # with kv_cache_bytes 0; 0 = the device's default
    max_rows: int = 64
    max_context: int | None = None
    mamba_slots: int = 0
    page_size: int = 1
    kv_max_bytes: int = 0
    mamba_max_slots: int = 0
    host_cache_bytes: int = 0
    host_page_tokens: int = HOST_PAGE_TOKENS
    host_state_share: float = 0.25
    attention: AttentionPath = "cascade"
    threads: int = 0  # torch intra-op threads; 0 = torch's default (one per core)
    # CPU: forwards of fewer estimated MFLOPs than this run on one of the threads (step_threads.py);
    # 0 = every forward on every thread.
    serial_step_mflops: float = 100.0
    # CUDA: decode batches of up to this many requests replay CUDA graphs (cuda_graphs.py); 0 = off.
    cuda_graph_max_batch: int = 256
    draft_model: str = ""  # speculative decoding: a draft checkpoint with the target's tokenizer
    mtp: bool = False  # speculative decoding: draft with the checkpoint's own MTP head (Qwen3-Next)
    # CPU, fp32: oneDNN-packed copies of the linear weights for decode steps and prefill chunks
    # (kernels/linear.py); auto = each where a pass over them at its rows (2, 64) measures >= 10 %
    # faster than MKL (prefill: not slower, where decode steps keep them); and MKL-packed copies for
    # decode steps of more than 8 rows, where a pass at 32 rows measures >= 10 % faster.
    packed_weights: PackedWeights = "auto"
    # CPU, fp32: decode steps of 1-8 rows multiply with the native 8-lane kernel (kernels/linear.py);
    # auto = at the row counts where a pass over the weights (timed at 1, 2, 4, 8 rows) measures >= 10 % faster.
    native_linear: PackedWeights = "auto"
    # CPU: write every page of the KV pool at start, so that no step pays the first write's fault
    # in the slots it fills (what an allocation with torch.zeros does; False: pages commit as used).
    kv_populate: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.packed_weights not in get_args(PackedWeights):
            raise ValueError(f"EngineConfig.packed_weights must be auto, on or off, got {self.packed_weights!r}")
        if self.native_linear not in get_args(PackedWeights):
            raise ValueError(f"EngineConfig.native_linear must be auto, on or off, got {self.native_linear!r}")
        if self.kv_cache_bytes < 0 or not 0.0 <= self.kv_mem_fraction < 1.0:
            raise ValueError("EngineConfig.kv_cache_bytes must be >= 0 and kv_mem_fraction in [0, 1)")
        for name in ("max_rows", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"EngineConfig.max_context must be >= 1 or None, got {self.max_context}")
        if self.host_cache_bytes < 0:
            raise ValueError(
                f"EngineConfig.host_cache_bytes must be >= 0 (0 = no host pool), got {self.host_cache_bytes}"
            )
        if self.host_page_tokens < 1 or self.host_page_tokens % self.page_size:
            raise ValueError(f"EngineConfig.host_page_tokens must be a positive multiple of page_size "
                             f"({self.page_size}), got {self.host_page_tokens}")
        if not 0.0 < self.host_state_share < 1.0:
            raise ValueError(
                "EngineConfig.host_state_share (the share of host_cache_bytes for Mamba states on hybrid "
                f"models) must be > 0 and < 1, got {self.host_state_share}"
            )
        if self.attention not in ("cascade", "flat", "reference"):
            raise ValueError(
                f"EngineConfig.attention must be 'cascade', 'flat' or 'reference', got {self.attention!r}"
            )
        if self.threads < 0:
            raise ValueError(f"EngineConfig.threads must be >= 0 (0 = torch's default), got {self.threads}")
        if not self.serial_step_mflops >= 0:
            raise ValueError(f"EngineConfig.serial_step_mflops must be >= 0 (0 = never), got {self.serial_step_mflops}")
        if self.cuda_graph_max_batch < 0:
            raise ValueError(
                f"EngineConfig.cuda_graph_max_batch must be >= 0 (0 = off), got {self.cuda_graph_max_batch}"
            )
        if self.mtp and self.draft_model:
            raise ValueError("EngineConfig: draft with draft_model or with mtp, not both")
        if self.mamba_slots < 0:
            raise ValueError(f"EngineConfig.mamba_slots must be >= 0, got {self.mamba_slots}")
        if self.kv_max_bytes and self.kv_max_bytes < self.kv_cache_bytes:
            raise ValueError(f"EngineConfig.kv_max_bytes must be 0 or >= kv_cache_bytes ({self.kv_cache_bytes}), "
                             f"got {self.kv_max_bytes}")
        if self.mamba_max_slots and self.mamba_max_slots < self.initial_mamba_slots:
            raise ValueError(f"EngineConfig.mamba_max_slots must be 0 or >= the starting Mamba slots "
                             f"({self.initial_mamba_slots}), got {self.mamba_max_slots}")

    @property
    def initial_mamba_slots(self) -> int:
        """Mamba pool capacity at start (hybrid models)."""
        return self.mamba_slots or STATES_PER_ROW * self.max_rows
