"""Store the K and V of new tokens into the slot-indexed KV pool.

The pool of one layer is a pair of ``[S, Hkv, D]`` tensors; slot ``s`` holds one token's key and value
for every KV head. The scheduler hands out slots, so a batch writes to arbitrary, scattered rows.
"""

from __future__ import annotations

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


@triton.jit
def _store_kv_kernel(
    k_cache,
    v_cache,
    slots,
    k,
    v,
    stride_k_tok,
    stride_v_tok,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program copies one BLOCK-wide piece of one token's [Hkv * D] row into its slot's row.
    tok = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots + tok)
    mask = (offs < ROW) & (slot >= 0)  # a negative slot: a padding token, dropped
    kv = tl.load(k + tok * stride_k_tok + offs, mask=mask)
    tl.store(k_cache + slot * ROW + offs, kv, mask=mask)
    vv = tl.load(v + tok * stride_v_tok + offs, mask=mask)
    tl.store(v_cache + slot * ROW + offs, vv, mask=mask)


def store_kv_torch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    padded: bool = False,
) -> None:
    """Reference: ``k_cache[slots] = k`` and ``v_cache[slots] = v``; with ``padded``, negative slots
    dropped (a host sync: the graphed decode that pads with them runs the Triton kernel)."""
    if padded and slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def _store_kv_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return
    row = k_cache.shape[1] * k_cache.shape[2]
    block = min(1024, triton.next_power_of_2(row))
    grid = (num_tokens, triton.cdiv(row, block))
    _store_kv_kernel[grid](k_cache, v_cache, slots, k, v, k.stride(0), v.stride(0), ROW=row, BLOCK=block)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    impl: Impl = "auto",
    padded: bool = False,
) -> None:
    """Write ``k[t]`` into ``k_cache[slots[t]]`` and ``v[t]`` into ``v_cache[slots[t]]``, in place.

    Args:
        k_cache, v_cache: ``[S, Hkv, D]`` contiguous pools of one layer (fp16, bf16 or fp32).
        slots: ``[T]`` int64 slot of each new token; slots must be distinct and ``< S``. With
            ``padded``, a negative slot drops its token (the padding rows of a graphed decode,
            services/worker/cuda_graphs.py); the Triton kernel always drops them, the torch
            reference looks for them only then (a host sync, kept off the ordinary CPU step).
        k, v: ``[T, Hkv, D]`` in the caches' dtype. Their ``[Hkv, D]`` rows must be dense, the token
            stride is free (a slice of a fused projection is fine).
        impl: ``auto`` runs the Triton kernel on CUDA tensors and the torch reference otherwise.

    Raises:
        ValueError: naming the argument whose shape, dtype, layout or device is wrong.
    """
    check_ndim("k_cache", k_cache, 3, "[S, Hkv, D]")
    check_shape("v_cache", v_cache, k_cache.shape, "[S, Hkv, D]")
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)
    check_same_dtype("v_cache", v_cache, "k_cache", k_cache)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    check_index("slots", slots)
    _, num_kv_heads, head_dim = k_cache.shape
    expected = (slots.shape[0], num_kv_heads, head_dim)
    check_shape("k", k, expected, "[T, Hkv, D]")
    check_shape("v", v, expected, "[T, Hkv, D]")
    check_same_dtype("k", k, "k_cache", k_cache)
    check_same_dtype("v", v, "k_cache", k_cache)
    check_inner_contiguous("k", k, dims=2)
    check_inner_contiguous("v", v, dims=2)
    check_same_device(k_cache=k_cache, v_cache=v_cache, slots=slots, k=k, v=v)
    if use_triton(impl, k_cache):
        _store_kv_triton(k_cache, v_cache, slots, k, v)
    else:
        store_kv_torch(k_cache, v_cache, slots, k, v, padded)
