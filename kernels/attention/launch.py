"""The checked launchers of paged attention: argument validation, then the Triton kernel or its torch
reference (``impl``; ``auto`` = Triton for CUDA tensors).

Every launcher validates its inputs before choosing a path, so the reference and the kernel accept
exactly the same arguments and a bad call fails with a ``ValueError`` that names the argument
instead of with an out-of-bounds read on the GPU. The worker's Triton backend calls them with
``impl="triton"``; the tests call both implementations.
"""

from __future__ import annotations

import torch

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
from kernels.attention.merge import merge_states
from kernels.attention.prefix_groups import PrefixGroups
from kernels.attention.reference import (
    decode_attention_torch,
    extend_attention_torch,
    shared_prefix_decode_torch,
    tail_decode_torch,
)
from kernels.attention.triton import decode_triton, extend_triton, shared_prefix_decode_triton, tail_decode_triton


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


def _check_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> None:
    _check_common(q, k_cache, v_cache, req_to_token, rows, scale)
    if q.shape[0] != rows.shape[0]:
        raise ValueError(f"q must have one token per request: {rows.shape[0]} rows, got {q.shape[0]}")
    check_index("seq_lens", seq_lens, rows.shape[0])
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, rows=rows, seq_lens=seq_lens
    )


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
        return extend_triton(q, k_cache, v_cache, req_to_token, rows, start_pos, extend_lens, float(scale))
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
    _check_decode(q, k_cache, v_cache, req_to_token, rows, seq_lens, scale)
    if use_triton(impl, q):
        return decode_triton(q, k_cache, v_cache, req_to_token, rows, seq_lens, float(scale))
    return decode_attention_torch(q, k_cache, v_cache, req_to_token, rows, seq_lens, scale)


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
    """:func:`decode_attention` with each prefix group's shared run attended once per group: the
    shared pass, each request's tail from its ``kv_start``, merged by log-sum-exp.

    Args: as :func:`decode_attention`, plus ``groups`` (``None``: every request on its own — the tail
    pass from position 0, no merge). Every group's shared length must be below each member's
    ``seq_len`` (``find_prefix_groups`` guarantees it).

    Returns:
        ``[B, Hq, D]`` in q's dtype (scores, softmax and the merge in fp32).

    Raises:
        ValueError: naming the argument whose shape, dtype, layout or device is wrong, or a group
            that does not fit the batch.
    """
    _check_decode(q, k_cache, v_cache, req_to_token, rows, seq_lens, scale)
    batch = rows.shape[0]
    if groups is not None and len(groups.kv_start) != batch:
        raise ValueError(f"groups describe {len(groups.kv_start)} requests, the batch has {batch}")
    on_triton = use_triton(impl, q)
    shared_fn = shared_prefix_decode_triton if on_triton else shared_prefix_decode_torch
    tail_fn = tail_decode_triton if on_triton else tail_decode_torch
    kv_start = groups.kv_start_t.to(q.device) if groups is not None else torch.zeros_like(seq_lens)
    o, lse = tail_fn(q, k_cache, v_cache, req_to_token, rows, kv_start, seq_lens, float(scale))
    if groups is not None and groups.num_groups:
        o_s, lse_s = shared_fn(q, k_cache, v_cache, req_to_token, rows, groups, float(scale))
        members = groups.members_t.to(q.device)
        o[members], _ = merge_states(o[members], lse[members], o_s[members], lse_s[members])
    return o.to(q.dtype)
