"""Which page backing the worker's pools sit on, chosen once per device.

* ``cpu``: ``ElasticBuffer`` (anonymous ``mmap``; released pages really leave resident memory).
* ``cuda:N`` where CUDA VMM is available (cuda-python bindings, a device that supports it):
  ``CudaVmmBuffer``, committing in the device's allocation granularity (2 MiB today).
* anything else: ``FixedBuffer``, one ordinary allocation of the whole reservation. Commits and
  releases are then bookkeeping only, so the engine reserves no more than the starting capacity
  and reports the pools as not elastic, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.elastic import OS_PAGE_BYTES, Backing, ElasticBuffer, ElasticPool


@dataclass(frozen=True, slots=True)
class BackingChoice:
    make: Backing  # (reserve_bytes, page_bytes) -> PageBacking
    page_bytes: int  # commit granularity in bytes; pools lay their slots out for it
    elastic: bool  # True when a shrink returns the released memory to the system or device
    reason: str  # why the pools are not elastic here; "" when they are


class FixedBuffer:
    """``PageBacking`` over one ordinary allocation: growing and shrinking move no memory.

    Pages that become committed are zeroed, so the contract "newly committed pages read as
    zero" holds as on the elastic backings; their old bytes were never released.
    """

    __slots__ = ("_committed", "_page_bytes", "_pages", "_tensor")

    def __init__(self, reserve_bytes: int, page_bytes: int, device: torch.device | str = "cpu") -> None:
        if reserve_bytes < 1 or page_bytes < 1:
            raise ValueError(f"reserve_bytes and page_bytes must be >= 1, got {reserve_bytes}, {page_bytes}")
        self._page_bytes = page_bytes
        self._pages = -(-reserve_bytes // page_bytes)
        self._committed = 0
        self._tensor = torch.empty(self._pages * page_bytes, dtype=torch.uint8, device=torch.device(device))

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def reserved_pages(self) -> int:
        return self._pages

    @property
    def committed_pages(self) -> int:
        return self._committed

    def grow(self, n_pages: int) -> int:
        first = self._committed
        if n_pages < 0 or first + n_pages > self._pages:
            raise ValueError(f"cannot grow by {n_pages} pages: {first} of {self._pages} committed")
        self._tensor[first * self._page_bytes : (first + n_pages) * self._page_bytes].zero_()
        self._committed += n_pages
        return n_pages * self._page_bytes

    def shrink_to(self, n_pages: int) -> int:
        if not 0 <= n_pages <= self._committed:
            raise ValueError(f"cannot shrink to {n_pages} pages: {self._committed} committed")
        released, self._committed = self._committed - n_pages, n_pages
        return released * self._page_bytes


def fixed_backing(device: torch.device | str, reason: str) -> BackingChoice:
    """The fallback: a plain allocation on ``device``, reported as not elastic because of ``reason``."""
    dev = torch.device(device)
    return BackingChoice(lambda n, page: FixedBuffer(n, page, dev), OS_PAGE_BYTES, False, reason)


def choose_backing(device: torch.device | str) -> BackingChoice:
    """The elastic backing for ``device`` if there is one here, else ``fixed_backing`` with the reason."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return BackingChoice(lambda n, page: ElasticBuffer(n, page), OS_PAGE_BYTES, True, "")
    if dev.type != "cuda":
        return fixed_backing(dev, f"no elastic backing for device type {dev.type!r}")
    from services.worker import cuda_vmm  # only GPU workers need it

    index = torch.cuda.current_device() if dev.index is None else dev.index
    ok, reason = cuda_vmm.available(index)
    if not ok:
        return fixed_backing(dev, f"CUDA virtual memory management is unavailable: {reason}")
    return BackingChoice(lambda n, page: cuda_vmm.CudaVmmBuffer(n, page, device=index),
                         cuda_vmm.granularity(index), True, "")


def held_bytes(pool: ElasticPool, backing: BackingChoice) -> int:
    """Memory ``pool`` holds now: its committed pages, or its whole reservation on a fixed backing."""
    if backing.elastic:
        return pool.committed_bytes
    return sum(b.reserved_pages * b.page_bytes for b in pool.backings)
