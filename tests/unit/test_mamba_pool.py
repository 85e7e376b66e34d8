"""MambaPool: layout, copy-on-write / fork semantics, reset, and precise errors."""

from __future__ import annotations

import pytest
import torch

from services.worker.mamba_pool import MambaPool, MambaSpec

SPEC = MambaSpec(num_layers=3, conv_shape=(12, 3), ssm_shape=(4, 8, 8), conv_dtype=torch.bfloat16)


def _filled(num_slots: int = 6) -> MambaPool:
    pool = MambaPool(num_slots, SPEC)
    g = torch.Generator().manual_seed(0)
    for t in (*pool.conv, *pool.ssm):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


def _snapshot(pool: MambaPool, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in (*pool.conv, *pool.ssm)]


def _bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def test_layout_dtypes_and_size() -> None:
    pool = MambaPool(5, SPEC)
    assert pool.num_slots == 5
    assert len(pool.conv) == len(pool.ssm) == 3
    assert pool.conv[0].shape == (5, 12, 3) and pool.conv[0].dtype == torch.bfloat16
    assert pool.ssm[2].shape == (5, 4, 8, 8) and pool.ssm[2].dtype == torch.float32
    assert all(not t.any() for t in (*pool.conv, *pool.ssm))  # a fresh slot is the empty state
    assert pool.bytes_per_slot == 3 * (12 * 3 * 2 + 4 * 8 * 8 * 4)
    assert sum(t[0].numel() * t.element_size() for t in (*pool.conv, *pool.ssm)) == pool.bytes_per_slot


def test_copy_on_write_leaves_source_bit_identical_and_isolated() -> None:
    pool = _filled()
    before = _snapshot(pool, 1)
    pool.copy(1, 4)
    assert _bit_equal(_snapshot(pool, 4), before)
    # The request now mutates its copy: the source must not see it (no aliasing).
    for t in (*pool.conv, *pool.ssm):
        t[4].add_(1)
    assert _bit_equal(_snapshot(pool, 1), before)


def test_fork_then_both_diverge() -> None:
    pool = _filled()
    other = _snapshot(pool, 0)
    pool.copy(2, 3)  # fork: checkpoint slot 2 into slot 3
    forked = _snapshot(pool, 3)
    for t in (*pool.conv, *pool.ssm):
        t[2].mul_(-1)  # the running request keeps going in its own slot
    assert _bit_equal(_snapshot(pool, 3), forked)
    assert _bit_equal(_snapshot(pool, 0), other)


def test_copy_many_matches_single_copies() -> None:
    a, b = _filled(), _filled()
    a.copy_many(torch.tensor([0, 1]), torch.tensor([4, 5]))
    b.copy(0, 4)
    b.copy(1, 5)
    for x, y in zip((*a.conv, *a.ssm), (*b.conv, *b.ssm), strict=True):
        assert torch.equal(x, y)


def test_reset_zeroes_only_that_slot() -> None:
    pool = _filled()
    keep = _snapshot(pool, 2)
    pool.reset(3)
    assert all(not t[3].any() for t in (*pool.conv, *pool.ssm))
    assert _bit_equal(_snapshot(pool, 2), keep)


def test_errors_are_precise() -> None:
    pool = _filled(4)
    with pytest.raises(IndexError, match="source slot 4"):
        pool.copy(4, 0)
    with pytest.raises(IndexError, match="destination slot -1"):
        pool.copy(0, -1)
    with pytest.raises(ValueError, match="src == dst"):
        pool.copy(2, 2)
    with pytest.raises(IndexError, match="reset slot 9"):
        pool.reset(9)
    with pytest.raises(ValueError, match="never a source"):
        pool.copy_many(torch.tensor([0, 1]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="at least one slot"):
        MambaPool(0, SPEC)
    with pytest.raises(ValueError, match="num_layers"):
        MambaSpec(num_layers=0, conv_shape=(1,), ssm_shape=(1,))
    with pytest.raises(ValueError, match="ssm_shape"):
        MambaSpec(num_layers=1, conv_shape=(1,), ssm_shape=(0, 2))


def test_keep_traced_takes_the_state_after_the_kept_tokens() -> None:
    """A verify pass's trace (per layer: the conv window and the state after each token): keeping
    n tokens sets the conv state to the window's columns n : n + Ks and the recurrent state to the
    one after token n; other slots are untouched; n outside 1..T, or a trace missing layers, is refused."""
    from services.worker.models.linear_attn import StateTrace

    pool = MambaPool(4, MambaSpec(num_layers=2, conv_shape=(6, 3), ssm_shape=(2, 4, 4)))
    for t in (*pool.conv, *pool.ssm):
        t.copy_(torch.randn(t.shape))
    before = [t.clone() for t in (*pool.conv, *pool.ssm)]
    tokens = 4
    trace = StateTrace(frozenset({2}))
    trace.records[2] = [(torch.randn(6, 3 + tokens), torch.randn(tokens, 2, 4, 4)) for _ in range(2)]
    pool.keep_traced(trace, 2, 3)
    for layer, (window, states) in enumerate(trace.records[2]):
        assert torch.equal(pool.conv[layer][2], window[:, 3:6])
        assert torch.equal(pool.ssm[layer][2], states[2])
    for t, b in zip((*pool.conv, *pool.ssm), before, strict=True):
        assert torch.equal(t[[0, 1, 3]], b[[0, 1, 3]])
    for bad in (0, tokens + 1):
        with pytest.raises(ValueError, match="cannot keep"):
            pool.keep_traced(trace, 2, bad)
    trace.records[2] = trace.records[2][:1]
    with pytest.raises(ValueError, match="cannot keep"):
        pool.keep_traced(trace, 2, 1)
