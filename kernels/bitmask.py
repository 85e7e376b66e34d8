"""Apply a grammar's token bitmask to logits.

Bitmask format (the one xgrammar fills): ``[B, ceil(V / 32)]`` int32; bit ``i`` (least significant
first) of word ``w`` describes token ``32 * w + i``; set = allowed. Bits past ``V`` in the last word are
ignored. Disallowed logits become ``-inf`` so that every sampler, greedy included, skips them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    Impl,
    check_contiguous,
    check_dtype,
    check_inner_contiguous,
    check_ndim,
    check_same_device,
    check_shape,
    use_triton,
)

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words that cover ``vocab_size`` tokens."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def bitmask_from_allowed(
    allowed: Iterable[int], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The ``[ceil(V / 32)]`` int32 bitmask that allows exactly the ids in ``allowed``.

    Raises:
        ValueError: if an id is outside ``[0, vocab_size)``.
    """
    ids = torch.tensor(sorted(set(allowed)), dtype=torch.int64)
    if ids.numel() and (int(ids[0]) < 0 or int(ids[-1]) >= vocab_size):
        raise ValueError(f"allowed token ids must lie in [0, {vocab_size}), got {ids[0]}..{ids[-1]}")
    words = bitmask_words(vocab_size)
    bits = torch.zeros(words * BITS_PER_WORD, dtype=torch.int64)
    bits[ids] = 1
    packed = (bits.view(words, BITS_PER_WORD) << torch.arange(BITS_PER_WORD)).sum(dim=1)
    # Words with bit 31 set exceed int32's range: wrap them to the negative int32 with the same bits.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32).to(device)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, W]`` int32 bitmask → ``[B, vocab_size]`` bool, True = allowed."""
    shifts = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)
    # `& 1` after the arithmetic shift makes bit 31 (the sign bit) read correctly too.
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Reference of :func:`apply_token_bitmask`."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    logits.masked_fill_(~allowed, float("-inf"))


@triton.jit
def _apply_bitmask_kernel(logits, bitmask, stride_lb, stride_mb, vocab_size, BLOCK: tl.constexpr):
    # Program = (row b, BLOCK tokens). Each token reads its own word; neighbours share it via the cache.
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    words = tl.load(bitmask + b * stride_mb + offs // 32, mask=mask, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    ptrs = logits + b * stride_lb + offs
    # Only the disallowed entries are written; allowed logits are left untouched.
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), logits.dtype.element_ty), mask=mask & ~allowed)


def _apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    batch, vocab_size = logits.shape
    if batch == 0 or vocab_size == 0:
        return
    block = 1024
    grid = (batch, triton.cdiv(vocab_size, block))
    _apply_bitmask_kernel[grid](logits, bitmask, logits.stride(0), bitmask.stride(0), vocab_size, BLOCK=block)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, impl: Impl = "auto") -> None:
    """Set the logits of disallowed tokens to ``-inf``, in place.

    Args:
        logits: ``[B, V]`` float logits; the vocabulary dimension must be dense, the row stride is free.
        bitmask: ``[B, ceil(V / 32)]`` contiguous int32, layout described in the module docstring.
        impl: ``auto`` runs the Triton kernel on CUDA tensors and the torch reference otherwise.

    Raises:
        ValueError: naming the argument whose shape, dtype, layout or device is wrong.
    """
    check_ndim("logits", logits, 2, "[B, V]")
    check_dtype("logits", logits, FLOAT_DTYPES)
    check_inner_contiguous("logits", logits, dims=1)
    check_dtype("bitmask", bitmask, (torch.int32,))
    check_shape("bitmask", bitmask, (logits.shape[0], bitmask_words(logits.shape[1])), "[B, ceil(V/32)]")
    check_contiguous("bitmask", bitmask)
    check_same_device(logits=logits, bitmask=bitmask)
    if use_triton(impl, logits):
        _apply_bitmask_triton(logits, bitmask)
    else:
        apply_token_bitmask_torch(logits, bitmask)
