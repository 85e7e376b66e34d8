"""Chunked (WY / UT-transform) form of the gated delta rule, for extends on the CPU.

The token-by-token recurrence (``kernels.gated_delta``) and this chunked form compute the same
function, but in fp32 they round differently, and on small random checkpoints the difference
reaches 1e-4 in the logits. transformers evaluates every multi-token forward in this chunked
form (64-token chunks counted from the first new token) and single tokens with the recurrence;
doing the same keeps every cache path within 1e-4 of it. It is also far faster than the
recurrence on a CPU for long prompts (a few matmuls per 64 tokens instead of one per token).

For one chunk of ``C`` tokens with start state ``S0``, per value head, let ``G_t`` be the
cumulative log decay inside the chunk and ``A`` the strictly lower ``C x C`` matrix
``A[t, j] = beta_t exp(G_t - G_j) (k_t . k_j)``. The delta-rule writes ``u`` solve the unit lower
triangular system ``(I + A) u = beta v - beta exp(G) (k^T S0)``; then::

    o_t = exp(G_t) q_t^T S0 + sum_{j <= t} exp(G_t - G_j) (q_t . k_j) u_j
    S_C = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def gated_delta_extend_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_index: int,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """Same contract as ``kernels.gated_delta.gated_delta_extend`` (state updated in place).

    ``q, k [T, Hk, Dk]`` L2-normalised (``q`` pre-scaled), ``v [T, Hv, Dv]``, ``g, beta [T, Hv]``,
    ``state [N, Hv, Dk, Dv]`` fp32; returns ``[T, Hv, Dv]`` in ``q``'s dtype.
    """
    t_len, hv = v.shape[0], v.shape[1]
    rep = hv // q.shape[1]
    # -> [Hv, T, D] fp32, key heads shared by `rep` consecutive value heads.
    qf, kf = (x.float().repeat_interleave(rep, dim=1).transpose(0, 1) for x in (q, k))
    vf = v.float().transpose(0, 1)
    gf, bf = g.float().transpose(0, 1), beta.float().transpose(0, 1)
    pad = (-t_len) % chunk
    # Zero padding is inert: k = 0 and beta = 0 write nothing, g = 0 decays nothing.
    qf, kf, vf = (F.pad(x, (0, 0, 0, pad)) for x in (qf, kf, vf))
    gf, bf = F.pad(gf, (0, pad)), F.pad(bf, (0, pad))
    n = (t_len + pad) // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(hv, n, chunk, *x.shape[2:])

    qc, kc, vc = chunks(qf), chunks(kf), chunks(vf)
    bc, cum = chunks(bf), chunks(gf).cumsum(-1)  # [Hv, n, C]
    kb, vb = kc * bc[..., None], vc * bc[..., None]
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()
    # Only the strictly lower part of (kb k^T * decay) enters: the solver treats the diagonal as 1.
    system = (kb @ kc.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay
    q_dec = qc * cum.exp()[..., None]
    k_dec = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    s = state[state_index].float()
    out = torch.empty_like(vc)
    for i in range(n):
        u_i = u[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + attn[:, i] @ u_i
        s = s * chunk_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ u_i
    state[state_index] = s.to(state.dtype)
    return out.reshape(hv, -1, vf.shape[-1])[:, :t_len].transpose(0, 1).to(q.dtype)
