"""Paged attention over the slot-indexed KV pool: extend (prefill with a cached prefix) and decode.

Memory layout (one layer)::

    k_cache, v_cache   [S, Hkv, D]   slot s = one token's K/V for every KV head
    req_to_token       [R, L]        row r lists, position by position, the slot of each token of the
                                     request that owns row r (only the first seq_len entries are valid)

A request b of the batch owns row ``rows[b]``. Its keys are ``k_cache[req_to_token[rows[b], :n]]``.
The K/V of the tokens being computed are already stored (see ``kernels.kv_store``), so a new token
attends to itself through the cache like to any other position.

GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)`` (the layout of Hugging Face's ``repeat_kv``).
Scores and softmax are computed in fp32 on both paths; the output is in q's dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    Impl,
    check_contiguous,
    check_dtype,
    check_index,
    check_inner_contiguous,
    check_ndim,
    check_same_device,
    check_same_dtype,
    check_shape,
    use_triton,
)

_LOG2E = math.log2(math.e)


# --------------------------------------------------------------------------------------------------
# Torch references (the CPU path of the model)
# --------------------------------------------------------------------------------------------------


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
    """Reference of :func:`extend_attention`: one batched matmul per request."""
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
    """Reference of :func:`decode_attention`: the whole batch padded to its longest sequence."""
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


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _extend_kernel(
    q,
    k_cache,
    v_cache,
    o,
    req_to_token,
    rows,
    start_pos,
    extend_lens,
    q_starts,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_r2t,
    stride_slot,
    scale_log2e,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program = (request b, query head h, block of BLOCK_M new tokens): flash attention with an online
    # softmax in base 2 (scale folded with log2(e)), keys gathered through the request's slot row.
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    ext = tl.load(extend_lens + b)
    if m_block * BLOCK_M < ext:
        start = tl.load(start_pos + b)
        row = tl.load(rows + b)
        q0 = tl.load(q_starts + b)
        kv_head = h // GROUP

        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < ext
        d_mask = offs_d < HEAD_DIM
        q_ptrs = q + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        q_tile = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        q_pos = start + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys past the last query of this block are masked for every row: stop there.
        kv_end = start + tl.minimum((m_block + 1) * BLOCK_M, ext)
        for n0 in range(0, kv_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < kv_end
            slot = tl.load(req_to_token + row * stride_r2t + offs_n, mask=n_mask, other=0)
            kv_off = slot[:, None] * stride_slot + kv_head * HEAD_DIM + offs_d[None, :]
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k_tile = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)
            v_tile = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)
            # "ieee": fp32 inputs must not be rounded to tf32 (the tests demand 1e-5 relative error).
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee") * scale_log2e
            causal = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            s = tl.where(causal, s, float("-inf"))
            # Position 0 is visible to every row (padding rows included), so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision="ieee")
            m_i = m_new
        acc = acc / l_i[:, None]
        o_ptrs = o + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(o.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_kernel(
    q,
    k_cache,
    v_cache,
    o,
    req_to_token,
    rows,
    seq_lens,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_r2t,
    stride_slot,
    scale_log2e,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program = (request b, query head h); one query vector, so scores are a broadcast-multiply and
    # row sum rather than a tensor-core dot. Online softmax in base 2 as in the extend kernel.
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens + b)
    row = tl.load(rows + b)
    kv_head = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_vec = tl.load(q + b * stride_qb + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)

    # Running max (a scalar), per-lane partial denominators (summed once at the end), output accumulator.
    m_all = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(0, seq_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < seq_len
        slot = tl.load(req_to_token + row * stride_r2t + offs_n, mask=n_mask, other=0)
        kv_off = slot[:, None] * stride_slot + kv_head * HEAD_DIM + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_tile = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v_tile = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k_tile * q_vec[None, :], 1) * scale_log2e
        s = tl.where(n_mask, s, float("-inf"))
        m_new = tl.maximum(m_all, tl.max(s, 0))  # finite: the first block holds position 0
        alpha = tl.exp2(m_all - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha + tl.sum(p[:, None] * v_tile, 0)
        m_all = m_new
    out = acc / tl.sum(l_i, 0)
    tl.store(o + b * stride_ob + h * stride_oh + offs_d, out.to(o.dtype.element_ty), mask=d_mask)


def _extend_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    start_pos: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = rows.shape[0]
    if batch == 0 or q.shape[0] == 0:
        return o
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // k_cache.shape[1]
    q_starts = torch.cumsum(extend_lens, 0) - extend_lens
    # fp32 tiles or wide heads at 64x64 need >100 KB of shared memory once pipelined: halve the tiles.
    block = 32 if q.element_size() == 4 or head_dim > 128 else 64
    # One host sync to size the grid; the scheduler knows this number, but the signature is fixed.
    max_ext = int(extend_lens.max())
    grid = (batch, num_q_heads, triton.cdiv(max_ext, block))
    _extend_kernel[grid](
        q, k_cache, v_cache, o, req_to_token, rows, start_pos, extend_lens, q_starts,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), req_to_token.stride(0), k_cache.stride(0),
        scale * _LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block, BLOCK_N=block,
    )  # fmt: skip
    return o


def _decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch, num_q_heads, head_dim = q.shape
    if batch == 0:
        return o
    group = num_q_heads // k_cache.shape[1]
    _decode_kernel[(batch, num_q_heads)](
        q, k_cache, v_cache, o, req_to_token, rows, seq_lens,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), req_to_token.stride(0), k_cache.stride(0),
        scale * _LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=64,
    )  # fmt: skip
    return o


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _check_common(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
) -> None:
    check_ndim("q", q, 3, "[T, Hq, D]")
    check_dtype("q", q, FLOAT_DTYPES)
    check_inner_contiguous("q", q, dims=1)
    check_ndim("k_cache", k_cache, 3, "[S, Hkv, D]")
    check_shape("v_cache", v_cache, k_cache.shape, "[S, Hkv, D]")
    check_same_dtype("k_cache", k_cache, "q", q)
    check_same_dtype("v_cache", v_cache, "q", q)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    if k_cache.shape[2] != q.shape[2]:
        raise ValueError(f"k_cache head dim {k_cache.shape[2]} differs from q head dim {q.shape[2]}")
    if q.shape[1] % k_cache.shape[1] != 0:
        raise ValueError(
            f"q heads ({q.shape[1]}) must be a multiple of k_cache KV heads ({k_cache.shape[1]}) for GQA"
        )
    check_ndim("req_to_token", req_to_token, 2, "[R, L]")
    check_dtype("req_to_token", req_to_token, (torch.int64,))
    check_inner_contiguous("req_to_token", req_to_token, dims=1)
    check_index("rows", rows)
    if not (isinstance(scale, float | int) and scale > 0):
        raise ValueError(f"scale must be a positive number, got {scale!r}")


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    start_pos: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Causal attention of the new tokens of a batch of requests over their cached prefix and themselves.

    Args:
        q: ``[T, Hq, D]`` queries of the new tokens of all requests, concatenated in request order
            (``T == sum(extend_lens)``); the last dimension must be dense, other strides are free.
        k_cache, v_cache: ``[S, Hkv, D]`` contiguous pools in q's dtype; ``Hq % Hkv == 0``. The new
            tokens' K/V must already be stored.
        req_to_token: ``[R, L]`` int64 slot table, last dimension dense.
        rows, start_pos, extend_lens: ``[B]`` int64. Token ``j`` of request ``b`` sits at position
            ``start_pos[b] + j`` and attends to slots ``req_to_token[rows[b], : start_pos[b] + j + 1]``.
            ``extend_lens[b] >= 1``.
        scale: softmax scale, usually ``D ** -0.5``.
        impl: ``auto`` runs the Triton kernel on CUDA tensors and the torch reference otherwise.

    Returns:
        ``[T, Hq, D]`` contiguous, in q's dtype (scores and softmax in fp32).

    Raises:
        ValueError: naming the argument whose shape, dtype, layout or device is wrong. Index values
            are not checked (that would cost a device sync); out-of-range slots are undefined.
    """
    _check_common(q, k_cache, v_cache, req_to_token, rows, scale)
    batch = rows.shape[0]
    check_index("start_pos", start_pos, batch)
    check_index("extend_lens", extend_lens, batch)
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, rows=rows,
        start_pos=start_pos, extend_lens=extend_lens,
    )  # fmt: skip
    if use_triton(impl, q):
        return _extend_triton(q, k_cache, v_cache, req_to_token, rows, start_pos, extend_lens, float(scale))
    return extend_attention_torch(q, k_cache, v_cache, req_to_token, rows, start_pos, extend_lens, scale)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Attention of one new token per request over ``req_to_token[rows[b], : seq_lens[b]]``.

    Args:
        q: ``[B, Hq, D]``, one query per request; last dimension dense, other strides free.
        k_cache, v_cache, req_to_token, scale, impl: as in :func:`extend_attention`.
        rows, seq_lens: ``[B]`` int64; ``seq_lens[b] >= 1`` counts the new token (already stored).

    Returns:
        ``[B, Hq, D]`` contiguous, in q's dtype (scores and softmax in fp32).

    Raises:
        ValueError: naming the argument whose shape, dtype, layout or device is wrong.
    """
    _check_common(q, k_cache, v_cache, req_to_token, rows, scale)
    if q.shape[0] != rows.shape[0]:
        raise ValueError(f"q must have one token per request: {rows.shape[0]} rows, got {q.shape[0]}")
    check_index("seq_lens", seq_lens, rows.shape[0])
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, rows=rows, seq_lens=seq_lens
    )
    if use_triton(impl, q):
        return _decode_triton(q, k_cache, v_cache, req_to_token, rows, seq_lens, float(scale))
    return decode_attention_torch(q, k_cache, v_cache, req_to_token, rows, seq_lens, scale)
