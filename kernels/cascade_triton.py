"""Cascade (prefix-shared) decode attention for the GPU path: shared run, then tails, then merge.

A decode batch whose requests share leading slot runs (``kernels.prefix_groups``) is attended in
two levels:

1. ``shared``: one program per (group, KV head, block of query rows), the query rows being the
   group's members × the ``GROUP`` query heads of that KV head. The shared keys and values are
   loaded once per program and multiplied with a ``[BLOCK_Q, D]`` query tile by ``tl.dot`` (tensor
   cores), instead of once per request as a vector product;
2. ``tail``: the flat decode kernel started at each request's ``kv_start`` (0 outside any group);
3. ``merge_states`` by log-sum-exp (``kernels.attention_cpu``; plain torch, runs on the GPU).

Both kernels write fp32 outputs and natural-log LSEs. The torch references below are the truth the
kernels are tested against (under ``TRITON_INTERPRET=1`` on the CPU, at small sizes); the CPU path
of the server is ``kernels.attention_cpu``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._checks import Impl, check_index, check_same_device, use_triton
from kernels.attention import _check_common
from kernels.attention_cpu import merge_states
from kernels.prefix_groups import PrefixGroups

_LOG2E = math.log2(math.e)
# The kernels run their softmax in base 2 (scores pre-multiplied by log2(e)) and store the natural-log
# LSE the merge expects: ln(sum e^x) = ln(2) * log2(sum 2^(x log2 e)).
_LN2: tl.constexpr = tl.constexpr(math.log(2.0))


# --------------------------------------------------------------------------------------------------
# Torch references
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _shared_kernel(
    q, k_cache, v_cache, o, lse, req_to_token, rows, members, group_starts, shared_lens,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_lb, stride_r2t, stride_slot, scale_log2e,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program = (group g, KV head h, block of BLOCK_Q query rows); row r = member r // GROUP, query
    # head h * GROUP + r % GROUP. Online softmax in base 2 over the shared run of the group's first
    # member's row.
    g = tl.program_id(0)
    h = tl.program_id(1)
    q_block = tl.program_id(2)
    first = tl.load(group_starts + g)
    count = tl.load(group_starts + g + 1) - first
    if q_block * BLOCK_Q < count * GROUP:
        shared = tl.load(shared_lens + g)
        leader = tl.load(rows + tl.load(members + first))
        offs_r = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
        r_mask = offs_r < count * GROUP
        b = tl.load(members + first + offs_r // GROUP, mask=r_mask, other=0)
        head = h * GROUP + offs_r % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q_ptrs = q + b[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :]
        q_tile = tl.load(q_ptrs, mask=r_mask[:, None] & d_mask[None, :], other=0.0)

        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
        for n0 in range(0, shared, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < shared
            slot = tl.load(req_to_token + leader * stride_r2t + offs_n, mask=n_mask, other=0)
            kv_off = slot[:, None] * stride_slot + h * HEAD_DIM + offs_d[None, :]
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k_tile = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)
            v_tile = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee") * scale_log2e
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the first block holds position 0
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision="ieee")
            m_i = m_new
        out = acc / l_i[:, None]
        o_ptrs = o + b[:, None] * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out, mask=r_mask[:, None] & d_mask[None, :])
        tl.store(lse + b * stride_lb + head, (m_i + tl.log2(l_i)) * _LN2, mask=r_mask)


@triton.jit
def _tail_kernel(
    q, k_cache, v_cache, o, lse, req_to_token, rows, kv_start, seq_lens,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_lb, stride_r2t, stride_slot, scale_log2e,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Program = (request b, query head h): the flat decode kernel over [kv_start, seq_len), with its LSE.
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(kv_start + b)
    end = tl.load(seq_lens + b)
    row = tl.load(rows + b)
    kv_head = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_vec = tl.load(q + b * stride_qb + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    m_all = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slot = tl.load(req_to_token + row * stride_r2t + offs_n, mask=n_mask, other=0)
        kv_off = slot[:, None] * stride_slot + kv_head * HEAD_DIM + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_tile = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v_tile = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k_tile * q_vec[None, :], 1) * scale_log2e
        s = tl.where(n_mask, s, float("-inf"))
        m_new = tl.maximum(m_all, tl.max(s, 0))  # finite: the first block holds position kv_start
        alpha = tl.exp2(m_all - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha + tl.sum(p[:, None] * v_tile, 0)
        m_all = m_new
    total = tl.sum(l_i, 0)
    tl.store(o + b * stride_ob + h * stride_oh + offs_d, acc / total, mask=d_mask)
    tl.store(lse + b * stride_lb + h, (m_all + tl.log2(total)) * _LN2)


def shared_prefix_decode_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
    groups: PrefixGroups, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`shared_prefix_decode_torch` by ``_shared_kernel``: same arguments and results. Unchecked
    (the launcher checks); ``groups`` tensors are moved to q's device if they are elsewhere."""
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    if groups.num_groups == 0:
        return o, lse
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    largest = max(groups.group_starts[g + 1] - groups.group_starts[g] for g in range(groups.num_groups))
    block_q = 16 if largest * group <= 16 else 32  # tl.dot needs >= 16 rows
    grid = (groups.num_groups, num_kv_heads, triton.cdiv(largest * group, block_q))
    dev = q.device
    _shared_kernel[grid](
        q, k_cache, v_cache, o, lse, req_to_token, rows, groups.members_t.to(dev), groups.group_starts_t.to(dev),
        groups.shared_lens_t.to(dev),
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), lse.stride(0), req_to_token.stride(0), k_cache.stride(0),
        scale * _LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_Q=block_q,
        BLOCK_N=32,
    )  # fmt: skip
    return o, lse


