"""Qwen3-Next's own layers: zero-centred RMSNorm, partial rotary, gated full attention.

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
from services.worker.models.layers import RMSNorm
from services.worker.tp import SINGLE, RowLinear, Tp, column_linear


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm whose weight is an offset from one: ``(x_hat * (1 + w))`` computed in fp32
    (``RMSNorm(unit_offset=True)``, its weight starting at zero)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps, unit_offset=True)
        nn.init.zeros_(self.weight)


class PartialRotary:
    """Default RoPE on the first ``rotary_dim`` dims of each head (rotate-half layout).

    Not a module and no buffer: the model is built on the meta device, so the frequencies are
    computed on first use, on the device of the positions, and cached per device.
    """

    __slots__ = ("_inv_freq", "base", "rotary_dim")

    def __init__(self, head_dim: int, partial_rotary_factor: float, base: float) -> None:
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(
                f"partial_rotary_factor={partial_rotary_factor} gives rotary dim {self.rotary_dim} "
                f"for head_dim={head_dim}; it must be even and in (0, head_dim]"
            )
        self.base = base
        self._inv_freq: torch.Tensor | None = None

    def _freqs(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
            self._inv_freq = 1.0 / (self.base**exps)
        return self._inv_freq

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, rotary_dim / 2]`` (fp32): the halves that ``__call__`` repeats."""
        freqs = positions.float()[:, None] * self._freqs(positions.device)[None, :]
        return freqs.cos(), freqs.sin()

    def __call__(self, positions: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        """Rotate each ``x [T, H, D]`` by its token's position; dims past ``rotary_dim`` pass through."""
        freqs = positions.float()[:, None] * self._freqs(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        half = self.rotary_dim // 2
        out = []
        for x in xs:
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
            rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
            rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
            out.append(torch.cat((rot * cos + rotated * sin, rest), dim=-1))
        return out


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

    def forward(self, x: torch.Tensor, rotary: PartialRotary, batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        # q_proj is laid out per head as [query (D) | gate (D)].
        q, gate = torch.chunk(self.q_proj(x).view(t, self.hq, 2 * self.d), 2, dim=-1)
        k = self.k_proj(x).view(t, self.hkv, self.d)
        v = self.v_proj(x).view(t, self.hkv, self.d)
        if fused_triton.usable(q, k, self.q_norm.weight, self.k_norm.weight):
            # CUDA: each norm + rotary one kernel, in place (q a view of the projection's query half).
            cos, sin = rotary.cos_sin(batch.positions)
            for h, norm in ((q, self.q_norm), (k, self.k_norm)):
                fused_triton.rms_norm_rope_(h, norm.weight, norm.eps, cos, sin, rotary.rotary_dim, unit_offset=True)
        else:
            q, k = rotary(batch.positions, self.q_norm(q), self.k_norm(k))
        o = ctx.attn.forward(q, k, v, self.kv_layer, batch, self.d**-0.5)
        o = o.to(x.dtype).reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.tp.all_reduce(self.o_proj(o))
