"""Qwen3 (dense, GQA, RMS-normed q/k) and Llama, over the slot-indexed KV pool.

Parameter names equal the Hugging Face ones (``model.layers.N.self_attn.q_proj.weight`` ...), so
the loader matches checkpoint tensors by name. Llama is the same network without q/k norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from kernels.linear import Linear
from services.worker.batch import ForwardBatch, ForwardContext
from services.worker.models.layers import RMSNorm, RotaryEmbedding, SwiGLU
from services.worker.tp import SINGLE, RowLinear, Tp, column_linear


@dataclass(frozen=True, slots=True)
class DenseConfig:
    """The fields of a Qwen3 / Llama ``config.json`` this implementation reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, hf: dict[str, Any], qk_norm: bool) -> DenseConfig:
        """Parse and check a Hugging Face config dict; ``ValueError`` names the offending key."""

        def need(key: str) -> Any:
            if key not in hf or hf[key] is None:
                raise ValueError(f"config.json is missing required key {key!r}")
            return hf[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported")
        theta, factor = _rope(hf)
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rotary_dim=int(head_dim * factor),
            max_position_embeddings=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=qk_norm,
        )


def _rope(hf: dict[str, Any]) -> tuple[float, float]:
    """(theta, partial_rotary_factor) from either the v5 ``rope_parameters`` or the older top-level keys."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be an object, got {type(params).__name__}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return float(theta), float(factor)


class DenseAttention(nn.Module):
    """Tensor parallel: this rank's query heads and the KV heads they read (``Tp.kv_heads``);
    ``o_proj`` row-parallel, all-reduced."""

    def __init__(self, cfg: DenseConfig, kv_layer: int, rotary: RotaryEmbedding, tp: Tp = SINGLE) -> None:
        super().__init__()
        d, bias = cfg.head_dim, cfg.attention_bias
        kv0, nkv = tp.kv_heads(cfg.num_kv_heads, cfg.num_heads)
        kv_rows = ((kv0 * d, (kv0 + nkv) * d),)
        self.tp = tp
        self.q_proj = column_linear(cfg.hidden_size, cfg.num_heads * d, tp, bias)
        self.k_proj = column_linear(cfg.hidden_size, cfg.num_kv_heads * d, tp, bias, kv_rows)
        self.v_proj = column_linear(cfg.hidden_size, cfg.num_kv_heads * d, tp, bias, kv_rows)
        self.o_proj = RowLinear(cfg.num_heads * d, cfg.hidden_size, tp, bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.kv_layer = kv_layer
        self.head_dim = d
        self.scale = d**-0.5
        self.rotary = rotary

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, ctx: ForwardContext,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every token's K/V is stored; with ``keep``, only those tokens are attended, projected and
        returned (``[len(keep), hidden]``)."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, -1, self.head_dim)
        k = self.k_proj(x).view(t, -1, self.head_dim)
        v = self.v_proj(x).view(t, -1, self.head_dim)
        q = self.rotary.norm_apply(q, self.q_norm, cos, sin)
        k = self.rotary.norm_apply(k, self.k_norm, cos, sin)
        o = ctx.attn.forward(q, k, v, self.kv_layer, batch, self.scale, keep)
        return self.tp.all_reduce(self.o_proj(o.flatten(1)))


class DenseDecoderLayer(nn.Module):
    def __init__(self, cfg: DenseConfig, index: int, rotary: RotaryEmbedding, tp: Tp = SINGLE) -> None:
        super().__init__()
        self.self_attn = DenseAttention(cfg, index, rotary, tp)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, tp=tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
        ctx: ForwardContext, keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is ``input_layernorm(h)`` of the residual stream ``h``. Returns the MLP's output and
        the stream after attention: the stream after the layer is their sum, which the caller adds
        in one pass with the next norm (``RMSNorm.add_norm``). With ``keep`` (token indices), both
        are for those tokens only: every token's K/V is still stored."""
        # Residual adds go into the branch's fresh output (a + b == b + a exactly): no new [T, hidden].
        a = self.self_attn(x, cos, sin, batch, ctx, keep)
        if keep is not None:
            h = h.index_select(0, keep)
        return self.mlp(self.post_attention_layernorm.add_norm(a, h)), a


class DenseModel(nn.Module):
    def __init__(self, cfg: DenseConfig, tp: Tp = SINGLE) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DenseDecoderLayer(cfg, i, self.rotary, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states after the final norm for the tokens in ``batch.logit_index``.

        Only those tokens go past the last layer's K/V: the other tokens' K/V is all a later step
        reads of them, so the last layer's attention (where the backend plans it: ``keep``), output
        projection and MLP run on the logit rows alone (a prefill chunk: one row of its hundreds;
        1/num_layers of a prefill's products)."""
        h = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions)
        layers = cast(list[DenseDecoderLayer], list(self.layers))
        x = layers[0].input_layernorm(h)
        keep = batch.keep
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):  # the residual add and the next layer's norm in one pass
                m, a = layer(x, h, cos, sin, batch, ctx)
                x, h = layers[i + 1].input_layernorm.add_norm(m, a), m
            else:
                m, a = layer(x, h, cos, sin, batch, ctx, keep)
                h = m.add_(a)
        return self.norm(h)  # the logit rows: those kept, or every token (``ForwardBatch.keep``)


class Qwen3ForCausalLM(nn.Module):
    """Dense decoder-only LM; see ``services.worker.models.registry.CausalLM`` for the contract."""

    qk_norm = True

    def __init__(self, hf_config: dict[str, Any], tp: Tp = SINGLE) -> None:
        super().__init__()
        cfg = DenseConfig.from_hf(hf_config, qk_norm=self.qk_norm)
        self.config = cfg
        self.model = DenseModel(cfg, tp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            # One Parameter under two names: the loader fills it from whichever name is stored.
            self.lm_head.weight = self.model.embed_tokens.weight
        self.vocab_size = cfg.vocab_size
        self.num_kv_layers = cfg.num_layers
        self.num_kv_heads = tp.kv_heads(cfg.num_kv_heads, cfg.num_heads)[1]
        self.head_dim = cfg.head_dim

    def forward(self, batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """Logits ``[len(batch.logit_index), vocab_size]``; stores the batch's KV through ``ctx.attn``."""
        return self.lm_head(self.model(batch, ctx))


class LlamaForCausalLM(Qwen3ForCausalLM):
    """Llama: Qwen3 without the per-head q/k RMSNorm."""

    qk_norm = False
