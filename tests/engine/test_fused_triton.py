"""The Triton twins of the layers' elementwise chains (kernels/fused_triton.py) against their torch
references, in ulps; and, on a GPU, the layers' use of them.

As in test_kernels_triton.py, each family runs in a child process (this file run as a script): on
the CPU with ``TRITON_INTERPRET=1``, with ``STRATA_TEST_DEVICE=cuda`` (tests/device.py) compiled, on
that device, with no interpreter. The same cases and bounds in both.

Two kinds of input. ``exact``: multiples of 1/4 up to 2, so every square and every partial sum of
squares is exact in fp32 and the sum does not depend on the order of the additions; there the
kernels round exactly where the reference rounds, so the bound is 0 ulps in every dtype. ``random``:
the sum of squares is rounded, tl.sum adds in another order than torch, and the reference's last bit
moves: the bounds below are what that costs (measured on the CPU: fp32 5 ulps, bf16 0, fp16 2).
The SwiGLU activation has no sum but an exp, which is numpy's in the interpreter and Sleef's in torch
on the CPU (on a GPU both are CUDA's expf).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import triton_child
from tests.triton_child import child_main

ROOT = Path(__file__).resolve().parents[2]
DTYPES = (torch.float32, torch.bfloat16)

# Bounds in ulps on random inputs (exact inputs: 0). Half precision: one flip of norm(x).to(dtype)
# when the fp32 values straddle a rounding boundary, which the weight's product can make 2.
RANDOM_ULPS = {torch.float32: 8, torch.bfloat16: 2, torch.float16: 2}

Results = dict[str, tuple[int, int]]
"""case name -> (ulps between the Triton kernel and the reference, bound)."""


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between corresponding values, in units in the last place of their dtype
    (consecutive representable values are 1 apart; +0 and -0 are the same)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    width = torch.iinfo(bits).bits

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(bits).to(torch.int64)
        magnitude = i & ((1 << (width - 1)) - 1)
        return torch.where(i < 0, -magnitude, magnitude)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def scaled_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest difference in ulps of the reference's largest value: the rotary's differences and
    sums cancel, so a last-bit change of an input can be many ulps of a result near zero."""
    scale = b.double().abs().max().clamp_min(1e-30) * torch.finfo(b.dtype).eps
    return int(((a.double() - b.double()).abs().max() / scale).ceil())


def inputs(kind: str, *shape: int) -> torch.Tensor:
    if kind == "exact":
        return torch.randint(-8, 9, shape) / 4
    return torch.randn(shape) * 3


def bound(kind: str, dtype: torch.dtype, width: int = 128) -> int:
    """0 ulps on exact inputs, except one case measured on an H100: compiled for the GPU, fp32 over a
    width that is not a power of two, the kernel and torch's CUDA rms_norm (the fp32 reference) are
    2-3 ulps apart. The mean of such a width is not exact, and the two round it (or its rsqrt)
    differently; on the CPU, under the interpreter, they agree bit for bit."""
    odd_width_on_gpu = dtype == torch.float32 and width & (width - 1) and os.environ.get("TRITON_INTERPRET") != "1"
    return RANDOM_ULPS[dtype] if kind == "random" or odd_width_on_gpu else 0


# --------------------------------------------------------------------------------------------------
# Cases (run in the child process only)
# --------------------------------------------------------------------------------------------------


def cases_rms_norm() -> Results:
    """rms_norm and add_rms_norm_, both conventions, head-dim and odd widths; fp16 once."""
    from kernels.fused_triton import add_rms_norm_, rms_norm

    out: Results = {}
    shapes = [(dtype, width) for dtype in DTYPES for width in (64, 128, 97)] + [(torch.float16, 128)]
    for dtype, width in shapes:
        for kind in ("exact", "random"):
            for unit_offset in (False, True):
                tag = f"{str(dtype).removeprefix('torch.')}/w={width}/{kind}/unit_offset={unit_offset}"
                x = inputs(kind, 6, width).to(dtype)
                weight = (torch.randn(width) * (0.1 if unit_offset else 1.0)).to(dtype)
                ref = rms_norm(x, weight, 1e-6, unit_offset, impl="torch")
                tri = rms_norm(x, weight, 1e-6, unit_offset, impl="triton")
                out[f"rms_norm/{tag}"] = (ulps(tri, ref), bound(kind, dtype, width))
                # add: exact inputs stay exact (their sum is a multiple of 1/4 up to 4).
                residual = inputs(kind, 6, width).to(dtype)
                x_ref, x_tri = x.clone(), x.clone()
                ref = add_rms_norm_(x_ref, residual, weight, 1e-6, unit_offset, impl="torch")
                tri = add_rms_norm_(x_tri, residual, weight, 1e-6, unit_offset, impl="triton")
                out[f"add_rms_norm/{tag}"] = (ulps(tri, ref), bound(kind, dtype, width))
                out[f"add_rms_norm/{tag}/stream"] = (ulps(x_tri, x_ref), 0)  # one rounding: always exact
    # A row slice of a wider tensor (the leading stride is not the width).
    wide = inputs("exact", 5, 200)[:, :128]
    weight = torch.randn(128)
    ref, tri = rms_norm(wide, weight, 1e-6, impl="torch"), rms_norm(wide, weight, 1e-6, impl="triton")
    out["rms_norm/row_slice"] = (ulps(tri, ref), 0)
    return out


