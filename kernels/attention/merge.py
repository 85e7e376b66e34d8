"""The exact merge of attention passes over disjoint keys, by log-sum-exp.

A token's attention over keys ``A ∪ B`` (disjoint) is the weighted mean of its attention over ``A``
and over ``B``, each weighted by its share of the softmax denominator: ``exp(lse_a)`` and
``exp(lse_b)``. Every split pass — a prefix group's shared run and each member's own rest, a
prefill chunk's cached prefix and its new tokens, a decode's run read in place and its gathered rest
— returns its LSE so that it can be merged here, exactly up to fp32 rounding. Plain torch: it runs
wherever the passes ran (the CPU backend and the Triton cascade decode alike).
"""

from __future__ import annotations

import torch


def merge_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two attention passes over disjoint keys: ``o [N, H, D]``, ``lse [N, H]`` (natural log).

    Returns the merged ``(o, lse)`` in fp32. A pass over no keys (``lse = -inf``, ``o`` finite) leaves
    the other unchanged, as long as the other saw at least one key."""
    m = torch.maximum(lse_a, lse_b)
    w_a = torch.exp(lse_a - m)
    w_b = torch.exp(lse_b - m)
    total = w_a + w_b
    o = (o_a.float() * (w_a / total)[..., None]) + (o_b.float() * (w_b / total)[..., None])
    return o, m + torch.log(total)
