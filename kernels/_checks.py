"""Argument checks shared by the kernel launchers.

Every launcher validates its inputs here before choosing a path, so the CPU reference and the Triton
kernel accept exactly the same arguments and a bad call fails with a ``ValueError`` that names the
argument instead of with an out-of-bounds read on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Impl = Literal["auto", "triton", "torch"]
"""Which path a launcher takes: ``auto`` = Triton for CUDA tensors, the torch reference otherwise.
``triton`` on CPU tensors only works under Triton's interpreter, which the tests enable in a child
process; production code always passes ``auto``."""

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def use_triton(impl: Impl, *tensors: torch.Tensor) -> bool:
    """Resolve ``impl`` for tensors that have already been checked to share one device."""
    if impl == "auto":
        return tensors[0].is_cuda
    if impl == "triton":
        return True
    if impl == "torch":
        return False
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int], layout: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {tuple(expected)}, got {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must have dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}")


def check_same_dtype(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if t.dtype != other.dtype:
        raise ValueError(f"{name} must have the dtype of {other_name} ({other.dtype}), got {t.dtype}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def check_inner_contiguous(name: str, t: torch.Tensor, dims: int = 1) -> None:
    """The last ``dims`` dimensions must be densely packed; the leading strides are free.

    This admits views such as one slice of a fused QKV projection, which the Triton kernels read
    through their leading strides without a copy.
    """
    expected = 1
    for d in range(t.dim() - 1, t.dim() - 1 - dims, -1):
        if t.shape[d] > 1 and t.stride(d) != expected:
            raise ValueError(
                f"{name} must be contiguous in its last {dims} dimension(s), "
                f"got strides {t.stride()} for shape {tuple(t.shape)}"
            )
        expected *= t.shape[d]


def check_same_device(**tensors: torch.Tensor | None) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    first_name, first = next(iter(present.items()))
    for name, t in present.items():
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_index(name: str, t: torch.Tensor, length: int | None = None) -> None:
    """A 1-D contiguous int64 index tensor, optionally of a given length."""
    check_dtype(name, t, (torch.int64,))
    check_ndim(name, t, 1, "[B]")
    check_contiguous(name, t)
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have length {length}, got {t.shape[0]}")


def state_index_value(state_index: int | torch.Tensor, pool_size: int) -> int:
    """A request's row of a state pool, given as an int or a one-element integer tensor."""
    if isinstance(state_index, torch.Tensor):
        if state_index.numel() != 1 or state_index.dtype.is_floating_point or state_index.dtype == torch.bool:
            raise ValueError(f"state_index must be an int or a one-element integer tensor, got {state_index}")
        state_index = int(state_index.item())
    if not 0 <= state_index < pool_size:
        raise ValueError(f"state_index must lie in [0, {pool_size}), got {state_index}")
    return state_index
