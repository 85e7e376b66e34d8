"""Torch references of the paged attention kernels: the truth the fast paths are tested against.

They gather whole rows token by token (the flat ones pad the batch to its longest request) and
materialise every score, so they are slow; ``EngineConfig.attention = "reference"`` runs the model
on them for comparison. Scores and softmax are in fp32; outputs in q's dtype (the flat ones) or fp32
with a natural-log LSE (the cascade ones, which are merged afterwards).

* flat: :func:`extend_attention_torch` (new tokens over their cached prefix and themselves, causal)
  and :func:`decode_attention_torch` (one token per request);
* cascade decode: :func:`shared_prefix_decode_torch` (each prefix group over its shared run) and
  :func:`tail_decode_torch` (each request over the rest of its row), merged by
  ``kernels.attention.merge.merge_states``.
"""

from __future__ import annotations

import torch

from kernels.attention.prefix_groups import PrefixGroups


def _attend_one(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int, scale: float
) -> torch.Tensor:
    """Causal attention of ``q [n, Hq, D]`` (positions ``first_pos ..``) over ``keys/values [L, Hkv, D]``."""
    n, num_q_heads, head_dim = q.shape
    length, num_kv_heads, _ = keys.shape
    group = num_q_heads // num_kv_heads
    # [Hkv, G, n, D] @ [Hkv, 1, D, L]: the KV heads are broadcast over their query group, never copied.
    qf = q.float().view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kf = keys.float().permute(1, 2, 0).unsqueeze(1)
    vf = values.float().permute(1, 0, 2).unsqueeze(1)
    scores = torch.matmul(qf, kf) * scale
    q_pos = torch.arange(first_pos, first_pos + n, device=q.device)
    k_pos = torch.arange(length, device=q.device)
    scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [Hkv, G, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, num_q_heads, head_dim).to(q.dtype)


def extend_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    start_pos: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference of ``kernels.attention.launch.extend_attention``: one batched matmul per request."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    offset = 0
    for row, start, n in zip(rows.tolist(), start_pos.tolist(), extend_lens.tolist(), strict=True):
        slots = req_to_token[row, : start + n]
        out[offset : offset + n] = _attend_one(
            q[offset : offset + n], k_cache[slots], v_cache[slots], start, scale
        )
        offset += n
    return out


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference of ``kernels.attention.launch.decode_attention``: the whole batch padded to its longest
    sequence."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if batch == 0:
        return torch.empty_like(q)
    max_len = int(seq_lens.max())
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < seq_lens[:, None]  # [B, Lmax]
    # Entries past seq_len may hold stale or invalid slots: read slot 0 there and mask the score.
    slots = torch.where(valid, req_to_token[rows, :max_len], 0)
    keys = k_cache[slots].float()  # [B, Lmax, Hkv, D]
    values = v_cache[slots].float()
    qf = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,blkd->bkgl", qf, keys) * scale
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgl,blkd->bkgd", torch.softmax(scores, dim=-1), values)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def _attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """``q [n, Hq, D]`` over ``keys/values [L, Hkv, D]`` (no mask) -> o ``[n, Hq, D]``, lse ``[n, Hq]`` fp32."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->nhl", q.float(), k) * scale
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.einsum("nhl,lhd->nhd", torch.exp(scores - lse[..., None]), v)
    return o, lse


def shared_prefix_decode_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
    groups: PrefixGroups, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's members over its shared run; rows in no group get o = 0, lse = -inf."""
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for g in range(groups.num_groups):
        members = torch.tensor(groups.group(g), dtype=torch.int64, device=q.device)
        slots = req_to_token[rows[members[0]], : groups.shared_lens[g]]
        o[members], lse[members] = _attend_rows(q[members], k_cache[slots], v_cache[slots], scale)
    return o, lse


def tail_decode_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
    kv_start: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``b`` over positions ``[kv_start[b], seq_lens[b])`` of its row."""
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for b, (row, start, end) in enumerate(zip(rows.tolist(), kv_start.tolist(), seq_lens.tolist(), strict=True)):
        slots = req_to_token[row, start:end]
        ob, lb = _attend_rows(q[b : b + 1], k_cache[slots], v_cache[slots], scale)
        o[b], lse[b] = ob[0], lb[0]
    return o, lse
