"""The host (L2) pool: page-first contiguity, device↔host copies bit for bit, the L3 byte view,
budget sizing, and the host page allocator's bookkeeping."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.memory.host_alloc import HostDoubleFreeError, HostPageAllocator
from services.worker.host_cache import HostPool
from services.worker.pools import KVPool

LAYERS, HEADS, DIM, PAGE = 3, 2, 8, 4


def filled_pool(num_slots: int = 64, dtype: torch.dtype = torch.float32) -> KVPool:
    """A pool whose every element is distinct, so a misplaced slot, layer or K/V swap shows."""
    kv = KVPool(LAYERS, num_slots, HEADS, DIM, dtype)
    g = torch.Generator().manual_seed(0)
    for i in range(LAYERS):
        kv.k[i].copy_(torch.randn(kv.k[i].shape, generator=g))
        kv.v[i].copy_(torch.randn(kv.v[i].shape, generator=g))
    return kv


# (slots, host pages, destination slots) in the shapes the copy paths are chosen by.
ALIGNED_ONE_RUN = ([*range(8, 16)], [3, 4], [*range(40, 48)])
ALIGNED_FEW_RUNS = ([*range(0, 16), *range(32, 48)], [0, 1, 2, 3, 6, 7, 8, 9], [*range(16, 32), *range(48, 64)])
ALIGNED_SCATTERED = (
    [*range(44, 48), *range(4, 8), *range(24, 28), *range(12, 16)],
    [7, 2, 9, 0],
    [*range(0, 4), *range(60, 64), *range(36, 40), *range(20, 24)],
)
UNALIGNED = ([*range(9, 13), 3, 40, 17, 63], [5, 1], [*range(30, 34), 0, 6, 9, 13])


@pytest.mark.parametrize("layout", [ALIGNED_ONE_RUN, ALIGNED_FEW_RUNS, ALIGNED_SCATTERED, UNALIGNED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backup_then_load_into_other_slots_is_bit_exact(
    layout: tuple[list[int], list[int], list[int]], dtype: torch.dtype
) -> None:
    slots, host_pages, new_slots = layout
    src = filled_pool(dtype=dtype)
    host = HostPool(10, PAGE, LAYERS, HEADS, DIM, dtype)
    host.pages.fill_(-1)  # pages the backup must not touch
    host.backup(src, slots, host_pages)
    others = [p for p in range(10) if p not in host_pages]
    assert bool((host.pages[others] == -1).all())

    dst = KVPool(LAYERS, 64, HEADS, DIM, dtype)
    host.load(dst, host_pages, new_slots)
    for i in range(LAYERS):
        for a, b in ((src.k[i], dst.k[i]), (src.v[i], dst.v[i])):
            assert torch.equal(a[slots].view(torch.uint8), b[new_slots].view(torch.uint8))
    untouched = [s for s in range(64) if s not in new_slots]
    assert not dst.k[0][untouched].any() and not dst.v[LAYERS - 1][untouched].any()


def test_page_layout_is_page_first() -> None:
    src = filled_pool()
    host = HostPool(4, PAGE, LAYERS, HEADS, DIM, torch.float32)
    host.backup(src, list(range(4, 8)), [1])
    page = host.pages[1]
    assert page.is_contiguous()
    assert page.numel() * page.element_size() == host.bytes_per_page == 2 * PAGE * LAYERS * HEADS * DIM * 4
    assert torch.equal(page[2, 0], src.k[2][4:8]) and torch.equal(page[0, 1], src.v[0][4:8])
    assert host.layout == f"page-first/L{LAYERS}/H{HEADS}/D{DIM}/float32/P{PAGE}"


def test_page_bytes_write_page_round_trip() -> None:
    src = filled_pool(dtype=torch.bfloat16)
    host = HostPool(3, PAGE, LAYERS, HEADS, DIM, torch.bfloat16)
    host.backup(src, list(range(PAGE)), [0])
    view = host.page_bytes(0)
    assert view.readonly and view.nbytes == host.bytes_per_page
    data = bytes(view)  # what an L3 put sends
    assert data == host.pages[0].view(torch.uint8).numpy().tobytes()
    host.write_page(2, data)  # what an L3 get writes back
    assert torch.equal(host.pages[2].view(torch.uint8), host.pages[0].view(torch.uint8))
    # The view is zero-copy: it sees later writes to the page.
    host.write_page(0, bytes(host.bytes_per_page))
    assert view == bytes(host.bytes_per_page)

    dst = KVPool(LAYERS, 16, HEADS, DIM, torch.bfloat16)
    host.load(dst, [2], list(range(8, 12)))
    assert torch.equal(dst.k[1][8:12], src.k[1][:PAGE]) and torch.equal(dst.v[2][8:12], src.v[2][:PAGE])

    with pytest.raises(ValueError, match="bytes"):
        host.write_page(1, data[:-1])
    with pytest.raises(IndexError):
        host.page_bytes(3)


def test_transfers_validate_their_arguments() -> None:
    kv = filled_pool(num_slots=16)
    host = HostPool(4, PAGE, LAYERS, HEADS, DIM, torch.float32)
    with pytest.raises(ValueError, match="need 8 slots"):
        host.backup(kv, list(range(7)), [0, 1])
    with pytest.raises(IndexError, match="host pages"):
        host.backup(kv, list(range(4)), [4])
    with pytest.raises(IndexError, match="slots"):
        host.load(kv, [0], [13, 14, 15, 16])
    with pytest.raises(ValueError, match="repeat"):
        host.backup(kv, list(range(8)), [1, 1])
    with pytest.raises(ValueError, match="repeat"):
        host.load(kv, [0], [1, 1, 2, 3])
    other = KVPool(LAYERS, 16, HEADS, DIM, torch.float16)
    with pytest.raises(ValueError, match="does not match"):
        host.backup(other, list(range(4)), [0])
    host.backup(kv, [], [])  # nothing to do is not an error
    host.load(kv, [], [])


def test_from_budget_sizes_whole_pages() -> None:
    per_page = HostPool.page_bytes_for(PAGE, LAYERS, HEADS, DIM, torch.float16)
    host = HostPool.from_budget(5 * per_page + per_page - 1, PAGE, LAYERS, HEADS, DIM, torch.float16)
    assert host.num_pages == 5 and host.bytes_per_page == per_page
    assert host.pages.numel() * host.pages.element_size() == 5 * per_page
    with pytest.raises(ValueError, match="holds no page"):
        HostPool.from_budget(per_page - 1, PAGE, LAYERS, HEADS, DIM, torch.float16)


def test_allocator_hands_out_lowest_first_all_or_nothing() -> None:
    a = HostPageAllocator(5)
    assert a.alloc(2) == [0, 1]
    assert a.alloc(4) is None and a.available == 3  # not partial, nothing taken
    assert a.alloc(3) == [2, 3, 4]
    a.free([3, 1])
    assert a.available == 2 and a.alloc(2) == [1, 3]
    assert a.alloc(0) == [] and a.alloc(1) is None


def test_allocator_double_free_is_loud_and_changes_nothing() -> None:
    a = HostPageAllocator(4)
    pages = a.alloc(3)
    assert pages is not None
    a.free([pages[0]])
    with pytest.raises(HostDoubleFreeError, match="host page 0"):
        a.free([pages[1], pages[0]])
    assert a.is_allocated(pages[1]) and a.available == 2  # the bad call freed nothing
    with pytest.raises(HostDoubleFreeError, match="twice"):
        a.free([pages[2], pages[2]])
    with pytest.raises(HostDoubleFreeError, match="not allocated"):
        a.free([9])
    a.free(pages[1:])
    assert a.available == 4
