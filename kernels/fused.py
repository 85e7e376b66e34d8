"""A decoder layer's elementwise chains as one native pass each (``kernels/csrc/fused.c``).

Each function works in place on fp32 contiguous CPU tensors and is called only where ``usable``
says so; the models keep the torch path for everything else (GPU, half precision, no compiler).
Torch runs each chain as several kernels over the whole tensor; on the CPU their memory traffic
is most of what the chain costs (a 2k-token prefill of the bench model: ~20 % of the step).
"""

from __future__ import annotations

import torch

from kernels.native import load


def usable(*tensors: torch.Tensor) -> bool:
    """The native kernels can take these tensors: fp32, contiguous, on the CPU, library built."""
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and load() is not None
    )


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate := silu(gate) * up`` (same shapes); returns ``gate``."""
    lib = load()
    assert lib is not None and gate.shape == up.shape
    lib.strata_silu_mul_f32(gate.data_ptr(), up.data_ptr(), gate.numel())
    return gate


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x := x + residual`` (``[T, H]``), then a new ``weight * x / rms(x)``."""
    lib = load()
    assert lib is not None and x.shape == residual.shape and x.shape[-1] == weight.numel()
    out = torch.empty_like(x)
    h = x.shape[-1]
    lib.strata_add_rms_norm_f32(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // h, h, eps
    )
    return out


def rms_norm_rope_(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """``x [T, H, D]`` in place: RMSNorm over each head (``weight [D]``; None: no norm), then the
    rotate-half rotary embedding of the first ``rotary_dim`` dims (``cos, sin [T, rotary_dim / 2]``)."""
    lib = load()
    t, heads, d = x.shape
    assert lib is not None and cos.shape == sin.shape == (t, rotary_dim // 2)
    lib.strata_rms_norm_rope_f32(
        x.data_ptr(), t, heads, d, 0 if weight is None else weight.data_ptr(), eps, cos.data_ptr(),
        sin.data_ptr(), rotary_dim,
    )
    return x
