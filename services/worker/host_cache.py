"""The host (L2) tier of the hierarchical cache: KV pages in CPU memory, page-first.

Layout (one block of host memory)::

    pages   [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]   model dtype
             ^ page p   ^ layer     ^ 0 = K, 1 = V

so ``pages[p]`` — every layer's K and V for ``page_size`` tokens — is ONE contiguous run of
``bytes_per_page`` bytes: it goes to and comes from the kvstore (L3) as a single buffer without a
gather, and its bytes are exactly what the L3 key (``services.common.page_hash``, namespaced by
``HostPool.layout``) stands for.

The device pool (``KVPool``) is slot-first per layer, so copies between the tiers move one
``[page_size, H, D]`` block per page per layer and K/V: as slice copies when the pages form a few
long runs on both sides (the scheduler's first-fit pages usually do), else as one gather and one
scatter per layer and K/V (aligned pages index whole blocks; loose slots index single slots).

The scheduler decides which slots and host pages take part (the worker keeps no bookkeeping);
``services.scheduler.memory.host_alloc.HostPageAllocator`` is the bookkeeping it uses for host pages.

Index tensors are built per call from the given lists and die with the call: nothing here keeps a
view into a caller's free list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch

from services.worker.pools import KVPool


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class HostPool:
    """Page-first KV pages in host memory (see the module docstring for the layout).

    Unwritten pages hold undefined bytes: a page is read only after ``backup`` or ``write_page``
    filled it. ``pin_memory=True`` needs CUDA (page-locked memory makes device↔host copies DMA).
    """

    __slots__ = ("dtype", "head_dim", "num_kv_heads", "num_layers", "num_pages", "page_size", "pages")

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pin_memory: bool = False,
    ) -> None:
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"HostPool.{name} must be >= 1, got {value}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
        # empty, not zeros: a large host budget is then only committed as pages are written.
        self.pages = torch.empty(shape, dtype=dtype, pin_memory=pin_memory)

    @staticmethod
    def page_bytes_for(
        page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes of one page: every layer's K and V for ``page_size`` tokens."""
        return 2 * page_size * num_layers * num_kv_heads * head_dim * _itemsize(dtype)

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pin_memory: bool = False,
    ) -> HostPool:
        """The most pages that fit in ``budget_bytes``; ValueError when not even one does."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        per_page = cls.page_bytes_for(page_size, num_layers, num_kv_heads, head_dim, dtype)
        num_pages = budget_bytes // per_page
        if num_pages < 1:
            raise ValueError(
                f"host_cache_bytes={budget_bytes} holds no page: one page needs {per_page} bytes"
            )
        return cls(num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, pin_memory)

    @property
    def bytes_per_page(self) -> int:
        return self.page_bytes_for(
            self.page_size, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype
        )

    @property
    def layout(self) -> str:
        """Names everything that decides a page's bytes; goes into the page-hash namespace, so
        pages written under another layout are never read back as this one."""
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"page-first/L{self.num_layers}/H{self.num_kv_heads}/D{self.head_dim}/{dtype}/P{self.page_size}"
        )

    # --- device ↔ host --------------------------------------------------------------------------

    def backup(self, kv: KVPool, slots: Sequence[int], host_pages: Sequence[int]) -> None:
        """Copy device slots into host pages: ``slots[j*page_size:(j+1)*page_size]`` (in token
        order) → ``host_pages[j]``, every layer, K and V. Synchronous: returns once the bytes are on
        the host. Raises ValueError/IndexError for a mismatched pool or out-of-range indices."""
        plan = self._plan(kv, slots, host_pages, unique="host_pages")
        if plan is None:
            return
        if kv.device.type != "cpu":
            self._backup_from_device(kv, plan)
            return
        for i in range(self.num_layers):
            for j, pool in enumerate((kv.k[i], kv.v[i])):
                dst = self.pages[:, i, j]  # [num_pages, P, H, D], strided view
                if plan.runs is not None:
                    src = self._paged(pool)
                    for d, h, m in plan.runs:
                        dst[h : h + m].copy_(src[d : d + m])
                else:
                    dst.index_copy_(0, plan.host_idx, self._gather(pool, plan))

    def load(self, kv: KVPool, host_pages: Sequence[int], slots: Sequence[int]) -> None:
        """Copy host pages into device slots: ``host_pages[j]`` → ``slots[j*page_size:
        (j+1)*page_size]``, every layer, K and V. Synchronous. Raises like ``backup``."""
        plan = self._plan(kv, slots, host_pages, unique="slots")
        if plan is None:
            return
        if kv.device.type != "cpu":
            self._load_to_device(kv, plan)
            return
        for i in range(self.num_layers):
            for j, pool in enumerate((kv.k[i], kv.v[i])):
                src = self.pages[:, i, j]
                if plan.runs is not None:
                    dst = self._paged(pool)
                    for d, h, m in plan.runs:
                        dst[d : d + m].copy_(src[h : h + m])
                else:
                    self._scatter(pool, plan, src.index_select(0, plan.host_idx))

    def _backup_from_device(self, kv: KVPool, plan: _Plan) -> None:
        # Assemble whole pages on the device (its bandwidth is cheap), then one transfer.
        staging = torch.empty((plan.n, *self.pages.shape[1:]), dtype=self.dtype, device=kv.device)
        for i in range(self.num_layers):
            for j, pool in enumerate((kv.k[i], kv.v[i])):
                staging[:, i, j] = self._gather(pool, plan)
        if plan.host_run is not None:
            self.pages[plan.host_run : plan.host_run + plan.n].copy_(staging)
        else:
            self.pages.index_copy_(0, plan.host_idx, staging.cpu())

    def _load_to_device(self, kv: KVPool, plan: _Plan) -> None:
        if plan.host_run is not None:
            host = self.pages[plan.host_run : plan.host_run + plan.n]  # a view: no host-side copy
        else:
            host = self.pages.index_select(0, plan.host_idx)
        staging = host.to(kv.device)
        for i in range(self.num_layers):
            for j, pool in enumerate((kv.k[i], kv.v[i])):
                self._scatter(pool, plan, staging[:, i, j])

    # --- host ↔ kvstore (L3) --------------------------------------------------------------------

    def page_bytes(self, host_page: int) -> memoryview:
        """A zero-copy, read-only byte view of one page (``bytes_per_page`` long), to send to L3.

        The view aliases the pool: it is only meaningful while the caller holds the page (a freed
        page may be overwritten by the next backup), so drop it once the put has been sent.
        """
        return self._view(host_page).toreadonly()

    def write_page(self, host_page: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite one page with ``bytes_per_page`` bytes fetched from L3 (a single memcpy)."""
        view = self._view(host_page)
        if memoryview(data).nbytes != view.nbytes:
            raise ValueError(f"page data is {memoryview(data).nbytes} bytes, a page is {view.nbytes}")
        view[:] = memoryview(data).cast("B")

    # --- helpers --------------------------------------------------------------------------------

    def _view(self, host_page: int) -> memoryview:
        if not 0 <= host_page < self.num_pages:
            raise IndexError(f"host page {host_page} out of range [0, {self.num_pages})")
        # uint8 view of a contiguous page → numpy shares the storage → a flat byte memoryview.
        flat: Any = self.pages[host_page].view(torch.uint8).reshape(-1).numpy()  # numpy is a Buffer
        return memoryview(flat)

    def _paged(self, pool: torch.Tensor) -> torch.Tensor:
        """``[num_slots, H, D]`` → ``[num_slots // P, P, H, D]`` (a view; the pool holds whole pages)."""
        return pool.view(-1, self.page_size, self.num_kv_heads, self.head_dim)

    def _gather(self, pool: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """The plan's device pages of one layer's K or V as a new ``[n, P, H, D]`` tensor."""
        if plan.dev_pages is not None:
            return self._paged(pool).index_select(0, plan.dev_pages)
        assert plan.slot_idx is not None
        return pool.index_select(0, plan.slot_idx).view(plan.n, self.page_size, self.num_kv_heads, self.head_dim)

    def _scatter(self, pool: torch.Tensor, plan: _Plan, pages: torch.Tensor) -> None:
        """Write ``[n, P, H, D]`` into the plan's device slots of one layer's K or V."""
        if plan.dev_pages is not None:
            self._paged(pool).index_copy_(0, plan.dev_pages, pages)
            return
        assert plan.slot_idx is not None
        rows = plan.n * self.page_size
        pool.index_copy_(0, plan.slot_idx, pages.reshape(rows, self.num_kv_heads, self.head_dim))

    def _plan(
        self,
        kv: KVPool,
        slots: Sequence[int],
        host_pages: Sequence[int],
        unique: Literal["host_pages", "slots"],
    ) -> _Plan | None:
        """Validate a transfer and choose how to run it; None when there is nothing to move."""
        if (kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype) != (
            self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
        ):  # fmt: skip
            raise ValueError(
                f"KV pool (L{kv.num_layers}/H{kv.num_kv_heads}/D{kv.head_dim}/{kv.dtype}) does not "
                f"match the host pool ({self.layout})"
            )
        n, ps = len(host_pages), self.page_size
        if len(slots) != n * ps:
            raise ValueError(f"{n} host pages need {n * ps} slots, got {len(slots)}")
        if not n:
            return None
        if not 0 <= min(host_pages) <= max(host_pages) < self.num_pages:
            raise IndexError(f"host pages out of range [0, {self.num_pages})")
        if not 0 <= min(slots) <= max(slots) < kv.num_slots:
            raise IndexError(f"slots out of range [0, {kv.num_slots})")
        # The destination of a copy must not repeat, or which source wins is undefined.
        dst = host_pages if unique == "host_pages" else slots
        if len(set(dst)) != len(dst):
            raise ValueError(f"{unique} repeat an index; each destination must be written once")

        # Index tensors are built here, owned by the plan, and die with the call.
        host_idx = torch.tensor(host_pages, dtype=torch.int64)
        grid = torch.tensor(slots, dtype=torch.int64).view(n, ps)
        heads = grid[:, 0]
        # The scheduler hands out whole aligned pages (P consecutive slots from a multiple of P):
        # then the copy moves [P, H, D] blocks per index instead of single slots.
        aligned = kv.num_slots % ps == 0 and bool(
            (heads % ps == 0).all() and (grid - heads[:, None] == torch.arange(ps)).all()
        )
        first = host_pages[0]
        host_run = first if list(host_pages) == list(range(first, first + n)) else None
        runs = None
        if aligned:
            runs = _runs((heads // ps).tolist(), list(host_pages))
            # A slice copy per run beats a gather + scatter only while runs are a few pages long.
            if len(runs) > max(1, n // _MIN_RUN_PAGES):
                runs = None
        return _Plan(
            n=n,
            host_idx=host_idx,
            dev_pages=(heads // ps).to(kv.device) if aligned else None,
            slot_idx=None if aligned else grid.view(-1).to(kv.device),
            runs=runs,
            host_run=host_run,
        )


# A run-by-run copy pays one small torch call per run, layer and K/V; below about this many pages
# per run on average, one gather and one scatter per layer and K/V are faster (benchmarks/host_cache_copy.py).
_MIN_RUN_PAGES = 4


class _Plan(NamedTuple):
    """How one backup or load moves its ``n`` pages (built and dropped within the call)."""

    n: int
    host_idx: torch.Tensor  # [n] host page ids (CPU)
    dev_pages: torch.Tensor | None  # [n] device page ids when slots are whole aligned pages
    slot_idx: torch.Tensor | None  # [n * P] device slots otherwise
    runs: list[tuple[int, int, int]] | None  # (device page, host page, length) when few and long
    host_run: int | None  # first host page when host pages are one ascending run


def _runs(dev: list[int], host: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs where both device and host page ids ascend by one together."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for k in range(1, len(dev) + 1):
        if k == len(dev) or dev[k] != dev[k - 1] + 1 or host[k] != host[k - 1] + 1:
            out.append((dev[start], host[start], k - start))
            start = k
    return out
