"""The worker's attention backend: chosen once per engine, the twin of the scheduler's ``Memory``.

The engine picks one backend from its device and ``EngineConfig.attention`` (``attention_backend``)
and the models never ask which one they hold. Two verbs:

* ``prepare(rows, start_pos, extend_lens)``, once per forward (``ForwardBatch.build``): the planning
  that depends only on the batch — prefix groups, the CPU pass plan — read from the host copy of
  ``req_to_token``, which must already hold this step's slots. The result travels in the batch
  (``ForwardBatch.attn``).
* ``forward(q, k, v, layer, batch, scale, keep=None)``, once per full-attention layer: stores the
  batch's K/V at ``batch.out_slots`` in that layer's pool buffers, then attends every new token
  causally over its request's row (cached prefix and new tokens alike); with ``keep`` (a model's
  last layer: ``batch.logit_index``) only those tokens, where the plan has a pass for them alone
  (the CPU backend's native kernel), else every token, then those rows.

The backends (``attention_backend`` picks one):

* ``CpuAttention`` (a CPU, ``cascade`` / ``flat``): ``prepare`` finds the prefix groups (``cascade``)
  and plans the passes (``kernels.attention.cpu``); ``forward`` runs them — torch's CPU flash
  attention, the native paged decode for fp32 pools — and merges them by log-sum-exp.
* ``TritonAttention`` (CUDA, ``cascade`` / ``flat``): ``prepare`` finds the prefix groups
  (``cascade``); ``forward`` runs the Triton cascade decode on a pure decode batch in which groups
  formed, the flat Triton decode or extend kernel otherwise.
* ``ReferenceAttention`` (``reference``, or a device with neither): the torch references
  (``kernels.attention.reference``); ``prepare`` plans nothing.

All paths give the same result up to fp32 rounding (``tests/engine/test_prefix_attention.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.attention.cpu import AttentionPlan, plan_attention, run_attention
from kernels.attention.launch import cascade_decode_attention, decode_attention, extend_attention
from kernels.attention.prefix_groups import PrefixGroups, find_prefix_groups
from kernels.attention.reference import decode_attention_torch, extend_attention_torch
from kernels.kv_store import store_kv
from kernels.native import paged_decode_available

if TYPE_CHECKING:
    from services.worker.batch import ForwardBatch
    from services.worker.engine_config import AttentionPath
    from services.worker.pools import KVPool, ReqToTokenTable


@dataclass(frozen=True, slots=True)
class AttentionMeta:
    """What ``prepare`` planned for one forward: the prefix groups (``cascade`` only, ``None`` when no
    group formed) and the CPU pass plan (the CPU backend only)."""

    groups: PrefixGroups | None = None
    plan: AttentionPlan | None = None

    @property
    def empty(self) -> bool:
        """Nothing planned: the forward's attention depends on its tensors alone (what a CUDA graph
        can replay, services/worker/cuda_graphs.py)."""
        return self.groups is None and self.plan is None


NO_META = AttentionMeta()


class AttentionBackend(ABC):
    """One way of running attention over the KV pool (see the module docstring).

    Holds the pool and the slot table, which never move (resizes keep every address); not
    thread-safe, like the engine that owns it.
    """

    # Its decode forwards may be captured in CUDA graphs (services/worker/cuda_graphs.py): a plan
    # that is empty for a batch leaves the forward depending on its tensors alone.
    graphs_replay_decodes = False

    def __init__(self, kv: KVPool, req_to_token: ReqToTokenTable) -> None:
        self.kv = kv
        self.req_to_token = req_to_token

    @abstractmethod
    def prepare(
        self, rows: list[int], start_pos: list[int], extend_lens: list[int], logit_rows: list[int] | None = None
    ) -> AttentionMeta:
        """The per-forward plan of a batch in which request ``b`` owns row ``rows[b]``, has
        ``start_pos[b]`` cached tokens and ``extend_lens[b] >= 1`` new ones, of which the last
        ``logit_rows[b]`` give logits (``None``: no ``keep`` will be asked). Reads the host slot
        table (this step's slots already written); mutates nothing."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, scale: float,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store ``k, v [T, Hkv, D]`` at ``batch.out_slots`` in KV layer ``layer`` and attend
        ``q [T, Hq, D]``; returns ``[T, Hq, D]`` in the pool's dtype, or with ``keep``
        (``batch.logit_index``) the rows of those tokens alone. ``batch`` must have been built with
        this backend (its ``attn`` is this backend's plan)."""
        k_cache, v_cache = self.kv.layer(layer)
        k = k.to(k_cache.dtype).contiguous()
        v = v.to(v_cache.dtype).contiguous()
        q = q.to(k_cache.dtype)
        store_kv(k_cache, v_cache, batch.out_slots, k, v, padded=batch.padded)
        if keep is None:
            return self._attend(q, k, v, k_cache, v_cache, batch, scale)
        return self._attend_kept(q, keep, k, v, k_cache, v_cache, batch, scale)

    @abstractmethod
    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        batch: ForwardBatch, scale: float,
    ) -> torch.Tensor:
        """Attention of ``q`` once this step's ``k, v`` are stored in ``k_cache, v_cache``."""

    def _attend_kept(
        self, q: torch.Tensor, keep: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, batch: ForwardBatch, scale: float,
    ) -> torch.Tensor:
        """``_attend``'s rows ``keep`` alone; here every row is attended, then those are taken."""
        return self._attend(q, k, v, k_cache, v_cache, batch, scale).index_select(0, keep)


class ReferenceAttention(AttentionBackend):
    """The torch references: whole rows gathered token by token, padded to the longest request."""

    def prepare(
        self, rows: list[int], start_pos: list[int], extend_lens: list[int], logit_rows: list[int] | None = None
    ) -> AttentionMeta:
        return NO_META

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        batch: ForwardBatch, scale: float,
    ) -> torch.Tensor:
        r2t = self.req_to_token.table
        if batch.is_decode:
            return decode_attention_torch(q, k_cache, v_cache, r2t, batch.rows, batch.seq_lens, scale)
        return extend_attention_torch(q, k_cache, v_cache, r2t, batch.rows, batch.start_pos, batch.extend_lens, scale)


