"""Qwen3-Next's sparse mixture of experts with a sigmoid-gated shared expert.

For each token: softmax over the router logits (fp32), keep the top-k experts (renormalised to
sum to one when ``norm_topk_prob``), add their SwiGLU outputs weighted by those probabilities,
and add the shared expert's output scaled by ``sigmoid(shared_expert_gate(x))``. Parameter
names match the Hugging Face checkpoint (``mlp.gate``, ``mlp.experts.{e}.*``,
``mlp.shared_expert.*``, ``mlp.shared_expert_gate``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with the checkpoint's ``gate_proj/up_proj/down_proj`` names."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Top-k routed experts plus one always-on shared expert; ``forward`` maps ``[T, H] -> [T, H]``."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        expert_intermediate_size: int,
        shared_intermediate_size: int,
        norm_topk_prob: bool,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(hidden_size, expert_intermediate_size) for _ in range(num_experts)
        )
        self.shared_expert = SwiGLU(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)

        out = torch.zeros_like(x)
        # Loop over the experts that received tokens (not over tokens): few large matmuls.
        for e in torch.unique(chosen).tolist():
            tok, which = torch.where(chosen == e)
            y = self.experts[e](x[tok]) * weights[tok, which, None]
            out.index_add_(0, tok, y)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out + shared
