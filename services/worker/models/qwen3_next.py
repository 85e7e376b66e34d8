"""Qwen3-Next: a hybrid of gated DeltaNet layers and gated full attention, with sparse MoE.

Layer ``i`` mixes tokens with ``linear_attn`` (state in a Mamba slot, see ``linear_attn.py``) or
``self_attn`` (K/V in the slot-indexed pool, see ``qwen3_next_layers.py``) as
``layer_types[i]`` says, then applies a sparse MoE (or a dense SwiGLU for ``mlp_only_layers``).
Full-attention layers are numbered 0, 1, ... in model order as KV-pool layers; linear layers
likewise as Mamba-pool layers. Parameter names equal the Hugging Face checkpoint's, so the
shared loader matches tensors by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels.linear import Linear
from services.worker.batch import ForwardBatch, ForwardContext
from services.worker.mamba_pool import MambaSpec
from services.worker.models.layers import RotaryEmbedding, SwiGLU
from services.worker.models.linear_attn import GatedDeltaNet, StateSpans
from services.worker.models.moe import SparseMoe
from services.worker.models.qwen3_next_layers import GatedAttention, ZeroCentredRMSNorm
from services.worker.tp import SINGLE, Tp

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True, slots=True)
class Qwen3NextArgs:
    """The ``config.json`` fields the model uses, with Hugging Face's defaults where it has them."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen3NextArgs:
        """Read a ``config.json`` dict; raises ``ValueError`` naming a missing or bad field."""
        required = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
        )
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"Qwen3-Next config.json lacks {', '.join(missing)}")
        n = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types")
        if types is None:  # older configs: every `full_attention_interval`-th layer is full attention
            every = int(cfg.get("full_attention_interval", 4))
            types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
        if len(types) < n or any(t not in (LINEAR, FULL) for t in types[:n]):
            raise ValueError(
                f"Qwen3-Next layer_types must name {n} layers, each {LINEAR!r} or {FULL!r}: {types}"
            )
        # Newer configs nest rope settings in rope_parameters; older ones keep them at top level.
        rope = {**cfg, **(cfg.get("rope_parameters") or {})}
        if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
            raise ValueError("Qwen3-Next: only the default rope type is supported")
        known = {f: cfg[f] for f in cls.__dataclass_fields__ if f in cfg and cfg[f] is not None}
        known.update(
            layer_types=tuple(types[:n]),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.25)),
        )
        return cls(**known)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (linear or full attention), then MoE / MLP."""

    def __init__(self, a: Qwen3NextArgs, index: int, state_layer: int, tp: Tp = SINGLE) -> None:
        super().__init__()
        self.is_linear = a.layer_types[index] == LINEAR
        self.state_layer = state_layer  # Mamba-pool layer if linear, else KV-pool layer
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(
                a.hidden_size,
                a.linear_num_key_heads,
                a.linear_num_value_heads,
                a.linear_key_head_dim,
                a.linear_value_head_dim,
                a.linear_conv_kernel_dim,
                a.rms_norm_eps,
                tp,
            )
        else:
            self.self_attn = GatedAttention(
                a.hidden_size,
                a.num_attention_heads,
                a.num_key_value_heads,
                a.head_dim,
                a.attention_bias,
                a.rms_norm_eps,
                state_layer,
                tp,
            )
        sparse = (
            index not in a.mlp_only_layers and a.num_experts > 0 and (index + 1) % a.decoder_sparse_step == 0
        )
        self.mlp: nn.Module = (
            SparseMoe(
                a.hidden_size,
                a.num_experts,
                a.num_experts_per_tok,
                a.moe_intermediate_size,
                a.shared_expert_intermediate_size,
                a.norm_topk_prob,
                tp,
            )
            if sparse
            else SwiGLU(a.hidden_size, a.intermediate_size, tp=tp)
        )
        self.input_layernorm = ZeroCentredRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding,
        spans: StateSpans | None,
        batch: ForwardBatch,
        ctx: ForwardContext,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """With ``keep`` (token indices), only those tokens' rows are returned: a full-attention
        mixer attends them alone (every token's K/V stored), a linear one still runs every token
        (its recurrent state advances through all), and the MLP runs on them alone."""
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            # The model forward checked that spans and ctx.mamba exist when any layer is linear.
            assert spans is not None and ctx.mamba is not None
            i = self.state_layer
            h = self.linear_attn(h, spans, ctx.mamba.conv[i], ctx.mamba.ssm[i])
            if keep is not None:
                h = h.index_select(0, keep)
        else:
            assert self.self_attn is not None
            h = self.self_attn(h, rotary, batch, ctx, keep)
        x = (x if keep is None else x.index_select(0, keep)) + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's ``model.*`` prefix)."""

    def __init__(self, a: Qwen3NextArgs, tp: Tp = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        layers, n_lin, n_full = [], 0, 0
        for i, kind in enumerate(a.layer_types):
            layers.append(DecoderLayer(a, i, n_lin if kind == LINEAR else n_full, tp))
            n_lin, n_full = (n_lin + 1, n_full) if kind == LINEAR else (n_lin, n_full + 1)
        self.layers = nn.ModuleList(layers)
        self.num_linear_layers, self.num_full_layers = n_lin, n_full
        self.norm = ZeroCentredRMSNorm(a.hidden_size, a.rms_norm_eps)


class Qwen3NextForCausalLM(nn.Module):
    """The worker's Qwen3-Next (see ``registry.CausalLM`` for the protocol).

    ``forward(batch, ctx)`` stores K/V of full-attention layers at ``batch.out_slots``, reads and
    updates the Mamba slot ``batch.mamba_slots[b]`` of every request in every linear layer (the
    slot must hold the state after position ``start_pos[b] - 1``: zeros for a fresh request, a
    copy of a cached state for a prefix hit), and returns logits ``[len(logit_index), vocab]``.
    """

    # The multi-token-prediction head (``qwen3_next_mtp.py``) is loaded only for MTP drafting.
    optional_checkpoint_prefixes = ("mtp.",)

    def __init__(self, hf_config: dict[str, Any], tp: Tp = SINGLE) -> None:
        super().__init__()
        a = Qwen3NextArgs.from_hf(hf_config)
        self.args = a
        self.model = Qwen3NextModel(a, tp)
        self.lm_head = Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        try:  # RotaryEmbedding checks the dim; the message names the config field that set it
            self.rotary = RotaryEmbedding(a.head_dim, int(a.head_dim * a.partial_rotary_factor), a.rope_theta)
        except ValueError as e:
            raise ValueError(f"partial_rotary_factor={a.partial_rotary_factor}: {e}") from e
        self.vocab_size = a.vocab_size
        self.num_kv_layers = self.model.num_full_layers
        self.num_kv_heads = tp.kv_heads(a.num_key_value_heads, a.num_attention_heads)[1]
        self.head_dim = a.head_dim

    def _decoder_layers(self) -> list[DecoderLayer]:
        return [m for m in self.model.layers if isinstance(m, DecoderLayer)]

    @property
    def mamba_spec(self) -> MambaSpec:
        """One Mamba slot: conv window ``[C, K-1]`` in the model dtype, recurrent state fp32."""
        if self.model.num_linear_layers == 0:
            raise ValueError("this Qwen3-Next config has no linear-attention layer, hence no Mamba state")
        first = next(m.linear_attn for m in self._decoder_layers() if m.linear_attn is not None)
        return MambaSpec(
            num_layers=self.model.num_linear_layers,
            conv_shape=first.conv_state_shape,
            ssm_shape=first.ssm_state_shape,
            conv_dtype=self.lm_head.weight.dtype,
            ssm_dtype=torch.float32,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        # Past the last layer's mixer only the logit rows go on (``DenseModel.forward`` says why).
        # The last rows are the logit rows either way (``ForwardBatch.keep``).
        return self.lm_head(self.model.norm(self._layers(batch, ctx, batch.keep)))

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits and the hidden state of every new token after the final norm
        ``[T, H]`` (what the MTP head reads). The logits rows are normed on their own, exactly as
        ``forward`` does; ``forward`` runs the last layer's MLP on those rows alone, so the two agree
        to rounding."""
        x = self._layers(batch, ctx)
        return self.lm_head(self.model.norm(x[batch.logit_index])), self.model.norm(x)

    def _layers(self, batch: ForwardBatch, ctx: ForwardContext, keep: torch.Tensor | None = None) -> torch.Tensor:
        spans = None
        if self.model.num_linear_layers:
            if ctx.mamba is None or batch.mamba_slots is None:
                raise ValueError("Qwen3-Next needs a Mamba pool and a mamba_slot for every request")
            cu = [0]
            for n in batch.extend_lens_list:
                cu.append(cu[-1] + n)
            spans = StateSpans(tuple(cu), tuple(batch.mamba_slots.tolist()), ctx.mamba.tracing)
        x = self.model.embed_tokens(batch.input_ids)
        layers = list(self.model.layers)
        for layer in layers[:-1]:
            x = layer(x, self.rotary, spans, batch, ctx)
        return layers[-1](x, self.rotary, spans, batch, ctx, keep)