class CpuAttention(AttentionBackend):
    """Torch's fused CPU flash attention pass by pass, planned once per forward; decodes through the
    native paged kernel where it is built (``native_decode``: fp32 pools); with ``cascade``, each
    prefix group's shared run attended once per group."""

    def __init__(self, kv: KVPool, req_to_token: ReqToTokenTable, cascade: bool, native_decode: bool) -> None:
        super().__init__(kv, req_to_token)
        self.cascade = cascade
        self.native_decode = native_decode
        # Prefill chunks too, where the kernel's several-row path takes the head size.
        self.native_extend = native_decode and kv.head_dim % 16 == 0

    def prepare(
        self, rows: list[int], start_pos: list[int], extend_lens: list[int], logit_rows: list[int] | None = None
    ) -> AttentionMeta:
        table = self.req_to_token.host
        groups = find_prefix_groups(table, rows, start_pos, self.kv.device) if self.cascade else None
        plan = plan_attention(table, rows, start_pos, extend_lens, groups, self.native_decode, self.native_extend,
                              logit_rows)
        return AttentionMeta(groups, plan)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        batch: ForwardBatch, scale: float,
    ) -> torch.Tensor:
        plan = batch.attn.plan
        assert plan is not None, "a batch for the CPU backend is built with its plan"
        return run_attention(plan, q, k, v, k_cache, v_cache, scale)

    def _attend_kept(
        self, q: torch.Tensor, keep: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, batch: ForwardBatch, scale: float,
    ) -> torch.Tensor:
        """The native kernel's pass planned for the kept rows alone (``AttentionPlan.kept``) where
        ``prepare`` made one, else the default."""
        plan = batch.attn.plan
        if plan is not None and plan.kept is not None:
            return run_attention(plan, q.index_select(0, keep), k, v, k_cache, v_cache, scale, kept=True)
        return super()._attend_kept(q, keep, k, v, k_cache, v_cache, batch, scale)


class TritonAttention(AttentionBackend):
    """The Triton kernels; with ``cascade``, a pure decode batch in which prefix groups formed runs
    the cascade decode (shared runs once per group, tails, merge), every other batch the flat
    kernels."""

    graphs_replay_decodes = True

    def __init__(self, kv: KVPool, req_to_token: ReqToTokenTable, cascade: bool) -> None:
        super().__init__(kv, req_to_token)
        self.cascade = cascade

    def prepare(
        self, rows: list[int], start_pos: list[int], extend_lens: list[int], logit_rows: list[int] | None = None
    ) -> AttentionMeta:
        if not self.cascade:
            return NO_META
        return AttentionMeta(find_prefix_groups(self.req_to_token.host, rows, start_pos, self.kv.device))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        batch: ForwardBatch, scale: float,
    ) -> torch.Tensor:
        r2t = self.req_to_token.table
        if batch.is_decode and batch.attn.groups is not None:
            return cascade_decode_attention(
                q, k_cache, v_cache, r2t, batch.rows, batch.seq_lens, batch.attn.groups, scale, impl="triton"
            )
        if batch.is_decode:
            return decode_attention(q, k_cache, v_cache, r2t, batch.rows, batch.seq_lens, scale, impl="triton")
        return extend_attention(
            q, k_cache, v_cache, r2t, batch.rows, batch.start_pos, batch.extend_lens, scale, impl="triton"
        )


def attention_backend(path: AttentionPath, kv: KVPool, req_to_token: ReqToTokenTable) -> AttentionBackend:
    """The backend for ``EngineConfig.attention`` on the pool's device: ``reference`` anywhere; else
    the CPU backend on a CPU (the native decode where it is built for the pool's dtype), Triton on
    CUDA, and the references on any other device."""
    device = kv.device.type
    if path == "reference" or device not in ("cpu", "cuda"):
        return ReferenceAttention(kv, req_to_token)
    cascade = path == "cascade"
    if device == "cpu":
        return CpuAttention(kv, req_to_token, cascade, native_decode=paged_decode_available(kv.dtype))
    return TritonAttention(kv, req_to_token, cascade)
