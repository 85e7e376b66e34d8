"""Triton kernels of paged attention over the slot-indexed KV pool, and their unchecked launchers.

Memory layout and semantics: see ``kernels.attention``. The checked launchers (argument validation,
the choice between these kernels and the torch references) are in ``kernels.attention.launch``; the
torch references the kernels are tested against (under ``TRITON_INTERPRET=1`` on the CPU, at small
sizes) in ``kernels.attention.reference``.

Three attention kernels, each an online softmax in base 2 (scores pre-multiplied by log2(e)):

* ``_extend_kernel``: program = (request, query head, block of new tokens); causal, ``tl.dot`` tiles;
* ``_shared_kernel``: program = (prefix group, KV head, block of query rows), the rows being the
  group's members × the query heads of that KV head, so the shared run's keys are loaded once per
  group and multiplied with a ``[BLOCK_Q, D]`` tile (tensor cores), not once per request;
* ``_decode_kernel``: program = (request, KV head, split of the request's keys), the query heads of
  that KV head as the rows of one ``[BLOCK_G, D]`` tile (``tl.dot``), so each key is read once per
  request, and the keys split over several programs when the batch alone cannot fill the GPU
  (flash-decoding; the split count is chosen on the host, ``decode_splits``). One split writes the
  output itself; several write fp32 partial results and their LSEs, which ``_decode_merge_kernel``
  (program = (request, query head)) merges. With ``HAS_START`` it starts at ``kv_start[b]`` and with
  ``STORE_LSE`` it writes the natural-log LSE: the *tail* pass of the cascade decode, merged with
  ``_shared_kernel``'s.

``_extend_kernel`` and ``_shared_kernel`` run the same block loop (``_attend_blocks``): keys gathered
through one slot row, masked by ``kv_end`` (and causally for the extend).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels.attention.prefix_groups import PrefixGroups

_LOG2E = math.log2(math.e)
# The kernels that return an LSE store the natural-log one the merge expects:
# ln(sum e^x) = ln(2) * log2(sum 2^(x log2 e)).
_LN2: tl.constexpr = tl.constexpr(math.log(2.0))


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _attend_blocks(
    q_tile, q_pos, k_cache, v_cache, slot_row, kv_end, kv_head, offs_d, d_mask, stride_slot, scale_log2e,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    # The query tile [BLOCK_M, BLOCK_D] over keys [0, kv_end) of the slot row at `slot_row`, KV head
    # `kv_head`; with CAUSAL, query row i sees only keys at positions <= q_pos[i]. Returns the
    # unnormalised accumulator, the running max and the denominators (base 2).
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        slot = tl.load(slot_row + offs_n, mask=n_mask, other=0)
        kv_off = slot[:, None] * stride_slot + kv_head * HEAD_DIM + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_tile = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)
        v_tile = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)
        # "ieee": fp32 inputs must not be rounded to tf32 (the tests demand 1e-5 relative error).
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee") * scale_log2e
        if CAUSAL:
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        else:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        # Position 0 is visible to every row (padding rows included), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _extend_kernel(
    q, k_cache, v_cache, o, req_to_token, rows, start_pos, extend_lens, q_starts,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_r2t, stride_slot, scale_log2e,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program = (request b, query head h, block of BLOCK_M new tokens): flash attention, keys
    # gathered through the request's slot row.
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    ext = tl.load(extend_lens + b)
    if m_block * BLOCK_M < ext:
        start = tl.load(start_pos + b)
        row = tl.load(rows + b)
        q0 = tl.load(q_starts + b)
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < ext
        d_mask = offs_d < HEAD_DIM
        q_ptrs = q + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        q_tile = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        # Keys past the last query of this block are masked for every row: stop there.
        kv_end = start + tl.minimum((m_block + 1) * BLOCK_M, ext)
        acc, _, l_i = _attend_blocks(
            q_tile, start + offs_m, k_cache, v_cache, req_to_token + row * stride_r2t, kv_end, h // GROUP,
            offs_d, d_mask, stride_slot, scale_log2e, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL=True,
        )
        acc = acc / l_i[:, None]
        o_ptrs = o + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(o.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _shared_kernel(
    q, k_cache, v_cache, o, lse, req_to_token, rows, members, group_starts, shared_lens,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_lb, stride_r2t, stride_slot, scale_log2e,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program = (group g, KV head h, block of BLOCK_Q query rows); row r = member r // GROUP, query
    # head h * GROUP + r % GROUP; keys: the shared run of the group's first member's row (no causal
    # mask: the run lies before every member's new token).
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
        acc, m_i, l_i = _attend_blocks(
            q_tile, offs_r, k_cache, v_cache, req_to_token + leader * stride_r2t, shared, h, offs_d, d_mask,
            stride_slot, scale_log2e, HEAD_DIM, BLOCK_D, BLOCK_Q, BLOCK_N, CAUSAL=False,
        )
        out = acc / l_i[:, None]
        o_ptrs = o + b[:, None] * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out, mask=r_mask[:, None] & d_mask[None, :])
        tl.store(lse + b * stride_lb + head, (m_i + tl.log2(l_i)) * _LN2, mask=r_mask)


@triton.jit
def _decode_kernel(
    q, k_cache, v_cache, o, lse, req_to_token, rows, kv_start, seq_lens,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls, stride_r2t, stride_slot,
    scale_log2e,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_START: tl.constexpr, STORE_LSE: tl.constexpr, UPCAST: tl.constexpr,
):
    # Program = (request b, KV head, split s of S = the grid's third dimension) over its share of
    # positions [kv_start[b] if HAS_START else 0, seq_lens[b]) of the request's row: whole blocks of
    # ceil(len / S) keys, so the last splits of a short range are empty. The GROUP query heads of the
    # KV head are the rows of one [BLOCK_G, BLOCK_D] tile (rows past GROUP are padding, q = 0, never
    # stored), so each key is read once for all of them. Writes each head's normalised output to
    # o[b, head, s] and, with STORE_LSE, its natural-log LSE to lse[b, head, s]; a split without keys
    # writes o = 0, lse = -inf. `kv_start` and `lse` are not read without HAS_START / STORE_LSE.
    #
    # Scores by `tl.dot` (tensor cores for 16-bit caches) rather than a broadcast-multiply: the
    # [BLOCK_G, BLOCK_N, BLOCK_D] product of the latter does not fit in registers at useful block
    # sizes, and the MMA's 16-row minimum costs nothing here (the kernel waits on memory, not math).
    # UPCAST (CPU tensors, i.e. the interpreter, only) casts the tiles to fp32 first: the interpreter
    # multiplies the raw bits of bf16 dot operands (triton-lang/triton#11584).
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start = 0
    if HAS_START:
        start = tl.load(kv_start + b)
    end = tl.load(seq_lens + b)
    chunk = tl.cdiv(tl.cdiv(end - start, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, end)
    slot_row = req_to_token + tl.load(rows + b) * stride_r2t
    offs_g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    gd_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_tile = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gd_mask, other=0.0)
    if UPCAST:
        q_tile = q_tile.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slot = tl.load(slot_row + offs_n, mask=n_mask, other=0)
        kv_off = slot[:, None] * stride_slot + kv_head * HEAD_DIM + offs_d[None, :]
        # Without padding of D the mask is constant along a key's row, so the loads stay vectorised.
        kv_mask = n_mask[:, None] if BLOCK_D == HEAD_DIM else n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        k_tile = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)
        v_tile = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k_tile = k_tile.to(tl.float32)
            v_tile = v_tile.to(tl.float32)
        # "ieee": fp32 inputs must not be rounded to tf32 (the tests demand 1e-5 relative error).
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee") * scale_log2e
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block holds at least one key of the split
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = o + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=gd_mask)
    if STORE_LSE:
        tl.store(lse + b * stride_lb + heads * stride_lh + split * stride_ls, (m_i + tl.log2(l_i)) * _LN2,
                 mask=offs_g < GROUP)  # fmt: skip


@triton.jit
def _decode_merge_kernel(
    part_o, part_lse, o, lse, stride_ob, stride_oh, stride_lb,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    # Program = (request b, query head h): the exact LSE merge of the NUM_SPLITS partial results of
    # `_decode_kernel` (part_o [B, Hq, S, D] and part_lse [B, Hq, S], contiguous, fp32, natural log).
    # Empty splits (lse = -inf) weigh 0; if every split is empty, o = 0 and lse = -inf.
    b = tl.program_id(0)
    h = tl.program_id(1)
    part = b * tl.num_programs(1) + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse_s = tl.load(part_lse + part * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m)
    total = tl.sum(w, 0)
    o_ptrs = part_o + (part * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    o_s = tl.load(o_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * o_s, 0) / tl.where(total > 0, total, 1.0)
    tl.store(o + b * stride_ob + h * stride_oh + offs_d, out.to(o.dtype.element_ty), mask=d_mask)
    if STORE_LSE:
        tl.store(lse + b * stride_lb + h, m + tl.log(total))


# --------------------------------------------------------------------------------------------------
# Unchecked launchers (the checked ones: kernels.attention.launch)
# --------------------------------------------------------------------------------------------------


def extend_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    start_pos: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``extend_attention_torch`` by ``_extend_kernel``: ``[T, Hq, D]`` in q's dtype."""
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


