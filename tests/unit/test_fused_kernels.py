"""The native elementwise kernels (``kernels/csrc/fused.c``) against the torch chains they replace,
over odd shapes; and the models' choice of path (native on fp32 CPU tensors, torch otherwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import fused
from services.worker.models.layers import RMSNorm, RotaryEmbedding, SwiGLU

pytestmark = pytest.mark.skipif(not fused.usable(torch.zeros(1)), reason="native kernels unavailable")


@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (64, 1536), (129, 513)])
def test_silu_mul(shape: tuple[int, int]) -> None:
    g, u = torch.randn(shape) * 4, torch.randn(shape)
    want = F.silu(g) * u
    assert torch.allclose(fused.silu_mul_(g.clone(), u), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 8), (5, 64), (300, 512), (7, 1000), (600, 512)])  # serial below 2^18 values
def test_add_rms_norm(shape: tuple[int, int]) -> None:
    x, r, w = torch.randn(shape) * 3, torch.randn(shape), torch.randn(shape[1])
    xs = x + r
    want = F.rms_norm(xs, (shape[1],), w, 1e-6)
    got_x = x.clone()
    got = fused.add_rms_norm_(got_x, r, w, 1e-6)
    assert torch.equal(got_x, xs)  # the residual stream, exactly
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("t", "heads", "d", "rot", "norm"), [
    (1, 1, 8, 8, True), (17, 8, 64, 64, True), (5, 4, 64, 16, True), (33, 2, 32, 32, False), (2, 3, 128, 64, False),
    (600, 8, 64, 64, True),  # over 2^18 values: the parallel loop
])  # fmt: skip
def test_rms_norm_rope(t: int, heads: int, d: int, rot: int, norm: bool) -> None:
    rotary = RotaryEmbedding(d, rot, 10000.0)
    x = torch.randn(t, heads, d) * 2
    cos, sin = rotary.cos_sin(torch.randint(0, 4000, (t,)))
    w = torch.randn(d) if norm else None
    want = rotary.apply(F.rms_norm(x, (d,), w, 1e-6) if w is not None else x, cos, sin)
    got = fused.rms_norm_rope_(x.clone(), w, 1e-6, cos, sin, rot)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_the_layers_use_them_on_fp32_cpu_and_fall_back_otherwise() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    torch.nn.init.normal_(norm.weight)
    mlp = SwiGLU(64, 96)
    rotary = RotaryEmbedding(16, 16, 10000.0)
    x, r = torch.randn(9, 64), torch.randn(9, 64)
    q = torch.randn(9, 4, 16)
    cos, sin = rotary.cos_sin(torch.arange(9))
    qnorm = RMSNorm(16, 1e-6)
    torch.nn.init.normal_(qnorm.weight)
    for dtype in (torch.float32, torch.bfloat16):  # bf16: the torch path
        xs, rs, qs = x.to(dtype), r.to(dtype), q.to(dtype)
        n, m = norm.to(dtype), mlp.to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        want = n(xs + rs)
        got = n.add_norm(xs.clone(), rs)
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
        gate, up = m.gate_proj(xs), m.up_proj(xs)
        assert torch.allclose(m(xs).float(), m.down_proj(F.silu(gate) * up).float(), rtol=tol, atol=tol)
        qn = qnorm.to(dtype)
        want_q = rotary.apply(qn(qs), cos, sin)
        assert torch.allclose(rotary.norm_apply(qs.clone(), qn, cos, sin).float(), want_q.float(), rtol=tol, atol=tol)