ROPE_CASES = {
    # name: (head_dim, rotary_dim, norm, unit_offset)
    "d64": (64, 64, True, False),
    "d128_unit_offset": (128, 128, True, True),
    "d96_quarter_unit_offset": (96, 24, True, True),  # Qwen3-Next's partial rotary
    "d97_partial": (97, 24, True, False),  # an odd width: a masked tail past the rotary dims
    "d64_no_norm": (64, 64, False, False),  # Llama: the rotary alone
    "d128_quarter_no_norm": (128, 32, False, False),
}


def cases_rope() -> Results:
    """rms_norm_rope_ in place on [T, H, D]: full and partial rotary, with and without the norm."""
    from kernels.fused_triton import rms_norm_rope_
    from services.worker.models.layers import RotaryEmbedding

    out: Results = {}
    t, heads = 5, 3
    for name, (d, rot, norm, unit_offset) in ROPE_CASES.items():
        cos, sin = RotaryEmbedding(d, rot, 10000.0).cos_sin(torch.randint(0, 4000, (t,)))
        for dtype in DTYPES:
            for kind in ("exact", "random"):
                x = inputs(kind, t, heads, d).to(dtype)
                weight = (torch.randn(d) * (0.1 if unit_offset else 1.0)).to(dtype) if norm else None
                ref, tri = x.clone(), x.clone()
                rms_norm_rope_(ref, weight, 1e-6, cos, sin, rot, unit_offset, impl="torch")
                got = rms_norm_rope_(tri, weight, 1e-6, cos, sin, rot, unit_offset, impl="triton")
                tag = f"rope/{name}/{str(dtype).removeprefix('torch.')}/{kind}"
                # A norm's last-bit change cancels in the rotary like a random input's.
                limit = bound(kind, dtype, d if norm else 128)
                measure = ulps if limit == 0 else scaled_ulps
                out[tag] = (measure(tri, ref) if got is tri else 1 << 30, limit)
    # The query half of a fused [T, H, 2D] projection (Qwen3-Next's q): strided heads, gate untouched.
    d, rot = 64, 16
    cos, sin = RotaryEmbedding(d, rot, 10000.0).cos_sin(torch.arange(t))
    fused = inputs("exact", t, heads, 2 * d)
    weight = torch.randn(d) * 0.1
    ref, tri = fused.clone(), fused.clone()
    rms_norm_rope_(ref[..., :d], weight, 1e-6, cos, sin, rot, True, impl="torch")
    rms_norm_rope_(tri[..., :d], weight, 1e-6, cos, sin, rot, True, impl="triton")
    out["rope/query_half_of_a_projection"] = (ulps(tri, ref), 0)
    return out


def cases_silu_mul() -> Results:
    """silu_mul_ in place: widths within one block, odd, and over several blocks of a row."""
    from kernels.fused_triton import silu_mul_

    out: Results = {}
    for dtype in DTYPES:
        for width in (128, 97, 2500):
            gate, up = (torch.randn(4, width) * 4).to(dtype), torch.randn(4, width).to(dtype)
            ref = silu_mul_(gate.clone(), up, impl="torch")
            tri = silu_mul_(gate.clone(), up, impl="triton")
            # fp32: exp's last bit differs between numpy and torch on the CPU; a half rounding hides it.
            out[f"silu_mul/{str(dtype).removeprefix('torch.')}/w={width}"] = (ulps(tri, ref), RANDOM_ULPS[dtype])
    return out