# The split of the decode's keys over programs (flash-decoding): one program per (request, KV head,
# split). The number of splits is chosen on the host from the grid alone (the lengths live on the
# device, and reading them would cost a sync). Once every SM has a program, splitting gains little
# and costs the merge's launch, so the batch is not split (H100, bf16, 4,096 keys, GPU time: 92-93 %
# of the copy rate unsplit at 2-4 programs per SM, 94-95 % split in 2). Below that, it is split until
# there are about _DECODE_PROGRAMS_PER_SM programs per SM, whose loads hide each other's latency (one
# request of 32,768 keys, 4 KV heads: 46 % at 16 splits, 72 % at 32). Capped: a short sequence has
# fewer blocks than that, and the splits past its end are empty programs. The interpreter (CPU
# tensors) splits a fixed, small, odd number of ways, so that the default path there runs the merge
# and the padding of its split axis.
_DECODE_PROGRAMS_PER_SM = 4
_DECODE_MAX_SPLITS = 64
_DECODE_CPU_SPLITS = 3


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """How many splits of each request's keys ``_decode`` launches for this grid (1 ..
    ``_DECODE_MAX_SPLITS``); no device sync."""
    if device.type != "cuda":
        return _DECODE_CPU_SPLITS
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    programs = max(1, batch * num_kv_heads)
    if programs >= sms:
        return 1
    return min(_DECODE_MAX_SPLITS, triton.cdiv(_DECODE_PROGRAMS_PER_SM * sms, programs))


