"""KVPool and MambaPool on elastic backing: fixed tensors, live data kept bit for bit through
grow/shrink cycles, memory really returned, precise errors, and the fixed-allocation fallback."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

from services.worker.mamba_pool import MambaPool, MambaSpec
from services.worker.pool_backing import choose_backing, fixed_backing
from services.worker.pools import KVPool

MIB = 1 << 20
LAYERS, HEADS, DIM = 3, 2, 16  # fp32 K or V row = 128 bytes: 32 slots per 4 KiB page
SPEC = MambaSpec(num_layers=2, conv_shape=(24, 3), ssm_shape=(2, 8, 8), conv_dtype=torch.bfloat16)


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def tensors(pool: KVPool | MambaPool) -> list[torch.Tensor]:
    return [*pool.k, *pool.v] if isinstance(pool, KVPool) else [*pool.conv, *pool.ssm]


def fill(pool: KVPool | MambaPool, slots: int, seed: int) -> list[torch.Tensor]:
    """Random data in slots [0, slots) of every tensor; returns copies to compare with."""
    g = torch.Generator().manual_seed(seed)
    ref = []
    for t in tensors(pool):
        data = torch.randn((slots, *t.shape[1:]), generator=g).to(t.dtype)
        t[:slots] = data
        ref.append(data)
    return ref


def bit_equal(pool: KVPool | MambaPool, ref: list[torch.Tensor]) -> bool:
    n = ref[0].shape[0]
    return all(torch.equal(t[:n].contiguous().view(torch.uint8), r.view(torch.uint8))
               for t, r in zip(tensors(pool), ref, strict=True))


def test_default_pool_is_todays_pool() -> None:
    """No reservation asked: the same shapes, zeroed, contiguous, and max_slots == num_slots."""
    kv = KVPool.from_budget(100 * KVPool.slot_bytes(LAYERS, HEADS, DIM, torch.float32) + 5, LAYERS, HEADS, DIM,
                            torch.float32, page_size=4)
    assert kv.num_slots == kv.max_slots == 100
    assert kv.k[2].shape == (100, HEADS, DIM) and kv.k[2].is_contiguous()
    assert all(not t.any() for t in tensors(kv))
    assert kv.slot_granularity == 32 and kv.backing.elastic
    mamba = MambaPool(6, SPEC)
    assert mamba.num_slots == mamba.max_slots == 6 and mamba.conv[1].shape == (6, 24, 3)


@pytest.mark.parametrize("kind", ["kv", "mamba"])
def test_grow_shrink_cycles_keep_live_slots_and_addresses(kind: str) -> None:
    pool: KVPool | MambaPool
    if kind == "kv":
        pool = KVPool(LAYERS, 64, HEADS, DIM, torch.float32, max_slots=1024, page_size=4)
        caps = [1024, 96, 64, 512, 64, 1024, 64]
    else:
        pool = MambaPool(8, SPEC, max_slots=200)
        caps = [200, 9, 8, 120, 8, 200, 8]
    ptrs = [t.data_ptr() for t in tensors(pool)]
    objs = [id(t) for t in tensors(pool)]
    live = 64 if kind == "kv" else 8
    ref = fill(pool, live, seed=3)
    committed = []
    for cap in caps:
        pool.resize(cap)
        assert pool.num_slots == cap
        assert [t.data_ptr() for t in tensors(pool)] == ptrs and [id(t) for t in tensors(pool)] == objs
        assert bit_equal(pool, ref)
        committed.append(pool.committed_bytes)
    assert committed[0] > committed[1] >= committed[2] and committed[3] > committed[4]
    # Slots admitted again after their pages were released read as zero.
    pool.resize(pool.max_slots)
    assert all(not t[pool.max_slots // 2 :].any() for t in tensors(pool))


def test_mamba_ops_respect_the_current_capacity() -> None:
    pool = MambaPool(8, SPEC, max_slots=32)
    pool.resize(4)
    with pytest.raises(IndexError, match=r"out of range \[0, 4\)"):
        pool.copy(0, 5)
    pool.resize(32)
    pool.reset(31)
    pool.copy(1, 30)


def test_kv_shrink_of_a_large_pool_returns_memory() -> None:
    per_slot = KVPool.slot_bytes(LAYERS, HEADS, DIM, torch.float32)
    kv = KVPool.from_budget(256 * MIB, LAYERS, HEADS, DIM, torch.float32)
    before = rss()
    for t in tensors(kv):
        t.fill_(1.5)  # every page resident
    filled = rss()
    assert filled - before >= 0.9 * kv.num_slots * per_slot
    keep = kv.slot_granularity
    live = [t[:keep].clone() for t in tensors(kv)]
    released = kv.resize(keep).released_bytes
    dropped = filled - rss()
    assert released >= 255 * MIB
    assert dropped >= 0.8 * released, f"RSS fell {dropped / MIB:.1f} MiB of {released / MIB:.1f} MiB released"
    assert all(torch.equal(t[:keep], x) for t, x in zip(tensors(kv), live, strict=True))
    assert kv.committed_bytes == keep * per_slot


def test_resize_errors_are_precise_and_change_nothing() -> None:
    kv = KVPool(LAYERS, 64, HEADS, DIM, torch.float32, max_slots=100, page_size=4)
    with pytest.raises(ValueError, match=r"KV capacity 101 outside \[0, 100\] \(max_slots\)"):
        kv.resize(101)
    with pytest.raises(ValueError, match=r"KV capacity -32 outside"):
        kv.resize(-32)
    with pytest.raises(ValueError, match="KV capacity 40 is not a multiple of the slot granularity 32"):
        kv.resize(40)
    assert kv.num_slots == 64
    kv.resize(100)  # max_slots itself is always a valid target
    kv.resize(0)
    mamba = MambaPool(4, SPEC, max_slots=10)
    with pytest.raises(ValueError, match=r"Mamba capacity 11 outside \[0, 10\]"):
        mamba.resize(11)
    with pytest.raises(ValueError, match=r"max_slots \(3\) must be >= num_slots \(4\)"):
        MambaPool(4, SPEC, max_slots=3)
    with pytest.raises(ValueError, match="kv_max_bytes=10 is below kv_cache_bytes=1048576"):
        KVPool.from_budget(MIB, LAYERS, HEADS, DIM, torch.float32, max_bytes=10)


def test_fixed_backing_fallback_resizes_without_moving_memory() -> None:
    backing = fixed_backing("cpu", "no elastic backing (test)")
    kv = KVPool(LAYERS, 64, HEADS, DIM, torch.float32, max_slots=128, backing=backing)
    held = kv.committed_bytes
    assert not kv.backing.elastic and held >= 128 * kv.bytes_per_slot
    ref = fill(kv, 32, seed=5)
    ptr = kv.k[0].data_ptr()
    kv.resize(32)
    assert kv.num_slots == 32 and kv.committed_bytes == held  # nothing was given back
    kv.resize(128)
    assert bit_equal(kv, ref) and kv.k[0].data_ptr() == ptr
    assert not kv.k[0][32:].any()  # newly committed slots still read as zero
    assert choose_backing("cpu").elastic and choose_backing("cpu").reason == ""
    assert not choose_backing("meta").elastic