def compile_for_sm90() -> Results:
    """Every kernel compiled to a Hopper cubin (ptxas from the triton wheel, no GPU needed), bf16 and
    fp32, with the rounding the references have: no fused multiply-add in the norms and the rotary,
    and IEEE division (not div.full) in silu. Result per variant: 0 ulps if so, else 1."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from kernels import fused_triton as ft

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": 4, "enable_fp_fusion": False}).__dict__
    scalars = {"inv_width": "fp32", "eps": "fp32", "cos": "*fp32", "sin": "*fp32"}
    variants = {
        "rms_norm": (ft._rms_norm_kernel, {"HAS_RESIDUAL": True, "UNIT_OFFSET": False, "BLOCK": 1024}),
        "rms_norm_unit_offset": (ft._rms_norm_kernel, {"HAS_RESIDUAL": False, "UNIT_OFFSET": True, "BLOCK": 128}),
        "rope_partial": (ft._rms_norm_rope_kernel, {"WIDTH": 96, "HALF": 12, "HAS_NORM": True, "UNIT_OFFSET": True,
                                                    "BLOCK_HALF": 16, "BLOCK_REST": 128}),
        "rope_full": (ft._rms_norm_rope_kernel, {"WIDTH": 128, "HALF": 64, "HAS_NORM": True, "UNIT_OFFSET": False,
                                                 "BLOCK_HALF": 64, "BLOCK_REST": 0}),
        "silu_mul": (ft._silu_mul_kernel, {"BLOCK": 1024}),
    }  # fmt: skip
    out: Results = {}
    for dtype in ("bf16", "fp32"):
        for name, (kernel, constexprs) in variants.items():
            constexprs = {**constexprs, "CUDA_MATH": True}
            signature = {
                a: "constexpr" if a in constexprs else "i32" if a.startswith("stride") or a in ("width", "heads")
                else scalars.get(a, f"*{dtype}")
                for a in kernel.arg_names
            }  # fmt: skip
            ptx = triton.compile(ASTSource(kernel, signature, constexprs), target=target, options=options).asm["ptx"]
            if name == "silu_mul":  # libdevice's expf has FMAs of its own, on purpose
                ok = "div.rn.f32" in ptx and "div.full" not in ptx
            else:
                ok = "fma." not in ptx and "div.full" not in ptx
            out[f"sm90/{name}/{dtype}"] = (0 if ok else 1, 0)
    return out


FAMILIES: dict[str, Callable[[], Results]] = {
    "rms_norm": cases_rms_norm,
    "rope": cases_rope,
    "silu_mul": cases_silu_mul,
}


# --------------------------------------------------------------------------------------------------
# The tests (parent process)
# --------------------------------------------------------------------------------------------------


def run_child(family: str, interpret: bool) -> Results:
    return {name: (got, limit) for name, (got, limit) in triton_child.run(__file__, family, interpret).items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_triton_kernel_matches_torch_reference(request: pytest.FixtureRequest, family: str) -> None:
    from tests.device import TEST_DEVICE

    results = triton_child.family(request, family, interpret=TEST_DEVICE == "cpu")
    assert results, "no case ran"
    over = {name: got for name, (got, limit) in results.items() if not got <= limit}
    assert not over, f"ulps over the bound: {over}"


def test_fused_triton_kernels_compile_for_a_hopper_gpu_and_round_like_torch() -> None:
    results = run_child("compile", interpret=False)
    assert len(results) == 10
    assert all(got == 0 for got, _ in results.values()), results


@torch.inference_mode()
def test_the_layers_use_the_kernels_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """RMSNorm (both conventions, add_norm), the q/k norm + rotary and SwiGLU on CUDA tensors go
    through the Triton launchers and give what the torch path gives."""
    from tests.device import TEST_DEVICE

    if TEST_DEVICE == "cpu":
        pytest.skip("the layers use the kernels on CUDA tensors only (STRATA_TEST_DEVICE=cuda)")
    from kernels import fused_triton
    from services.worker.models.layers import RMSNorm, RotaryEmbedding, SwiGLU

    calls: list[str] = []

    def spy(name: str) -> Callable[..., torch.Tensor]:
        launcher = getattr(fused_triton, name)

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append(name)
            return launcher(*args, **kwargs)

        return counted

    for name in ("rms_norm", "add_rms_norm_", "rms_norm_rope_", "silu_mul_"):
        monkeypatch.setattr(fused_triton, name, spy(name))
    torch.manual_seed(0)
    device = torch.device(TEST_DEVICE)
    rotary = RotaryEmbedding(64, 16, 10000.0)
    cos, sin = rotary.cos_sin(torch.arange(7, device=device))
    for dtype in DTYPES:
        for unit_offset in (False, True):
            norm = RMSNorm(128, 1e-6, unit_offset).to(device, dtype)
            qk_norm = RMSNorm(64, 1e-6, unit_offset).to(device, dtype)
            torch.nn.init.normal_(norm.weight, std=0.1)
            torch.nn.init.normal_(qk_norm.weight, std=0.1)
            x, r = torch.randn(7, 128, device=device, dtype=dtype), torch.randn(7, 128, device=device, dtype=dtype)
            q = torch.randn(7, 4, 64, device=device, dtype=dtype)
            calls.clear()
            got = [norm(x), norm.add_norm(x.clone(), r), rotary.norm_apply(q.clone(), qk_norm, cos, sin)]
            assert calls == ["rms_norm", "add_rms_norm_", "rms_norm_rope_"]
            want = [
                fused_triton.rms_norm_torch(x, norm.weight, 1e-6, unit_offset),
                fused_triton.rms_norm_torch(x + r, norm.weight, 1e-6, unit_offset),
                rotary.apply(fused_triton.rms_norm_torch(q, qk_norm.weight, 1e-6, unit_offset), cos, sin),
            ]
            for g, w in zip(got, want, strict=True):
                assert scaled_ulps(g, w) <= RANDOM_ULPS[dtype]
        mlp = SwiGLU(128, 96).to(device, dtype)
        x = torch.randn(7, 128, device=device, dtype=dtype)
        calls.clear()
        got = mlp(x)
        assert calls == ["silu_mul_"]
        want = mlp.down_proj(fused_triton.silu_mul_torch_(mlp.gate_proj(x), mlp.up_proj(x)))
        assert scaled_ulps(got, want) <= RANDOM_ULPS[dtype]


if __name__ == "__main__":
    child_main(FAMILIES, compile_for_sm90)
