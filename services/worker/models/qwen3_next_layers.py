"""Qwen3-Next's own layers: zero-centred RMSNorm and gated full attention (partial rotary: ``RotaryEmbedding``).

They differ from Qwen3's on purpose, and each difference changes the logits:

* RMSNorm stores its weight as an offset from one and multiplies in fp32: ``x_hat * (1 + w)``.
* ``q_proj`` emits, per head, a query and a gate of ``head_dim`` each; the attention output is
  multiplied by ``sigmoid(gate)`` before ``o_proj``.
* Rotary covers only the first ``partial_rotary_factor * head_dim`` dims of q and k.

Full-attention K/V live in the slot-indexed pool and go through the engine's attention backend
(``ctx.attn``, ``services.worker.attention``), exactly like Qwen3's.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import fused_triton
from services.worker.batch import ForwardBatch, ForwardContext
from services.worker.models.layers import RMSNorm, RotaryEmbedding
from services.worker.tp import SINGLE, RowLinear, Tp, column_linear


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm whose weight is an offset from one: ``(x_hat * (1 + w))`` computed in fp32
    (``RMSNorm(unit_offset=True)``, its weight starting at zero)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps, unit_offset=True)
        nn.init.zeros_(self.weight)


class GatedAttention(nn.Module):
    """Full attention with q/k norm, partial rotary and a per-head sigmoid output gate.

    ``forward`` stores the new tokens' K/V at ``batch.out_slots`` in KV-pool layer ``kv_layer``
    and attends over each request's ``req_to_token`` row (cached prefix + new tokens).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        eps: float,
        kv_layer: int,
        tp: Tp = SINGLE,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}"
            )
        kv0, hkv = tp.kv_heads(num_kv_heads, num_heads)
        kv_rows = ((kv0 * head_dim, (kv0 + hkv) * head_dim),)
        self.tp = tp
        self.kv_layer = kv_layer
        self.hq, self.hkv, self.d = num_heads // tp.size, hkv, head_dim  # this rank's heads
        # Tensor parallel: by heads (q_proj's rows are [query | gate] per head, so an even split
        # keeps each head's pair together); o_proj row-parallel, all-reduced.
        self.q_proj = column_linear(hidden_size, num_heads * head_dim * 2, tp, bias)
        self.k_proj = column_linear(hidden_size, num_kv_heads * head_dim, tp, bias, kv_rows)
        self.v_proj = column_linear(hidden_size, num_kv_heads * head_dim, tp, bias, kv_rows)
        self.o_proj = RowLinear(num_heads * head_dim, hidden_size, tp, bias)
        self.q_norm = ZeroCentredRMSNorm(head_dim, eps)
        self.k_norm = ZeroCentredRMSNorm(head_dim, eps)

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch, ctx: ForwardContext,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """With ``keep`` (token indices), every token's K/V is stored and only those tokens are
        attended, gated, projected and returned."""
        t = x.shape[0]
        # q_proj is laid out per head as [query (D) | gate (D)].
        q, gate = torch.chunk(self.q_proj(x).view(t, self.hq, 2 * self.d), 2, dim=-1)
        k = self.k_proj(x).view(t, self.hkv, self.d)
        v = self.v_proj(x).view(t, self.hkv, self.d)
        cos, sin = rotary.cos_sin(batch.positions)
        if fused_triton.usable(q, k, self.q_norm.weight, self.k_norm.weight):
            # CUDA: each norm + rotary one kernel, in place (q a view of the projection's query half).
            for h, norm in ((q, self.q_norm), (k, self.k_norm)):
                fused_triton.rms_norm_rope_(h, norm.weight, norm.eps, cos, sin, rotary.rotary_dim, unit_offset=True)
        else:
            q, k = rotary.apply(self.q_norm(q), cos, sin), rotary.apply(self.k_norm(k), cos, sin)
        o = ctx.attn.forward(q, k, v, self.kv_layer, batch, self.d**-0.5, keep)
        gate = gate.reshape(t, -1)
        if keep is not None:
            gate = gate.index_select(0, keep)
        o = o.to(x.dtype).flatten(1) * torch.sigmoid(gate)
        return self.tp.all_reduce(self.o_proj(o))
