"""Elastic backing memory: a virtual range reserved once, physical pages committed on demand.

Contract shared by every backing (CPU here, CUDA VMM in ``cuda_vmm.py``):

* The whole range is reserved at construction and exposed as ONE ``uint8`` tensor whose data
  pointer never changes. Views handed out stay valid for the life of the backing: growing and
  shrinking change which pages hold physical memory, never an address.
* Pages are committed as a prefix: ``committed_pages`` pages from the start of the range.
* Newly committed pages read as zero. Data in pages that stay committed is never touched.
* Shrinking releases the tail pages for real (resident memory falls by their size). Reading or
  writing an uncommitted page is a caller bug: on the CPU it silently re-commits the page (or
  raises SIGSEGV with ``guard=True``); on a GPU it is an illegal address.

``ElasticPool`` carves typed per-slot tensors (KV per layer, Mamba conv/ssm per layer) out of
such backings with an ``ElasticPoolLayout`` chosen so that a tail of free slots is whole pages.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

OS_PAGE_BYTES = mmap.PAGESIZE
# Python's mmap module does not export MAP_NORESERVE; without it the kernel's overcommit
# heuristic refuses a reservation larger than RAM + swap, although we never commit all of it.
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0
# Field offsets inside a slot-major row are aligned so that rows allow 16-byte vector loads.
_FIELD_ALIGN = 16
_PROT_NONE = 0  # POSIX value; the mmap module exports PROT_READ/PROT_WRITE but not PROT_NONE
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not in Python's mmap module before 3.13


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def typed_view(
    base: torch.Tensor,
    dtype: torch.dtype,
    shape: Sequence[int],
    strides: Sequence[int] | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` (element ``strides``) over ``base`` bytes from ``offset``.

    ``base`` is the 1-D ``uint8`` tensor of a whole reservation. The view shares its memory, so
    its address is fixed too. Raises ``ValueError`` for a misaligned offset or an extent that
    leaves the reservation.
    """
    itemsize = _itemsize(dtype)
    shape = tuple(shape)
    if strides is None:
        strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    strides = tuple(strides)
    if len(strides) != len(shape):
        raise ValueError(f"view shape {shape} and strides {strides} differ in rank")
    if offset < 0 or offset % itemsize:
        raise ValueError(f"view offset {offset} must be >= 0 and a multiple of {dtype}'s {itemsize} bytes")
    last = sum((d - 1) * s for d, s in zip(shape, strides, strict=True)) if all(shape) else -1
    extent = offset + (last + 1) * itemsize
    if extent > base.numel():
        raise ValueError(f"view of {shape}/{strides} {dtype} at byte {offset} ends at byte {extent}, "
                         f"past the {base.numel()}-byte reservation")
    return base.view(dtype).as_strided(shape, strides, offset // itemsize)


class PageBacking(Protocol):
    """What ``ElasticPool`` needs from a backing (``ElasticBuffer``, ``CudaVmmBuffer``)."""

    @property
    def tensor(self) -> torch.Tensor: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def reserved_pages(self) -> int: ...
    @property
    def committed_pages(self) -> int: ...
    def grow(self, n_pages: int) -> int: ...
    def shrink_to(self, n_pages: int) -> int: ...


class ElasticBuffer:
    """CPU backing: an anonymous private ``mmap`` reservation committed page by page.

    Private (not shared) on purpose: ``MADV_DONTNEED`` on a shared anonymous mapping only drops
    the page-table entries (RSS falls, but the shmem pages stay allocated and come back on the
    next touch); on a private mapping it frees the pages and the next touch reads zeros.
    ``MAP_NORESERVE`` lets the reservation exceed what the machine could commit at once.

    The mapping lives as long as the buffer or any tensor viewing it (``torch.frombuffer`` holds
    a reference to the mmap object); there is deliberately no ``close``.
    """

    __slots__ = ("_committed", "_guard", "_map", "_page_bytes", "_pages", "_tensor")

    def __init__(self, reserve_bytes: int, page_bytes: int = OS_PAGE_BYTES, *, guard: bool = False) -> None:
        """Reserve ``reserve_bytes`` rounded up to whole pages; nothing is committed yet.

        ``page_bytes`` is the commit granularity, a positive multiple of the OS page.
        ``guard=True`` makes uncommitted pages inaccessible (``PROT_NONE``), so a stray touch
        crashes loudly instead of silently committing memory: for tests and debugging.
        """
        if reserve_bytes < 1:
            raise ValueError(f"reserve_bytes must be >= 1, got {reserve_bytes}")
        if page_bytes < OS_PAGE_BYTES or page_bytes % OS_PAGE_BYTES:
            raise ValueError(f"page_bytes must be a positive multiple of the OS page ({OS_PAGE_BYTES}), "
                             f"got {page_bytes}")
        self._page_bytes = page_bytes
        self._pages = -(-reserve_bytes // page_bytes)
        self._committed = 0
        self._guard = guard
        self._map = mmap.mmap(-1, self._pages * page_bytes, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        if guard:
            self._protect(0, self._pages, _PROT_NONE)

    # -- geometry ---------------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        """The whole reservation as one 1-D ``uint8`` tensor; its data pointer never changes."""
        return self._tensor

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def reserved_pages(self) -> int:
        return self._pages

    @property
    def reserved_bytes(self) -> int:
        return self._pages * self._page_bytes

    @property
    def committed_pages(self) -> int:
        return self._committed

    @property
    def committed_bytes(self) -> int:
        return self._committed * self._page_bytes

    def view(
        self, dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int] | None = None, offset: int = 0
    ) -> torch.Tensor:
        """A typed tensor over this reservation (see ``typed_view``); valid while the buffer lives."""
        return typed_view(self._tensor, dtype, shape, strides, offset)

    # -- commit / release -------------------------------------------------------------------
    def grow(self, n_pages: int) -> int:
        """Commit ``n_pages`` more pages after the committed prefix; returns the bytes committed.

        The kernel backs a private anonymous page on first touch with a zeroed page, so growing
        costs nothing until the pages are written (and they read as zero).
        """
        if n_pages < 0 or self._committed + n_pages > self._pages:
            raise ValueError(f"cannot grow by {n_pages} pages: {self._committed} of {self._pages} committed")
        if self._guard and n_pages:
            self._protect(self._committed, n_pages, mmap.PROT_READ | mmap.PROT_WRITE)
        self._committed += n_pages
        return n_pages * self._page_bytes

    def shrink_to(self, n_pages: int) -> int:
        """Release every page from ``n_pages`` on; returns the bytes released.

        Pages below ``n_pages`` keep their data bit for bit. The released pages' contents are
        gone: they read as zero once committed again.
        """
        if not 0 <= n_pages <= self._committed:
            raise ValueError(f"cannot shrink to {n_pages} pages: {self._committed} committed")
        released = self._committed - n_pages
        if released:
            start, length = n_pages * self._page_bytes, released * self._page_bytes
            self._map.madvise(mmap.MADV_DONTNEED, start, length)
            if self._guard:
                self._protect(n_pages, released, _PROT_NONE)
        self._committed = n_pages
        return released * self._page_bytes

    def populate(self, first_byte: int = 0, end_byte: int | None = None) -> int:
        """Write-fault the committed bytes ``[first_byte, end_byte)`` now (default: all of them),
        keeping their contents; returns the bytes covered. A page's first write costs a fault
        (~5 us here, in a VM), which a forward storing KV into fresh slots would otherwise pay
        step by step. ``MADV_POPULATE_WRITE`` (Linux 5.14+; the call releases the GIL, so threads
        can split a large pool), else a read-and-write of one byte per page."""
        end = self.committed_bytes if end_byte is None else min(end_byte, self.committed_bytes)
        start = first_byte - first_byte % OS_PAGE_BYTES
        if start >= end:
            return 0
        addr = self._tensor.data_ptr() + start
        if _libc().madvise(ctypes.c_void_p(addr), ctypes.c_size_t(end - start), _MADV_POPULATE_WRITE):
            self._tensor[start:end:OS_PAGE_BYTES].add_(0)  # an older kernel: touch each page ourselves
        return end - start

    def _protect(self, first_page: int, n_pages: int, prot: int) -> None:
        addr = self._tensor.data_ptr() + first_page * self._page_bytes
        if _libc().mprotect(ctypes.c_void_p(addr), ctypes.c_size_t(n_pages * self._page_bytes), prot):
            err = ctypes.get_errno()
            raise OSError(err, f"mprotect of {n_pages} pages failed")


@functools.cache
def _libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.mprotect.restype = ctypes.c_int
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    return lib


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One per-slot tensor of a pool: e.g. ``k3`` = layer 3's K, ``[num_kv_heads, head_dim]``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class Region:
    """One reservation: slot ``s`` owns bytes ``[s * row_bytes, (s + 1) * row_bytes)``."""

    row_bytes: int
    offsets: tuple[tuple[FieldSpec, int], ...]  # each field and its byte offset inside a row


Grouping = Literal["slot_major", "field_major"]


@dataclass(frozen=True, slots=True)
class ElasticPoolLayout:
    """Where each field of each of ``max_slots`` slots lives, so that free tail slots are pages.

    ``slot_major`` (default): one region; a slot's row holds all of its fields, so any run of
    slots is ONE contiguous byte range across all layers (also what a page-first host copy
    wants)::

        byte 0                                                                   row_bytes
        | slot 0: [k0][v0][k1][v1] … [k{L-1}][v{L-1}] pad | slot 1: [k0][v0] … | … | slot max-1 |
        |<---- committed: ceil(capacity * row_bytes / page) pages ---->|<-- reserved, unmapped -->|

        k[i] = [max_slots, H, D] view, stride(0) = row_bytes / itemsize (rows contiguous, slots strided)

    ``field_major``: one region per field; every field is a contiguous ``[max_slots, *shape]``
    tensor (what kernels that want contiguous per-layer pools expect), and a capacity change
    commits or releases the same slot tail in every region::

        region k0: | slot 0 | slot 1 | … committed … |<-- unmapped -->|
        region v0: | slot 0 | slot 1 | … committed … |<-- unmapped -->|   … one per field

    Either way a capacity that is a multiple of ``slot_granularity`` ends exactly on a page
    boundary in every region; any other capacity keeps the page holding its last slot.
    """

    fields: tuple[FieldSpec, ...]
    max_slots: int
    page_bytes: int
    grouping: Grouping = "slot_major"
    regions: tuple[Region, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.fields:
            raise ValueError("ElasticPoolLayout needs at least one field")
        if len({f.name for f in self.fields}) != len(self.fields):
            raise ValueError(f"duplicate field names in {[f.name for f in self.fields]}")
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {self.max_slots}")
        if self.page_bytes < 1:
            raise ValueError(f"page_bytes must be >= 1, got {self.page_bytes}")
        if self.grouping == "field_major":
            regions = tuple(Region(f.nbytes, ((f, 0),)) for f in self.fields)
        elif self.grouping == "slot_major":
            offsets, at = [], 0
            for f in self.fields:
                at = _round_up(at, max(_FIELD_ALIGN, _itemsize(f.dtype)))
                offsets.append((f, at))
                at += f.nbytes
            regions = (Region(_round_up(at, _FIELD_ALIGN), tuple(offsets)),)
        else:
            raise ValueError(f"grouping must be 'slot_major' or 'field_major', got {self.grouping!r}")
        object.__setattr__(self, "regions", regions)

    @classmethod
    def kv(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_slots: int,
           page_bytes: int, grouping: Grouping = "slot_major") -> ElasticPoolLayout:
        """Fields ``k0, v0, k1, v1, …`` of shape ``[num_kv_heads, head_dim]``."""
        fields = tuple(FieldSpec(f"{kv}{i}", dtype, (num_kv_heads, head_dim))
                       for i in range(num_layers) for kv in ("k", "v"))
        return cls(fields, max_slots, page_bytes, grouping)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot costs, padding included (what a budget must count per slot)."""
        return sum(r.row_bytes for r in self.regions)

    @property
    def slot_granularity(self) -> int:
        """Smallest slot count whose rows fill whole pages in every region."""
        return math.lcm(*(self.page_bytes // math.gcd(self.page_bytes, r.row_bytes) for r in self.regions))

    def pages_for(self, region: Region, slots: int) -> int:
        """Pages of ``region`` that hold slots ``[0, slots)``."""
        return -(-slots * region.row_bytes // self.page_bytes)

    def committed_bytes(self, slots: int) -> int:
        """Bytes committed over all regions at a capacity of ``slots``."""
        return sum(self.pages_for(r, slots) for r in self.regions) * self.page_bytes


# ---------------------------------------------------------------------------------------------
# Pool
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ResizeResult:
    capacity: int          # slots usable after the resize
    committed_bytes: int   # bytes newly committed by this resize (0 on a shrink)
    released_bytes: int    # bytes released by this resize (0 on a grow)


Backing = Callable[[int, int], PageBacking]  # (reserve_bytes, page_bytes) -> backing


class ElasticPool:
    """A layout's typed views over elastic backings, plus the committed slot capacity.

    Views cover all ``max_slots`` slots and never move; only slots ``[0, capacity)`` are backed.
    The pool does no allocation bookkeeping: the scheduler's allocator must only hand out slots
    below ``capacity`` and must guarantee, before asking for a shrink, that every slot from the
    new capacity on is free (no request and no cache node refers to it). Slots admitted by a
    grow read as zero when their page was released, else they hold what they last held.
    """

    __slots__ = ("_buffers", "_capacity", "_views", "layout")

    def __init__(self, layout: ElasticPoolLayout, capacity: int = 0, *, backing: Backing | None = None,
                 guard: bool = False) -> None:
        self.layout = layout
        make: Backing = backing or (lambda n, page: ElasticBuffer(n, page, guard=guard))
        self._buffers: list[PageBacking] = []
        self._views: dict[str, torch.Tensor] = {}
        for region in layout.regions:
            buf = make(layout.max_slots * region.row_bytes, layout.page_bytes)
            if buf.page_bytes != layout.page_bytes:
                raise ValueError(f"backing commits {buf.page_bytes}-byte pages, layout assumes {layout.page_bytes}")
            self._buffers.append(buf)
            for f, off in region.offsets:
                itemsize = _itemsize(f.dtype)
                inner = tuple(math.prod(f.shape[i + 1 :]) for i in range(len(f.shape)))
                self._views[f.name] = typed_view(buf.tensor, f.dtype, (layout.max_slots, *f.shape),
                                                 (region.row_bytes // itemsize, *inner), off)
        self._capacity = 0
        self.resize(capacity)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def committed_bytes(self) -> int:
        return sum(b.committed_pages for b in self._buffers) * self.layout.page_bytes

    @property
    def backings(self) -> tuple[PageBacking, ...]:
        return tuple(self._buffers)

    def view(self, name: str) -> torch.Tensor:
        """``[max_slots, *shape]`` tensor of field ``name``; same object, same address, forever."""
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(f"no field {name!r}; fields: {list(self._views)}") from None

    def resize(self, new_capacity: int) -> ResizeResult:
        """Commit or release pages so that slots ``[0, new_capacity)`` are backed.

        Shrink precondition (not checkable here): slots ``[new_capacity, capacity)`` are free.
        Live slots below ``new_capacity`` keep their data bit for bit, whatever the direction.
        """
        if not 0 <= new_capacity <= self.layout.max_slots:
            raise ValueError(f"capacity {new_capacity} outside [0, {self.layout.max_slots}]")
        committed = released = 0
        for region, buf in zip(self.layout.regions, self._buffers, strict=True):
            pages = self.layout.pages_for(region, new_capacity)
            if pages > buf.committed_pages:
                committed += buf.grow(pages - buf.committed_pages)
            else:
                released += buf.shrink_to(pages)
        self._capacity = new_capacity
        return ResizeResult(new_capacity, committed, released)

    def check_slots(self, slots: torch.Tensor) -> None:
        """Raise ``IndexError`` if any slot index lies outside ``[0, capacity)`` (step-op boundary check)."""
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self._capacity):
            raise IndexError(f"slot indices [{int(slots.min())}, {int(slots.max())}] outside the committed "
                             f"capacity [0, {self._capacity})")
