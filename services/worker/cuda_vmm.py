"""GPU backing for elastic pools through CUDA virtual memory management (driver API).

``CudaVmmBuffer`` follows the ``PageBacking`` contract of ``elastic.py``: one virtual range is
reserved once (``cuMemAddressReserve``) and exposed as one ``uint8`` CUDA tensor whose address
never changes; ``grow`` backs further pages with physical memory (``cuMemCreate`` +
``cuMemMap`` + ``cuMemSetAccess``, then zeroes them, since fresh physical memory holds
garbage); ``shrink_to`` synchronizes the device, then unmaps and releases tail pages
(``cuMemUnmap`` + ``cuMemRelease``), so the memory goes back to the device for real.

One physical allocation per page (a page is the device's allocation granularity, 2 MiB on
current GPUs, or a multiple of it): any page can be released alone, at the cost of one handle
per page.

Needs the ``cuda-python`` bindings (``cuda.bindings.driver``, or the older ``cuda.cuda``),
which are not a dependency of Strata: without them ``available()`` says so and constructing a
buffer raises ``RuntimeError``. Nothing here runs at import time.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import torch


class Availability(NamedTuple):
    ok: bool
    reason: str


def _driver() -> ModuleType | None:
    try:
        from cuda.bindings import driver

        return driver
    except ImportError:
        pass
    try:
        from cuda import cuda as legacy

        return legacy
    except ImportError:
        return None


def available(device: int = 0) -> Availability:
    """Whether CUDA VMM can back an elastic pool on ``device`` here, and if not, why."""
    drv = _driver()
    if drv is None:
        return Availability(False, "the cuda-python bindings (module cuda.bindings.driver) are not installed")
    if not torch.cuda.is_available():
        return Availability(False, "torch sees no CUDA device")
    if not 0 <= device < torch.cuda.device_count():
        return Availability(False, f"CUDA device {device} does not exist ({torch.cuda.device_count()} visible)")
    try:
        _make_current(drv, device)
        attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        supported = _check(drv, drv.cuDeviceGetAttribute(attr, device), "cuDeviceGetAttribute")
    except RuntimeError as exc:
        return Availability(False, str(exc))
    if not supported:
        return Availability(False, f"CUDA device {device} does not support virtual memory management")
    return Availability(True, "ok")


def _check(drv: ModuleType, result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising ``RuntimeError`` on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else tuple(values)


def _make_current(drv: ModuleType, device: int) -> None:
    # Allocate through torch first so that the device's primary context (the one torch's
    # tensors live in) exists and is current on this thread; driver calls then act in it.
    torch.empty(1, device=f"cuda:{device}")
    _check(drv, drv.cuInit(0), "cuInit")


class _Reservation:
    """Owns the virtual range and the page handles; frees them when the last tensor view dies.

    Torch keeps this object alive through ``__cuda_array_interface__`` for as long as any view
    of the buffer exists, so the range is never freed under a live tensor.
    """

    def __init__(self, drv: ModuleType, device: int, size: int, page_bytes: int) -> None:
        self.drv, self.device, self.size, self.page_bytes = drv, device, size, page_bytes
        self.base = int(_check(drv, drv.cuMemAddressReserve(size, page_bytes, 0, 0), "cuMemAddressReserve"))
        self.handles: list[Any] = []
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self.prop = prop
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.base, False), "version": 3}

    def map_pages(self, n: int) -> None:
        drv, page = self.drv, self.page_bytes
        first = len(self.handles)
        try:
            for _ in range(n):
                handle = _check(drv, drv.cuMemCreate(page, self.prop, 0), "cuMemCreate")
                addr = self.base + len(self.handles) * page
                try:
                    _check(drv, drv.cuMemMap(addr, page, 0, handle, 0), "cuMemMap")
                except RuntimeError:
                    drv.cuMemRelease(handle)
                    raise
                self.handles.append(handle)
        except RuntimeError:
            self.unmap_to(first)  # all or nothing: a failed grow leaves the old commit
            raise
        if n:
            start = self.base + first * page
            _check(drv, drv.cuMemSetAccess(start, n * page, [self.access], 1), "cuMemSetAccess")

    def unmap_to(self, n: int) -> None:
        drv = self.drv
        while len(self.handles) > n:
            handle = self.handles.pop()
            addr = self.base + len(self.handles) * self.page_bytes
            _check(drv, drv.cuMemUnmap(addr, self.page_bytes), "cuMemUnmap")
            _check(drv, drv.cuMemRelease(handle), "cuMemRelease")

    def __del__(self) -> None:
        try:
            torch.cuda.synchronize(self.device)  # no queued kernel may still use the range
            self.unmap_to(0)
            self.drv.cuMemAddressFree(self.base, self.size)
        except Exception:  # interpreter shutdown: the driver reclaims everything anyway
            pass


class CudaVmmBuffer:
    """GPU ``PageBacking``: reserved once, committed page by page, addresses fixed."""

    __slots__ = ("_pages", "_res", "_tensor")

    def __init__(self, reserve_bytes: int, page_bytes: int | None = None, *, device: int = 0) -> None:
        """Reserve ``reserve_bytes`` rounded up to whole pages on ``device``; nothing committed.

        ``page_bytes`` defaults to the device's minimum allocation granularity and must be a
        multiple of it. Raises ``RuntimeError`` when CUDA VMM is unavailable (with the reason).
        """
        ok, reason = available(device)
        if not ok:
            raise RuntimeError(f"CUDA virtual memory management is unavailable: {reason}")
        drv = _driver()
        assert drv is not None  # available() checked it
        if reserve_bytes < 1:
            raise ValueError(f"reserve_bytes must be >= 1, got {reserve_bytes}")
        gran = int(granularity(device))
        page = page_bytes or gran
        if page < gran or page % gran:
            raise ValueError(f"page_bytes must be a positive multiple of the device granularity {gran}, got {page}")
        self._pages = -(-reserve_bytes // page)
        self._res = _Reservation(drv, device, self._pages * page, page)
        # torch derives the device of a __cuda_array_interface__ pointer by asking the driver
        # about it, which fails on an unmapped range: map one page while the tensor is built.
        self._res.map_pages(1)
        self._tensor = torch.as_tensor(self._res, device=f"cuda:{device}")
        self._res.unmap_to(0)

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    @property
    def page_bytes(self) -> int:
        return self._res.page_bytes

    @property
    def reserved_pages(self) -> int:
        return self._pages

    @property
    def committed_pages(self) -> int:
        return len(self._res.handles)

    def view(self, dtype: torch.dtype, shape: tuple[int, ...], strides: tuple[int, ...] | None = None,
             offset: int = 0) -> torch.Tensor:
        from services.worker.elastic import typed_view

        return typed_view(self._tensor, dtype, shape, strides, offset)

    def grow(self, n_pages: int) -> int:
        """Back ``n_pages`` more pages and zero them; returns the bytes committed."""
        first = self.committed_pages
        if n_pages < 0 or first + n_pages > self._pages:
            raise ValueError(f"cannot grow by {n_pages} pages: {first} of {self._pages} committed")
        self._res.map_pages(n_pages)
        page = self.page_bytes
        self._tensor[first * page : (first + n_pages) * page].zero_()
        return n_pages * page

    def shrink_to(self, n_pages: int) -> int:
        """Release pages from ``n_pages`` on after the device is idle; returns the bytes released."""
        had = self.committed_pages
        if not 0 <= n_pages <= had:
            raise ValueError(f"cannot shrink to {n_pages} pages: {had} committed")
        if n_pages < had:
            # Kernels already queued may still read the tail (a freed slot's last attention read):
            # unmapping under them would be an illegal address.
            torch.cuda.synchronize(self._res.device)
            self._res.unmap_to(n_pages)
        return (had - n_pages) * self.page_bytes


def granularity(device: int = 0) -> int:
    """The device's minimum VMM allocation granularity in bytes (requires ``available()``)."""
    drv = _driver()
    if drv is None:
        raise RuntimeError("the cuda-python bindings (module cuda.bindings.driver) are not installed")
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    option = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(_check(drv, drv.cuMemGetAllocationGranularity(prop, option), "cuMemGetAllocationGranularity"))
