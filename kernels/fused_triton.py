"""A decoder layer's elementwise chains as one Triton kernel each: the GPU twins of ``kernels/fused.py``.

On a GPU torch runs each chain as several kernels (RMSNorm ~7, the q/k norm + rotary ~15 per tensor,
SwiGLU's activation 2), and a decode step is bound by launching them, not by their work
(docs/bench/gpu-profile-bench.txt). Here each chain is one launch, one program per row (token, or
token x head), fp32 inside, stored in the tensor's dtype.

Each kernel rounds where its torch reference (the ``*_torch`` functions, which are the models' path
everywhere the kernels are not used) rounds: to the dtype after ``x + residual``, after ``norm(x)``
when the weight multiplies in the dtype, after each rotary product and sum, after ``silu``. Two things
are left that it cannot copy: the order in which the row's sum of squares is added up, and on a GPU
the last bit of torch's own math functions. ``tests/engine/test_fused_triton.py`` measures the
difference in ulps.

``impl`` as in the other kernels (``auto``: Triton for CUDA tensors). The models call the launchers
only where ``usable`` says so; on fp32 CPU tensors the native kernels of ``kernels/fused.py`` come
first, and the torch references take everything else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels._checks import (
    FLOAT_DTYPES,
    Impl,
    check_dtype,
    check_ndim,
    check_same_device,
    check_same_dtype,
    check_shape,
    use_triton,
)

# --------------------------------------------------------------------------------------------------
# Torch references (the models' path on the CPU and for whatever the kernels do not take)
# --------------------------------------------------------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """``weight * norm(x).to(x.dtype)``, or with ``unit_offset`` ``(norm(x) * (1 + weight)).to(x.dtype)``;
    the norm over the last dimension in fp32."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # torch's own kernel: the same result bit for bit in fp32 on the CPU, one pass instead of six.
        return F.rms_norm(x, (x.shape[-1],), 1.0 + weight if unit_offset else weight, eps)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate-half rotary of ``x [T, H, D]``'s first ``rotary_dim`` dims by ``cos, sin [T, rotary_dim/2]``
    (cast to x's dtype first); a new tensor."""
    half = rotary_dim // 2
    c = cos[:, None, :].to(x.dtype)
    s = sin[:, None, :].to(x.dtype)
    x1 = x[..., :half]
    x2 = x[..., half:rotary_dim]
    # x1*c - x2*s and x2*c + x1*s written into one output (the same products and sums, so the
    # same values as with separate tensors and a cat; two temporaries instead of six and a copy).
    out = torch.empty_like(x) if rotary_dim == x.shape[-1] else x.clone()
    o1, o2 = out[..., :half], out[..., half:rotary_dim]
    torch.mul(x1, c, out=o1).sub_(x2 * s)
    torch.mul(x2, c, out=o2).add_(x1 * s)
    return out


def silu_mul_torch_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate := silu(gate) * up`` in place (silu rounded to the dtype, then the product)."""
    return F.silu(gate, inplace=True).mul_(up)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------
#
# CUDA_MATH picks how torch's kernels on the tensors' device round: on a GPU the mean is the sum times
# fp32(1/N) and exp is CUDA's expf (libdevice); on the CPU (the interpreter, in the tests) the mean is
# the sum divided by N, and the interpreter has no libdevice. Quotients are IEEE (div_rn), as nvcc's
# are. Launched with enable_fp_fusion=False: torch rounds every product before the sum it feeds
# (a*c - b*s is two kernels there), so no FMA. The test compiles them for sm_90 and checks the PTX.


@triton.jit
def _round(y, DTYPE: tl.constexpr):
    """fp32 ``y`` rounded to DTYPE, to nearest even, as an fp32 value. bf16 by hand: Triton's CPU
    interpreter truncates (on a GPU this is what cvt.rn does; a NaN whose payload lies only in the low
    16 bits would become inf, and arithmetic makes no such NaN)."""
    if DTYPE == tl.bfloat16:  # noqa: SIM300 - DTYPE is the argument, bf16 the constant
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return y.to(DTYPE).to(tl.float32)


@triton.jit
def _inv_rms(ss, width, inv_width, eps, CUDA_MATH: tl.constexpr):
    mean = ss * inv_width if CUDA_MATH else ss / width
    return tl.math.rsqrt(mean + eps)


@triton.jit
def _scale(xf, inv, w, UNIT_OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """The normed row, rounded to DTYPE where the reference rounds it (in, out: fp32 values)."""
    y = xf * inv
    if UNIT_OFFSET:  # noqa: SIM108 - a constexpr branch reads clearer in Triton
        y = y * (1.0 + w)  # (norm * (1 + w)).to(dtype): one rounding, at the end
    else:
        y = w * _round(y, DTYPE)  # weight * norm.to(dtype): a product of two DTYPE values
    return _round(y, DTYPE)


@triton.jit
def _rms_norm_kernel(
    x, residual, weight, out, stride_x, stride_r, stride_o, width, inv_width, eps,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, CUDA_MATH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Program = one row. With a residual, x := x + residual (rounded to the dtype) first, written back.
    row = tl.program_id(0).to(tl.int64)
    dtype = x.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    xs = tl.load(x + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * stride_r + offs, mask=mask, other=0.0)
        xf = _round(xs.to(tl.float32) + r.to(tl.float32), dtype)
        tl.store(x + row * stride_x + offs, xf.to(dtype), mask=mask)
    else:
        xf = xs.to(tl.float32)
    inv = _inv_rms(tl.sum(xf * xf, axis=0), width, inv_width, eps, CUDA_MATH)
    w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + offs, _scale(xf, inv, w, UNIT_OFFSET, dtype).to(dtype), mask=mask)


@triton.jit
def _rms_norm_rope_kernel(
    x, weight, cos, sin, stride_x, stride_cs, heads, inv_width, eps,
    WIDTH: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    CUDA_MATH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):  # fmt: skip
    # Program = one (token, head) row of WIDTH values, in place: [x1 (HALF) | x2 (HALF) | rest]. Every
    # value is loaded before any is stored, and each row belongs to one program only.
    row = tl.program_id(0).to(tl.int64)
    tok = row // heads
    dtype = x.dtype.element_ty
    base = x + row * stride_x
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    x1 = tl.load(base + j, mask=jm, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + j, mask=jm, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
        if BLOCK_REST > 0:  # partial rotary: the dims past 2 * HALF are normed, not rotated
            k = 2 * HALF + tl.arange(0, BLOCK_REST)
            km = k < WIDTH
            rest = tl.load(base + k, mask=km, other=0.0).to(tl.float32)
            ss += tl.sum(rest * rest, axis=0)
        inv = _inv_rms(ss, WIDTH, inv_width, eps, CUDA_MATH)
        w1 = tl.load(weight + j, mask=jm, other=0.0).to(tl.float32)
        w2 = tl.load(weight + HALF + j, mask=jm, other=0.0).to(tl.float32)
        x1 = _scale(x1, inv, w1, UNIT_OFFSET, dtype)
        x2 = _scale(x2, inv, w2, UNIT_OFFSET, dtype)
        if BLOCK_REST > 0:
            wr = tl.load(weight + k, mask=km, other=0.0).to(tl.float32)
            tl.store(base + k, _scale(rest, inv, wr, UNIT_OFFSET, dtype).to(dtype), mask=km)
    # cos / sin are cast to the dtype, and every product and sum is rounded to it, as torch's are.
    c = _round(tl.load(cos + tok * stride_cs + j, mask=jm, other=0.0), dtype)
    s = _round(tl.load(sin + tok * stride_cs + j, mask=jm, other=0.0), dtype)
    x1c, x2s = _round(x1 * c, dtype), _round(x2 * s, dtype)
    x2c, x1s = _round(x2 * c, dtype), _round(x1 * s, dtype)
    tl.store(base + j, _round(x1c - x2s, dtype).to(dtype), mask=jm)
    tl.store(base + HALF + j, _round(x2c + x1s, dtype).to(dtype), mask=jm)


@triton.jit
def _silu_mul_kernel(gate, up, stride_g, stride_u, width, CUDA_MATH: tl.constexpr, BLOCK: tl.constexpr):
    # Program = (row, BLOCK columns): no reduction, so a wide row is split rather than held whole.
    row = tl.program_id(0).to(tl.int64)
    dtype = gate.dtype.element_ty
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    g = tl.load(gate + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    e = libdevice.exp(-g) if CUDA_MATH else tl.exp(-g)  # tl.exp is ex2.approx on a GPU: not expf
    silu = _round(tl.math.div_rn(g, 1.0 + e), dtype)  # `/` is div.full (2 ulp) on a GPU
    tl.store(gate + row * stride_g + offs, _round(silu * u, dtype).to(dtype), mask=mask)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------

MAX_SILU_BLOCK = 1024


def _row_stride(t: torch.Tensor) -> int | None:
    """The stride between the rows of ``t`` seen as ``[-1, t.shape[-1]]``, or None unless its last
    dimension is dense and its leading ones flatten to one stride of at least a row (no overlap)."""
    if t.dim() == 0 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        return None
    if t.is_contiguous():  # the common case, and this runs per launch on the decode path's host
        return t.shape[-1]
    stride, expected = None, 0
    for d in range(t.dim() - 2, -1, -1):
        if t.shape[d] == 1:  # any stride: never stepped over
            continue
        if stride is None:
            stride = t.stride(d)
        elif t.stride(d) != expected:
            return None
        expected = t.stride(d) * t.shape[d]
    if stride is None:  # a single row
        return t.shape[-1]
    return stride if stride >= t.shape[-1] else None


def usable(*tensors: torch.Tensor) -> bool:
    """The kernels can take these tensors: CUDA, one float dtype, and rows as :func:`_row_stride`
    wants them (contiguous, or slices of wider rows such as one head's half of a projection)."""
    first = tensors[0]
    return all(
        t.is_cuda and t.dtype == first.dtype and t.dtype in FLOAT_DTYPES and _row_stride(t) is not None for t in tensors
    )


def _check_rows(name: str, t: torch.Tensor) -> int:
    check_dtype(name, t, FLOAT_DTYPES)
    stride = _row_stride(t)
    if stride is None:
        raise ValueError(
            f"{name} must be dense in its last dimension, its leading dimensions flattening to one "
            f"stride, got strides {t.stride()} for shape {tuple(t.shape)}"
        )
    return stride


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    check_shape("weight", weight, (x.shape[-1],), "[width]")
    check_same_dtype("weight", weight, "x", x)
    _check_rows("weight", weight)


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def _norm_triton(
    x: torch.Tensor, stride_x: int, residual: torch.Tensor | None, stride_r: int, weight: torch.Tensor, eps: float,
    unit_offset: bool,
) -> torch.Tensor:  # fmt: skip
    width = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // width if width else 0
    if rows == 0:
        return out
    block = triton.next_power_of_2(width)
    _rms_norm_kernel[(rows,)](
        x, x if residual is None else residual, weight, out, stride_x, stride_r, width, width,
        1.0 / width, eps, HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, CUDA_MATH=x.is_cuda,
        BLOCK=block, num_warps=_warps(block), enable_fp_fusion=False,
    )  # fmt: skip
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False, impl: Impl = "auto"
) -> torch.Tensor:
    """RMSNorm over the last dimension (see :func:`rms_norm_torch` for the two conventions); a new
    contiguous tensor.

    Args:
        x: ``[..., width]`` float; rows dense, leading dimensions flattening to one stride.
        weight: ``[width]`` in x's dtype.
        impl: ``auto`` runs the Triton kernel on CUDA tensors and the torch reference otherwise.

    Raises:
        ValueError: naming the argument whose shape, dtype, layout or device is wrong.
    """
    stride_x = _check_rows("x", x)
    _check_weight(weight, x)
    check_same_device(x=x, weight=weight)
    if use_triton(impl, x):
        return _norm_triton(x, stride_x, None, 0, weight, eps, unit_offset)
    return rms_norm_torch(x, weight, eps, unit_offset)


def add_rms_norm_(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``x := x + residual`` in place (the residual stream), then :func:`rms_norm` of it.

    Args:
        x, residual: the same shape ``[..., width]`` and dtype, laid out as :func:`rms_norm`'s x.
        weight, eps, unit_offset, impl: as in :func:`rms_norm`.

    Raises:
        ValueError: naming the argument whose shape, dtype, layout or device is wrong.
    """
    stride_x = _check_rows("x", x)
    stride_r = _check_rows("residual", residual)
    check_shape("residual", residual, x.shape, "x.shape")
    check_same_dtype("residual", residual, "x", x)
    _check_weight(weight, x)
    check_same_device(x=x, residual=residual, weight=weight)
    if use_triton(impl, x):
        return _norm_triton(x, stride_x, residual, stride_r, weight, eps, unit_offset)
    return rms_norm_torch(x.add_(residual), weight, eps, unit_offset)


def rms_norm_rope_(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    unit_offset: bool = False,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``x [T, H, D]`` in place: RMSNorm over each head (``weight [D]``; None: no norm), then the
    rotate-half rotary of its first ``rotary_dim`` dims; returns ``x``.

    Args:
        x: ``[T, H, D]`` float, each head's D values dense; the token and head strides must flatten
            (a view of ``[T, H * D']`` with ``D' >= D``, such as the query half of a fused projection).
        weight: ``[D]`` in x's dtype, or None for the rotary alone.
        cos, sin: ``[T, rotary_dim / 2]`` fp32 (``RotaryEmbedding.cos_sin``), rows dense.
        rotary_dim: even, in ``(0, D]``; the dims past it are normed, not rotated.
        eps, unit_offset, impl: as in :func:`rms_norm`.

    Raises:
        ValueError: naming the argument whose shape, dtype, layout or device is wrong.
    """
    check_ndim("x", x, 3, "[T, H, D]")
    stride_x = _check_rows("x", x)
    t, heads, width = x.shape
    if rotary_dim % 2 or not 0 < rotary_dim <= width:
        raise ValueError(f"rotary_dim must be even and in (0, D={width}], got {rotary_dim}")
    if weight is not None:
        _check_weight(weight, x)
    for name, cs in (("cos", cos), ("sin", sin)):
        check_shape(name, cs, (t, rotary_dim // 2), "[T, rotary_dim / 2]")
        check_dtype(name, cs, (torch.float32,))
        _check_rows(name, cs)
    if cos.stride() != sin.stride():
        raise ValueError(f"cos and sin must share their strides, got {cos.stride()} and {sin.stride()}")
    check_same_device(x=x, weight=weight, cos=cos, sin=sin)
    if not use_triton(impl, x):
        normed = x if weight is None else rms_norm_torch(x, weight, eps, unit_offset)
        return x.copy_(rope_torch(normed, cos, sin, rotary_dim))
    if x.numel() == 0:
        return x
    half = rotary_dim // 2
    rest = width - rotary_dim
    _rms_norm_rope_kernel[(t * heads,)](
        x, x if weight is None else weight, cos, sin, stride_x, cos.stride(0), heads, 1.0 / width, eps,
        WIDTH=width, HALF=half, HAS_NORM=weight is not None, UNIT_OFFSET=unit_offset, CUDA_MATH=x.is_cuda,
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_REST=triton.next_power_of_2(rest) if rest else 0,
        num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip
    return x


def silu_mul_(gate: torch.Tensor, up: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """``gate := silu(gate) * up`` in place (SwiGLU's activation); returns ``gate``.

    Args:
        gate, up: the same shape ``[..., width]`` and float dtype, laid out as :func:`rms_norm`'s x.
        impl: ``auto`` runs the Triton kernel on CUDA tensors and the torch reference otherwise.

    Raises:
        ValueError: naming the argument whose shape, dtype, layout or device is wrong.
    """
    stride_g = _check_rows("gate", gate)
    stride_u = _check_rows("up", up)
    check_shape("up", up, gate.shape, "gate.shape")
    check_same_dtype("up", up, "gate", gate)
    check_same_device(gate=gate, up=up)
    if not use_triton(impl, gate):
        return silu_mul_torch_(gate, up)
    width = gate.shape[-1]
    if gate.numel() == 0:
        return gate
    block = min(triton.next_power_of_2(width), MAX_SILU_BLOCK)
    grid = (gate.numel() // width, triton.cdiv(width, block))
    _silu_mul_kernel[grid](
        gate, up, stride_g, stride_u, width, CUDA_MATH=gate.is_cuda, BLOCK=block, num_warps=_warps(block),
        enable_fp_fusion=False,
    )  # fmt: skip
    return gate
