"""Qwen3-Next's multi-token-prediction (MTP) head: the checkpoint's ``mtp.*`` tensors.

The released checkpoints carry, beside the target model, one extra decoder block that predicts
the token after next::

    e = pre_fc_norm_embedding(embed_tokens(token at p + 1))
    h = pre_fc_norm_hidden(target hidden at p)            # after the target's final norm
    x = fc(concat(e, h))                                  # fc.weight: [hidden, 2 * hidden]
    x = layers.0(x)                                       # full attention + the model's MoE
    g = norm(x)                                           # logits = lm_head(g): token at p + 2

at position ``p`` (the rotary position of the target's token ``p``). Embedding and LM head are the
target's (shared, not in ``mtp.*``); the norms are zero-centred like the target's. Chaining: the
next draft feeds ``g`` back as the hidden state, with the draft just predicted as the token. This
is the layout vLLM's and SGLang's Qwen3-Next MTP read (``num_nextn_predict_layers`` layers, one
in every released checkpoint); transformers ignores ``mtp.*``.

The head's single attention layer is KV-pool layer 0 of its own pool (``services.worker.mtp``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from services.worker.batch import ForwardBatch, ForwardContext
from services.worker.models.qwen3_next import FULL, DecoderLayer, Qwen3NextArgs, Qwen3NextForCausalLM
from services.worker.models.qwen3_next_layers import ZeroCentredRMSNorm

PREFIX = "mtp."
ARCHITECTURE = "Qwen3NextForCausalLM"


def mtp_layers(hf_config: dict[str, Any]) -> int:
    """MTP layers ``config.json`` declares (``num_nextn_predict_layers``, or Qwen3.5's
    ``mtp_num_hidden_layers``); 1 when it says nothing (the weights decide, see ``mtp_problem``)."""
    value = hf_config.get("num_nextn_predict_layers", hf_config.get("mtp_num_hidden_layers", 1))
    return int(value or 0)


def mtp_problem(model_dir: Path | str) -> str | None:
    """Why ``model_dir`` cannot draft with its MTP head (None if it can): not Qwen3-Next, no
    ``mtp.*`` tensor in its weights, or a layer count other than one. Reads tensor names only."""
    from services.worker.loader import INDEX_FILE, LoadError, read_config, weight_files

    model_dir = Path(model_dir)
    try:
        cfg = read_config(model_dir)
        archs = cfg.get("architectures") or ["?"]
        if archs[0] != ARCHITECTURE:
            return f"{model_dir}: MTP drafting needs a Qwen3-Next checkpoint ({ARCHITECTURE}), this one is {archs[0]}"
        index = model_dir / INDEX_FILE
        if index.is_file():
            names: list[str] = list(json.loads(index.read_text()).get("weight_map", {}))
        else:
            names = []
            for f in weight_files(model_dir):
                with safe_open(str(f), framework="pt") as st:
                    names += list(st.keys())
    except (LoadError, OSError, ValueError) as e:
        return str(e)
    if not any(n.startswith(PREFIX) for n in names):
        return f"{model_dir}: the checkpoint has no MTP head (no {PREFIX}* tensors)"
    if (n := mtp_layers(cfg)) != 1:
        return f"{model_dir}: num_nextn_predict_layers is {n}; MTP drafting supports exactly 1"
    return None


class Qwen3NextMtp(nn.Module):
    """The ``mtp.*`` block. ``state_dict`` names are the checkpoint's without the ``mtp.`` prefix.

    ``forward(batch, ctx, hidden)``: ``batch.input_ids`` are the tokens at ``p + 1``,
    ``batch.positions`` the positions ``p``, ``hidden [T, H]`` the hidden states at ``p`` (the
    target's after its final norm, or this head's own output when chaining). Stores K/V of its
    one attention layer at ``batch.out_slots`` in ``ctx.attn``'s pool (layer 0) and returns its
    normed output for the rows ``batch.keep`` names (every row when it is None; none when the
    batch wants no logits: an upkeep pass that only writes K/V runs no attention or MoE);
    ``logits(g)`` applies the shared LM head.
    """

    def __init__(self, hf_config: dict[str, Any], target: Qwen3NextForCausalLM) -> None:
        super().__init__()
        a: Qwen3NextArgs = replace(target.args, layer_types=(FULL,))
        h = a.hidden_size
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, a.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, a.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        # Index 0 decides sparse vs dense MLP as for the target's layer 0 (vLLM does the same).
        self.layers = nn.ModuleList([DecoderLayer(a, 0, 0)])
        self.norm = ZeroCentredRMSNorm(h, a.rms_norm_eps)
        # Shared with the target, kept out of this module's state_dict (a tuple is not registered).
        self._shared = (target.model.embed_tokens, target.lm_head, target.rotary)
        self.num_kv_layers = 1
        self.num_kv_heads = target.num_kv_heads
        self.head_dim = target.head_dim

    def forward(self, batch: ForwardBatch, ctx: ForwardContext, hidden: torch.Tensor) -> torch.Tensor:
        embed, _, rotary = self._shared
        e = self.pre_fc_norm_embedding(embed(batch.input_ids))
        x = self.fc(torch.cat((e, self.pre_fc_norm_hidden(hidden).to(e.dtype)), dim=-1))
        for layer in self.layers:
            x = layer(x, rotary, None, batch, ctx, batch.keep)
        out: torch.Tensor = self.norm(x)
        return out

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return self._shared[1](g)


def load_mtp(model_dir: Path | str, target: nn.Module, dtype: torch.dtype, device: torch.device) -> Qwen3NextMtp:
    """Build the MTP head of ``target`` (the loaded Qwen3-Next of ``model_dir``) and fill it from
    the checkpoint's ``mtp.*`` tensors, strictly (a missing or extra one is a ``LoadError``)."""
    from services.worker.loader import LoadError, fill_module, read_config, read_tensors, skeleton

    model_dir = Path(model_dir)
    if (problem := mtp_problem(model_dir)) is not None:
        raise LoadError(f"speculative MTP: {problem}")
    assert isinstance(target, Qwen3NextForCausalLM)  # mtp_problem checked the architecture
    with skeleton():
        head = Qwen3NextMtp(read_config(model_dir), target)
    tensors = read_tensors(model_dir, dtype, keep=lambda n: n.startswith(PREFIX))
    fill_module(head, {n[len(PREFIX) :]: t for n, t in tensors.items()}, device)
    head.eval()
    return head