def _decode_config(head_dim: int, item_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of ``_decode_kernel``.

    16-bit caches: K and V tiles of 16 KiB each (128 keys at D 64, 64 at D 128), which the
    pipeliner (num_stages 2) loads by asynchronous copies into shared memory. On sm_90 that is about
    40 KB of shared memory and 100-120 registers a program, so 4 programs fit on an SM, which is
    what ``decode_splits`` aims for. fp32 caches: the dot runs on FMAs with its operands in
    registers, and larger tiles spill."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if item_size >= 4:
        return (64 if block_d <= 64 else 16), 4, 2
    return max(16, min(128, 16384 // (block_d * item_size))), 4, 2


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
    kv_start: torch.Tensor | None, seq_lens: torch.Tensor, scale: float, o: torch.Tensor, lse: torch.Tensor | None,
    num_splits: int | None,
) -> None:
    """``_decode_kernel`` into ``o`` (and ``lse`` when given), from ``kv_start`` when given, over
    ``num_splits`` splits (``None``: :func:`decode_splits`); more than one are merged by
    ``_decode_merge_kernel`` from fp32 partial results."""
    batch, num_q_heads, head_dim = q.shape
    if batch == 0:
        return
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    splits = decode_splits(batch, num_kv_heads, q.device) if num_splits is None else num_splits
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    block_n, num_warps, num_stages = _decode_config(head_dim, k_cache.element_size())
    block_d = max(16, triton.next_power_of_2(head_dim))
    if splits == 1:
        dst, dst_lse = o, lse
        o_strides = (o.stride(0), o.stride(1), 0)
        lse_strides = (0, 0, 0) if lse is None else (lse.stride(0), lse.stride(1), 0)
    else:
        dst = torch.empty((batch, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        dst_lse = torch.empty((batch, num_q_heads, splits), dtype=torch.float32, device=q.device)
        o_strides = (dst.stride(0), dst.stride(1), dst.stride(2))
        lse_strides = (dst_lse.stride(0), dst_lse.stride(1), dst_lse.stride(2))
    # The switched-off arguments are never read: any tensor stands in for them.
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, dst, dst if dst_lse is None else dst_lse, req_to_token, rows,
        seq_lens if kv_start is None else kv_start, seq_lens,
        q.stride(0), q.stride(1), *o_strides, *lse_strides, req_to_token.stride(0), k_cache.stride(0),
        scale * _LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, HAS_START=kv_start is not None, STORE_LSE=dst_lse is not None,
        UPCAST=q.device.type != "cuda", num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        _decode_merge_kernel[(batch, num_q_heads)](
            dst, dst_lse, o, o if lse is None else lse, o.stride(0), o.stride(1), 0 if lse is None else lse.stride(0),
            NUM_SPLITS=splits, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits),
            STORE_LSE=lse is not None,
        )  # fmt: skip


def decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``decode_attention_torch`` by ``_decode_kernel``: ``[B, Hq, D]`` in q's dtype. ``num_splits``
    forces the split of the keys (the tests; ``None``: :func:`decode_splits`)."""
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _decode(q, k_cache, v_cache, req_to_token, rows, None, seq_lens, scale, o, None, num_splits)
    return o


def tail_decode_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
    kv_start: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tail_decode_torch`` by ``_decode_kernel`` from ``kv_start`` with its LSE: same arguments and
    results (``kv_start[b] <= seq_lens[b]``, unchecked; an empty range gives o = 0, lse = -inf, as
    the reference does). ``num_splits`` as in :func:`decode_triton`."""
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    _decode(q, k_cache, v_cache, req_to_token, rows, kv_start, seq_lens, scale, o, lse, num_splits)
    return o, lse


def shared_prefix_decode_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
    groups: PrefixGroups, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``shared_prefix_decode_torch`` by ``_shared_kernel``: same arguments and results. ``groups``
    tensors are moved to q's device if they are elsewhere."""
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