def tail_decode_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
    kv_start: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tail_decode_torch` by ``_tail_kernel``: same arguments and results (``kv_start[b] <
    seq_lens[b]``, unchecked: an empty range gives NaN)."""
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    batch, num_q_heads, head_dim = q.shape
    if batch == 0:
        return o, lse
    _tail_kernel[(batch, num_q_heads)](
        q, k_cache, v_cache, o, lse, req_to_token, rows, kv_start, seq_lens,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), lse.stride(0), req_to_token.stride(0), k_cache.stride(0),
        scale * _LOG2E,
        GROUP=num_q_heads // k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=64,
    )  # fmt: skip
    return o, lse


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------


def cascade_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    groups: PrefixGroups | None,
    scale: float,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Decode attention (one query per request over ``req_to_token[rows[b], :seq_lens[b]]``), with
    each prefix group's shared run attended once per group and merged with the tails.

    Args: as ``kernels.attention.decode_attention``, plus ``groups`` (``None``: every request on its
    own — the tail pass from position 0, no merge). Every group's shared length must be below each
    member's ``seq_len`` (``find_prefix_groups`` guarantees it).

    Returns:
        ``[B, Hq, D]`` in q's dtype (scores, softmax and the merge in fp32).

    Raises:
        ValueError: naming the argument whose shape, dtype, layout or device is wrong, or a group
            that does not fit the batch.
    """
    _check_common(q, k_cache, v_cache, req_to_token, rows, scale)
    batch = rows.shape[0]
    if q.shape[0] != batch:
        raise ValueError(f"q must have one token per request: {batch} rows, got {q.shape[0]}")
    check_index("seq_lens", seq_lens, batch)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, rows=rows, seq_lens=seq_lens)
    if groups is not None and len(groups.kv_start) != batch:
        raise ValueError(f"groups describe {len(groups.kv_start)} requests, the batch has {batch}")
    triton_path = use_triton(impl, q)
    shared_fn = shared_prefix_decode_triton if triton_path else shared_prefix_decode_torch
    tail_fn = tail_decode_triton if triton_path else tail_decode_torch
    kv_start = groups.kv_start_t.to(q.device) if groups is not None else torch.zeros_like(seq_lens)
    o, lse = tail_fn(q, k_cache, v_cache, req_to_token, rows, kv_start, seq_lens, float(scale))
    if groups is not None and groups.num_groups:
        o_s, lse_s = shared_fn(q, k_cache, v_cache, req_to_token, rows, groups, float(scale))
        members = groups.members_t.to(q.device)
        o[members], _ = merge_states(o[members], lse[members], o_s[members], lse_s[members])
    return o.to(q.dtype)
