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

        # The (token, choice) pairs grouped by expert once (a stable sort: within an expert, tokens
        # in order), so each expert's rows are a slice of one gather and the loop below runs only
        # the experts' own products: a decode step's few tokens reach few experts, and per-expert
        # bookkeeping (a comparison, a nonzero, an index, a scatter each) would cost more than
        # their products. Each expert sees the same rows in the same order as a per-expert
        # selection would give it, and each token's outputs are summed in expert order.
        pairs = chosen.flatten()
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        rows = order // self.top_k  # the token of each pair, grouped by expert
        xs = x[rows]
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n:
                ys.append(self.experts[e](xs[start : start + n], reduce=False))
                start += n
        y = torch.cat(ys) if len(ys) > 1 else (ys[0] if ys else xs)  # no rows: nothing was routed
        y = y * weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, rows, y)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, reduce=False)
        return self.tp.all_reduce(out + shared)
