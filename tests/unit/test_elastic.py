"""Elastic backing memory: fixed addresses, preserved data, resident memory that really drops."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from services.worker import cuda_vmm
from services.worker.elastic import OS_PAGE_BYTES, ElasticBuffer, ElasticPool, ElasticPoolLayout
from services.worker.mamba_pool import MambaSpec

MIB = 1 << 20
GROUPINGS = ["slot_major", "field_major"]


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def kv_layout(grouping: str, max_slots: int = 4096) -> ElasticPoolLayout:
    return ElasticPoolLayout.kv(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float16,
                                max_slots=max_slots, page_bytes=OS_PAGE_BYTES, grouping=grouping)  # type: ignore[arg-type]


def fill_fields(pool: ElasticPool, slots: int, seed: int) -> dict[str, torch.Tensor]:
    """Write random data into slots [0, slots) of every field; return copies to compare with."""
    g = torch.Generator().manual_seed(seed)
    ref: dict[str, torch.Tensor] = {}
    for f in pool.layout.fields:
        data = torch.randn((slots, *f.shape), generator=g).to(f.dtype)
        pool.view(f.name)[:slots] = data
        ref[f.name] = data.clone()
    return ref


def assert_same(pool: ElasticPool, ref: dict[str, torch.Tensor], slots: int) -> None:
    for name, data in ref.items():
        got = pool.view(name)[:slots]
        # Bit for bit, not approximately: compare the raw bytes.
        assert torch.equal(got.contiguous().view(torch.uint8), data[:slots].contiguous().view(torch.uint8)), name


# -- addresses and data ------------------------------------------------------------------------

def test_buffer_pointer_never_moves_and_kept_pages_keep_data() -> None:
    buf = ElasticBuffer(64 * OS_PAGE_BYTES)
    t = buf.tensor
    ptr = t.data_ptr()
    buf.grow(64)
    t.copy_(torch.randint(0, 256, (t.numel(),), dtype=torch.uint8))
    head = t[: 10 * OS_PAGE_BYTES].clone()
    for n in (10, 40, 10, 64, 10):
        if n < buf.committed_pages:
            buf.shrink_to(n)
        else:
            buf.grow(n - buf.committed_pages)
        assert buf.tensor.data_ptr() == ptr and t.data_ptr() == ptr
        assert torch.equal(t[: 10 * OS_PAGE_BYTES], head)
    # Released pages come back zeroed: they were freed, not just dropped from the page tables.
    assert int(t[10 * OS_PAGE_BYTES :].count_nonzero()) == 0


@pytest.mark.parametrize("grouping", GROUPINGS)
def test_pool_views_fixed_and_live_slots_bit_for_bit(grouping: str) -> None:
    pool = ElasticPool(kv_layout(grouping), capacity=1024)
    ptrs = {f.name: pool.view(f.name).data_ptr() for f in pool.layout.fields}
    live = 300
    ref = fill_fields(pool, live, seed=1)
    for cap in (live, 4096, 512, live, 2048, live):
        pool.resize(cap)
        assert pool.capacity == cap
        assert {f.name: pool.view(f.name).data_ptr() for f in pool.layout.fields} == ptrs
        assert_same(pool, ref, live)
    # Slots admitted again after their page was released read as zero.
    pool.resize(4096)
    row = pool.layout.regions[0].row_bytes  # k0 lives in the first region in both groupings
    kept_bytes = -(-live * row // OS_PAGE_BYTES) * OS_PAGE_BYTES  # the live slots' pages stayed
    first_released = -(-kept_bytes // row)
    assert int(pool.view("k0")[first_released:].count_nonzero()) == 0


def test_layouts_give_kvpool_and_mambapool_shapes() -> None:
    slot_major = kv_layout("slot_major", max_slots=100)
    pool = ElasticPool(slot_major, capacity=100)
    k1 = pool.view("k1")
    assert k1.shape == (100, 2, 16) and k1.dtype == torch.float16
    assert k1[0].is_contiguous() and k1.stride(0) * 2 == slot_major.bytes_per_slot  # all layers in one row
    fm = ElasticPool(kv_layout("field_major", max_slots=100), capacity=100)
    assert fm.view("v2").is_contiguous()  # contiguous per-layer pool, as the kernels expect today
    spec = MambaSpec(num_layers=2, conv_shape=(24, 3), ssm_shape=(2, 4, 4), conv_dtype=torch.bfloat16)
    mamba = ElasticPool(spec.layout(max_slots=8, page_bytes=OS_PAGE_BYTES), capacity=8)
    assert mamba.view("conv1").shape == (8, 24, 3) and mamba.view("conv1").dtype == torch.bfloat16
    assert mamba.view("ssm0").shape == (8, 2, 4, 4) and mamba.view("ssm0").dtype == torch.float32
    assert mamba.layout.bytes_per_slot >= spec.bytes_per_slot
    # Writing one field of one slot touches no other field or slot.
    mamba.view("ssm1")[3] = 1.0
    total = sum(int(mamba.view(f.name).count_nonzero()) for f in mamba.layout.fields)
    assert total == 2 * 4 * 4


@pytest.mark.parametrize("grouping", GROUPINGS)
def test_granular_capacity_commits_exactly_its_bytes(grouping: str) -> None:
    layout = kv_layout(grouping)
    g = layout.slot_granularity
    assert g * layout.bytes_per_slot % OS_PAGE_BYTES == 0
    pool = ElasticPool(layout, capacity=3 * g)
    assert pool.committed_bytes == 3 * g * layout.bytes_per_slot
    result = pool.resize(g)
    assert result.released_bytes == 2 * g * layout.bytes_per_slot and result.committed_bytes == 0
    # A capacity inside a page keeps that page (its first slots are live).
    pool.resize(g + 1)
    assert pool.committed_bytes > g * layout.bytes_per_slot


def test_errors_are_precise() -> None:
    pool = ElasticPool(kv_layout("slot_major", max_slots=64), capacity=32)
    with pytest.raises(ValueError, match=r"outside \[0, 64\]"):
        pool.resize(65)
    with pytest.raises(KeyError, match="no field 'k9'"):
        pool.view("k9")
    with pytest.raises(IndexError, match=r"outside the committed capacity \[0, 32\)"):
        pool.check_slots(torch.tensor([0, 5, 32]))
    pool.check_slots(torch.tensor([0, 31]))
    buf = ElasticBuffer(4 * OS_PAGE_BYTES)
    with pytest.raises(ValueError, match="past the"):
        buf.view(torch.float32, (4 * OS_PAGE_BYTES,))
    with pytest.raises(ValueError, match="multiple of"):
        buf.view(torch.float32, (4,), offset=2)
    with pytest.raises(ValueError, match="cannot shrink to 1 pages: 0 committed"):
        buf.shrink_to(1)
    with pytest.raises(ValueError, match="multiple of the OS page"):
        ElasticBuffer(1 << 20, page_bytes=1000)


# -- resident memory ---------------------------------------------------------------------------

def test_rss_drops_after_shrink() -> None:
    size = 256 * MIB
    buf = ElasticBuffer(size)
    buf.grow(buf.reserved_pages)
    before_fill = rss()
    buf.tensor.fill_(0x5A)
    filled = rss()
    assert filled - before_fill >= 0.9 * size  # the pages really became resident
    released = buf.shrink_to(0)
    after = rss()
    assert released == size
    assert filled - after >= 0.8 * released


def test_populate_makes_committed_pages_resident_and_keeps_their_data() -> None:
    """``populate`` faults in the committed pages now (the reservation past them stays untouched),
    keeps what they hold, and a later write faults nothing; a KV pool populates all its buffers,
    split over threads."""
    size = 96 * MIB
    buf = ElasticBuffer(2 * size)
    buf.grow(size // OS_PAGE_BYTES)
    buf.tensor[:OS_PAGE_BYTES].fill_(7)
    before = rss()
    assert buf.populate() == size
    assert rss() - before >= 0.9 * (size - OS_PAGE_BYTES)
    assert rss() - before <= size + 16 * MIB  # not the uncommitted half
    assert int(buf.tensor[:OS_PAGE_BYTES].min()) == 7 and int(buf.tensor[OS_PAGE_BYTES:size].max()) == 0
    minflt = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[7])
    buf.tensor[:size].fill_(1)
    assert int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[7]) - minflt < 64
    assert buf.populate(size, 2 * size) == 0  # nothing committed there
    from services.worker.pools import KVPool

    pool = KVPool(2, 8192, 4, 64, torch.float32)
    before = rss()
    assert pool.populate(threads=2, chunk_bytes=1 * MIB) == 2 * 2 * 8192 * 4 * 64 * 4
    assert rss() - before >= 0.9 * 32 * MIB


def test_repeated_cycles_keep_rss_bounded() -> None:
    size = 64 * MIB
    buf = ElasticBuffer(size)
    base = rss()
    for i in range(6):
        buf.grow(buf.reserved_pages - buf.committed_pages)
        buf.tensor.fill_(i + 1)
        buf.shrink_to(buf.reserved_pages // 8)  # keep an eighth: the pool never fully empties
        assert rss() - base <= size // 8 + 16 * MIB


def test_reservation_may_exceed_physical_memory() -> None:
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "2":
        pytest.skip("strict overcommit accounting ignores MAP_NORESERVE")
    huge = 2 * psutil.virtual_memory().total
    buf = ElasticBuffer(huge)
    assert buf.reserved_bytes >= huge and buf.committed_bytes == 0
    buf.grow(4)
    buf.tensor[: 4 * OS_PAGE_BYTES] = 1


def test_guard_makes_touching_uncommitted_pages_fatal() -> None:
    code = (
        "from services.worker.elastic import ElasticBuffer, OS_PAGE_BYTES as P\n"
        "b = ElasticBuffer(8 * P, guard=True)\n"
        "b.grow(2); b.tensor[: 2 * P] = 7; b.shrink_to(1)\n"
        "assert int(b.tensor[0]) == 7\n"
        "print('ok', flush=True)\n"
        "b.tensor[P] = 1\n"  # page 1 was released: must crash, not silently re-commit
        "print('survived', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout.split() == ["ok"], proc.stderr
    assert proc.returncode == -11  # SIGSEGV


# -- GPU path ----------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without CUDA VMM")
def test_cuda_vmm_reports_unavailable_here() -> None:
    ok, reason = cuda_vmm.available()
    assert not ok and reason
    with pytest.raises(RuntimeError, match="CUDA virtual memory management is unavailable"):
        cuda_vmm.CudaVmmBuffer(1 << 21)


@pytest.mark.skipif(not cuda_vmm.available().ok, reason="needs CUDA VMM (cuda-python bindings and a GPU)")
def test_cuda_vmm_pool_grows_shrinks_in_place() -> None:
    page = cuda_vmm.granularity()
    layout = ElasticPoolLayout.kv(2, 8, 128, torch.bfloat16, max_slots=64 * 1024, page_bytes=page)
    pool = ElasticPool(layout, capacity=4096, backing=lambda n, p: cuda_vmm.CudaVmmBuffer(n, p))
    ptr = pool.view("k0").data_ptr()
    pool.view("k0")[:4096] = 3.0
    free_before = torch.cuda.mem_get_info()[0]
    pool.resize(64 * 1024)
    assert torch.cuda.mem_get_info()[0] < free_before
    released = pool.resize(4096).released_bytes
    assert released > 0 and torch.cuda.mem_get_info()[0] >= free_before - page
    assert pool.view("k0").data_ptr() == ptr
    assert bool((pool.view("k0")[:4096] == 3.0).all())
