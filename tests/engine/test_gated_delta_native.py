"""The native CPU kernel of one gated-delta decode step (``kernels/csrc/gated_delta.c``), which
``gated_delta_step`` takes for fp32 CPU tensors: the same outputs and states as the torch
reference (which ``test_kernels_reference.py`` checks against transformers) over head shapes,
grouped heads, scattered and non-contiguous inputs; only the requests' own state rows change; an
index outside the pool is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

import kernels.gated_delta
from kernels.gated_delta import gated_delta_step
from kernels.native import load
from tests.engine.test_kernels_reference import caller_preprocess, delta_inputs

pytestmark = pytest.mark.skipif(load() is None, reason="no C compiler: the native kernels are not built")


@pytest.mark.parametrize(
    ("batch", "num_k_heads", "num_v_heads", "dk", "dv"),
    [(1, 1, 1, 4, 4), (3, 2, 4, 16, 8), (5, 4, 8, 64, 64), (2, 2, 2, 128, 128), (4, 1, 3, 24, 40)],
)
def test_native_step_equals_the_torch_reference(batch: int, num_k_heads: int, num_v_heads: int, dk: int,
                                                dv: int, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    q, k, v, g, beta = delta_inputs(batch, num_k_heads, num_v_heads, dk, dv, seed=batch + dk)
    qn, kn = caller_preprocess(q, k)
    pool = torch.randn(batch + 3, num_v_heads, dk, dv)
    idx = torch.randperm(batch + 3)[:batch]
    ref_pool, nat_pool = pool.clone(), pool.clone()
    want = gated_delta_step(qn, kn, v, g, beta, ref_pool, idx, impl="torch")

    def no_torch(*args: object) -> None:
        raise AssertionError("auto took the torch path on fp32 CPU tensors")

    monkeypatch.setattr(kernels.gated_delta, "gated_delta_step_torch", no_torch)
    got = gated_delta_step(qn, kn, v, g, beta, nat_pool, idx)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    torch.testing.assert_close(nat_pool, ref_pool, rtol=0, atol=2e-5)
    others = [i for i in range(batch + 3) if i not in idx.tolist()]
    assert torch.equal(nat_pool[others], pool[others])


def test_native_step_takes_strided_rows() -> None:
    """q, k and v as the model passes them: views into one projection's output (rows strided)."""
    batch, hk, hv, dk, dv = 3, 2, 4, 16, 16
    gen = torch.Generator().manual_seed(5)
    mixed = torch.randn(batch, 2 * hk * dk + hv * dv, generator=gen)
    q = mixed[:, : hk * dk].view(batch, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(batch, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(batch, hv, dv)
    assert not q.is_contiguous() and not v.is_contiguous()
    qn, kn = caller_preprocess(q, k)
    g, beta = -torch.rand(batch, hv, generator=gen), torch.rand(batch, hv, generator=gen)
    pool = torch.randn(4, hv, dk, dv, generator=gen)
    ref_pool, nat_pool, idx = pool.clone(), pool.clone(), torch.tensor([3, 0, 2])
    want = gated_delta_step(qn, kn, v, g, beta, ref_pool, idx, impl="torch")
    got = gated_delta_step(qn, kn, v, g, beta, nat_pool, idx)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    torch.testing.assert_close(nat_pool, ref_pool, rtol=0, atol=2e-5)


def test_an_index_outside_the_pool_is_refused_before_any_write() -> None:
    q, k, v, g, beta = delta_inputs(2, 2, 4, 8, 8, seed=0)
    pool = torch.randn(3, 4, 8, 8)
    before = pool.clone()
    for bad in ([0, 3], [-1, 1]):
        with pytest.raises(ValueError, match=r"^state_indices must be in \[0, 3\)"):
            gated_delta_step(q, k, v, g, beta, pool, torch.tensor(bad))
        assert torch.equal(pool, before)
