"""Building blocks shared by the models: RMSNorm, rotary embedding, SwiGLU MLP.

All blocks work on the flat token axis of a ``ForwardBatch`` (``[T, ...]``, no batch dimension)
and are written so that a module built on the ``meta`` device holds no derived values: anything
computed from the config (rotary frequencies) is made on first use, on the input's device.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import fused, fused_triton
from services.worker.tp import SINGLE, RowLinear, Tp, column_linear


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32.

    ``unit_offset=False`` (Qwen3, Llama): ``weight * norm(x).to(x.dtype)``.
    ``unit_offset=True`` (Qwen3-Next): ``(norm(x) * (1 + weight)).to(x.dtype)`` — the weight is
    stored centred on zero and the scaling happens before the cast back.

    On CUDA tensors each method is one Triton kernel (``kernels/fused_triton.py``); on the CPU
    ``add_norm`` of fp32 tensors is one native pass (``kernels/fused.py``), and everything else runs
    the torch reference, ``fused_triton.rms_norm_torch``.
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_triton.usable(x, self.weight):
            return fused_triton.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return fused_triton.rms_norm_torch(x, self.weight, self.eps, self.unit_offset)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``x += residual`` in place (the residual stream after a block), then its norm: one pass
        (native on fp32 CPU tensors, Triton on CUDA ones) instead of torch's two."""
        if not self.unit_offset and fused.usable(x, residual, self.weight):
            return fused.add_rms_norm_(x, residual, self.weight, self.eps)
        if fused_triton.usable(x, residual, self.weight):
            return fused_triton.add_rms_norm_(x, residual, self.weight, self.eps, self.unit_offset)
        return self(x.add_(residual))


class RotaryEmbedding:
    """Rotary position embedding (the "rotate half" layout) on the first ``rotary_dim`` dims.

    ``rotary_dim < head_dim`` is partial rotary (Qwen3-Next rotates a quarter of each head): the
    remaining dims pass through unchanged. Frequencies are computed in fp32 exactly as the
    reference does, so cos/sin match it bit for bit.
    """

    __slots__ = ("_inv_freq", "_table", "head_dim", "rotary_dim", "theta")

    def __init__(self, head_dim: int, rotary_dim: int, theta: float) -> None:
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.theta = theta
        self._inv_freq: torch.Tensor | None = None
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU: cos, sin of positions 0..n-1

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, rotary_dim // 2]`` (fp32) for int64 ``positions [T]``.

        On the CPU, rows of a table of every position so far (the same products and the same
        cos / sin, so the same bits): a gather instead of two transcendental passes, each of which
        torch splits over the threads from 1,024 values on (a parallel region that, on a host whose
        other cores are busy, waits for them). The table starts at 4,096 positions and doubles past
        the largest one asked for. On CUDA, computed each time (a captured graph keeps no table)."""
        if positions.device.type != "cpu":
            return self._compute(positions)
        table = self._table
        if table is not None:
            try:
                return table[0].index_select(0, positions), table[1].index_select(0, positions)
            except IndexError:  # a position past the table: grow it
                pass
        n = max(4096, 2 * (table[0].shape[0] if table else 0), int(positions.max()) + 1 if positions.numel() else 0)
        self._table = self._compute(torch.arange(n))
        return self._table[0].index_select(0, positions), self._table[1].index_select(0, positions)

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._inv_freq
        if inv is None or inv.device != positions.device:
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
            inv = (1.0 / (self.theta**exponents)).to(positions.device)
            self._inv_freq = inv
        freqs = positions.float()[:, None] * inv[None, :]
        return freqs.cos(), freqs.sin()

    def norm_apply(self, x: torch.Tensor, norm: RMSNorm | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``apply(norm(x))`` (``norm`` None: ``apply(x)``) for ``x [T, H, head_dim]``: in place in
        one pass, native on fp32 CPU tensors, Triton on CUDA ones (torch runs it as ~15 kernels per
        tensor, and on the CPU it was a prefill layer's most expensive elementwise work)."""
        weight = None if norm is None else norm.weight
        eps = 0.0 if norm is None else norm.eps
        unit_offset = norm is not None and norm.unit_offset
        tensors = (x,) if weight is None else (x, weight)
        if not unit_offset and fused.usable(*tensors, cos, sin):
            return fused.rms_norm_rope_(x, weight, eps, cos, sin, self.rotary_dim)
        if fused_triton.usable(*tensors):
            return fused_triton.rms_norm_rope_(x, weight, eps, cos, sin, self.rotary_dim, unit_offset)
        return self.apply(x if norm is None else norm(x), cos, sin)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, H, head_dim]`` by the per-token angles (``cos``/``sin`` from ``cos_sin``)."""
        return fused_triton.rope_torch(x, cos, sin, self.rotary_dim)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with the Hugging Face parameter names.

    Tensor parallel: ``gate`` / ``up`` column-parallel, ``down`` row-parallel; ``forward`` returns
    this rank's partial sum unless ``reduce`` (one all-reduce per block: an MoE sums its experts
    first)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, tp: Tp = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate_proj = column_linear(hidden, intermediate, tp, bias)
        self.up_proj = column_linear(hidden, intermediate, tp, bias)
        self.down_proj = RowLinear(intermediate, hidden, tp, bias)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        # In place on the gate's output: two [T, intermediate] temporaries fewer per layer (the
        # same operations in the same order, so the same values).
        gate, up = self.gate_proj(x), self.up_proj(x)
        if fused.usable(gate, up):
            h = fused.silu_mul_(gate, up)
        elif fused_triton.usable(gate, up):
            h = fused_triton.silu_mul_(gate, up)
        else:
            h = fused_triton.silu_mul_torch_(gate, up)
        y = self.down_proj(h)
        return self.tp.all_reduce(y) if reduce else y
