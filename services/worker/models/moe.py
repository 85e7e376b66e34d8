"""Qwen3-Next's sparse mixture of experts with a sigmoid-gated shared expert.

For each token: softmax over the router logits (fp32), keep the top-k experts (renormalised to
sum to one when ``norm_topk_prob``), add their SwiGLU outputs weighted by those probabilities,
and add the shared expert's output scaled by ``sigmoid(shared_expert_gate(x))``. Parameter
names match the Hugging Face checkpoint (``mlp.gate``, ``mlp.experts.{e}.*``,
``mlp.shared_expert.*``, ``mlp.shared_expert_gate``).
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.models.layers import SwiGLU
from services.worker.tp import SINGLE, Tp


class SparseMoe(nn.Module):
    """Top-k routed experts plus one always-on shared expert; ``forward`` maps ``[T, H] -> [T, H]``.

    Tensor parallel: every expert (and the shared one) split by its intermediate size; the router
    and the shared expert's gate are replicated, so each rank routes alike, sums its partial
    outputs, and one all-reduce per block completes them."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        expert_intermediate_size: int,
        shared_intermediate_size: int,
        norm_topk_prob: bool,
        tp: Tp = SINGLE,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.tp = tp
        self.experts = nn.ModuleList(
            SwiGLU(hidden_size, expert_intermediate_size, tp=tp) for _ in range(num_experts)
        )
        self.shared_expert = SwiGLU(hidden_size, shared_intermediate_size, tp=tp)
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
            y = self.experts[e](x[tok], reduce=False) * weights[tok, which, None]
            out.index_add_(0, tok, y)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, reduce=False)
        return self.tp.all_reduce(out + shared)
