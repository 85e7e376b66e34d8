"""Device memory the worker owns for attention: the KV pool and the ``req_to_token`` table.

The scheduler decides which slot holds which token's KV and which row a request uses; the worker
only stores bytes at the indices it is told. Neither structure does any allocation bookkeeping.

KV pool layout (one pair per full-attention layer ``i``, numbered in model order)::

    k[i], v[i]   [max_slots, num_kv_heads, head_dim]   model dtype, contiguous
                 |<-- slots [0, num_slots): backed -->|<-- reserved, no memory -->|

The buffers are field-major views of one ``ElasticPool`` (one reservation per buffer), so a
free tail of slots is whole pages in every buffer and ``resize`` commits or releases it without
moving a byte of the live slots. ``max_slots == num_slots`` unless a larger reservation is asked.

``req_to_token[row, p]`` is the slot of position ``p`` of the request that owns ``row``.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch

from services.worker.batch import int64_tensor
from services.worker.elastic import ElasticBuffer, ElasticPool, ElasticPoolLayout, ResizeResult
from services.worker.pool_backing import BackingChoice, choose_backing, held_bytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVPool:
    """Per-layer K and V buffers indexed by slot (one slot = one token's KV in every layer).

    ``k[i]`` / ``v[i]`` never change (same tensor objects, shapes and addresses for the pool's
    life); only slots ``[0, num_slots)`` are backed by memory. Touching a slot at or above
    ``num_slots`` is a caller bug: the worker's step validation refuses such slots.
    """

    __slots__ = ("_page_size", "_pool", "backing", "device", "dtype", "head_dim", "k", "num_kv_heads",
                 "num_layers", "v")

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        max_slots: int | None = None,
        page_size: int = 1,
        backing: BackingChoice | None = None,
    ) -> None:
        """``max_slots`` (default ``num_slots``) is the reservation; ``page_size`` the scheduler's
        allocation unit, which every capacity but ``max_slots`` must be a multiple of."""
        max_slots = num_slots if max_slots is None else max_slots
        for name, value in (
            ("num_layers", num_layers),
            ("num_slots", num_slots),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("page_size", page_size),
        ):
            if value < 1:
                raise ValueError(f"KVPool.{name} must be >= 1, got {value}")
        if max_slots < num_slots:
            raise ValueError(f"KVPool.max_slots ({max_slots}) must be >= num_slots ({num_slots})")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.backing = backing or choose_backing(self.device)
        self._page_size = page_size
        layout = ElasticPoolLayout.kv(num_layers, num_kv_heads, head_dim, dtype, max_slots,
                                      self.backing.page_bytes, grouping="field_major")
        # Committed pages read as zero, so a slot read before it is written yields finite values.
        self._pool = ElasticPool(layout, num_slots, backing=self.backing.make)
        self.k: list[torch.Tensor] = [self._pool.view(f"k{i}") for i in range(num_layers)]
        self.v: list[torch.Tensor] = [self._pool.view(f"v{i}") for i in range(num_layers)]

    def populate(self, threads: int = 1, chunk_bytes: int = 64 << 20) -> int:
        """Write-fault every committed page of the CPU pool now (contents kept), in chunks over
        ``threads`` threads; returns the bytes covered (0 on a device, whose memory is not faulted
        in). What a forward would otherwise pay in its steps, page by page, until every slot has
        been used once."""
        jobs = [
            (buf, start, start + chunk_bytes)
            for buf in self._pool.backings
            if isinstance(buf, ElasticBuffer)
            for start in range(0, buf.committed_bytes, chunk_bytes)
        ]
        if threads <= 1 or len(jobs) <= 1:
            return sum(buf.populate(a, b) for buf, a, b in jobs)
        with ThreadPoolExecutor(threads, thread_name_prefix="kv-populate") as pool:
            return sum(pool.map(lambda job: job[0].populate(job[1], job[2]), jobs))

    @staticmethod
    def slot_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one slot over all layers, K and V."""
        return 2 * num_layers * num_kv_heads * head_dim * _itemsize(dtype)

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        *,
        max_bytes: int = 0,
        backing: BackingChoice | None = None,
    ) -> KVPool:
        """The largest pool whose buffers fit in ``budget_bytes``, rounded down to whole pages.

        ``max_bytes`` sizes the reservation the same way (0 = the starting size: the pool can
        shrink and grow back but never beyond it). Raises ``ValueError`` when the budget does
        not hold a single page or ``max_bytes`` is below it.
        """
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if max_bytes and max_bytes < budget_bytes:
            raise ValueError(f"kv_max_bytes={max_bytes} is below kv_cache_bytes={budget_bytes}")
        per_slot = cls.slot_bytes(num_layers, num_kv_heads, head_dim, dtype)
        num_slots = budget_bytes // per_slot // page_size * page_size
        if num_slots < 1:
            raise ValueError(
                f"kv_cache_bytes={budget_bytes} holds no page: one page of {page_size} slot(s) needs "
                f"{per_slot * page_size} bytes"
            )
        max_slots = max(num_slots, max_bytes // per_slot // page_size * page_size)
        return cls(num_layers, num_slots, num_kv_heads, head_dim, dtype, device, max_slots=max_slots,
                   page_size=page_size, backing=backing)

    @property
    def num_slots(self) -> int:
        """Current capacity: slots ``[0, num_slots)`` are backed and may be used."""
        return self._pool.capacity

    @property
    def max_slots(self) -> int:
        """The reservation: the most slots ``resize`` can reach."""
        return self._pool.layout.max_slots

    @property
    def slot_granularity(self) -> int:
        """Capacities other than ``max_slots`` must be multiples of this: whole scheduler pages
        whose bytes are also whole backing pages in every buffer, so a shrink releases all of them."""
        return math.lcm(self._page_size, self._pool.layout.slot_granularity)

    @property
    def committed_bytes(self) -> int:
        """Bytes of memory the buffers hold now: the committed pages, or on a fixed (not elastic)
        backing the whole allocation, which no shrink gives back."""
        return held_bytes(self._pool, self.backing)

    @property
    def bytes_per_slot(self) -> int:
        return self.slot_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def resize(self, num_slots: int) -> ResizeResult:
        """Back exactly slots ``[0, num_slots)``; live slots below it keep their data bit for bit.

        Shrink precondition (the scheduler's, not checkable here): no request or cache entry
        refers to a slot at or above ``num_slots``; those slots' data is gone. Raises
        ``ValueError``, changing nothing, for a capacity outside ``[0, max_slots]`` or not a
        multiple of ``slot_granularity`` (``max_slots`` itself is always allowed).
        """
        check_kv_capacity(num_slots, self.max_slots, self.slot_granularity)
        return self._pool.resize(num_slots)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` buffers of full-attention layer ``i``."""
        return self.k[i], self.v[i]


def check_kv_capacity(num_slots: int, max_slots: int, granularity: int) -> None:
    """``ValueError`` unless ``num_slots`` is a capacity a KV pool can be resized to."""
    if not 0 <= num_slots <= max_slots:
        raise ValueError(f"KV capacity {num_slots} outside [0, {max_slots}] (max_slots)")
    if num_slots % granularity and num_slots != max_slots:
        raise ValueError(f"KV capacity {num_slots} is not a multiple of the slot granularity {granularity} "
                         f"(nor max_slots {max_slots})")


class ReqToTokenTable:
    """``[num_rows, max_context]`` int64 table mapping (row, position) → slot.

    Rows are handed out by the scheduler; the worker writes the slots it is told into them and
    clears a row when the scheduler releases it. Stale entries are harmless (a row is only read
    up to the sequence length of the step that wrote it) but clearing keeps dumps readable.
    """

    __slots__ = ("host", "max_context", "num_rows", "table")

    def __init__(self, num_rows: int, max_context: int, device: torch.device | str = "cpu") -> None:
        if num_rows < 1:
            raise ValueError(f"ReqToTokenTable.num_rows must be >= 1, got {num_rows}")
        if max_context < 1:
            raise ValueError(f"ReqToTokenTable.max_context must be >= 1, got {max_context}")
        self.num_rows = num_rows
        self.max_context = max_context
        self.table = torch.zeros((num_rows, max_context), dtype=torch.int64, device=torch.device(device))
        # A host copy for the planning that runs on the CPU (prefix groups): the table itself on the
        # CPU, a mirror written alongside it when the table lives on an accelerator.
        self.host = self.table if self.table.device.type == "cpu" else torch.zeros_like(self.table, device="cpu")

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """``table[row, start : start + len(slots)] := slots`` (bounds checked)."""
        n = int(slots.numel())
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} out of range [0, {self.num_rows})")
        if start < 0 or start + n > self.max_context:
            raise IndexError(f"positions [{start}, {start + n}) exceed max_context {self.max_context}")
        self.table[row, start : start + n] = slots
        if self.host is not self.table:
            self.host[row, start : start + n] = slots.cpu()

    def write_runs(self, runs: list[tuple[int, int, list[int]]]) -> None:
        """Every ``(row, start, slots)`` of one step in a single indexed store (bounds checked):
        one tensor built from lists instead of one per run, which a batch of 64 decodes felt."""
        rows: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        for row, start, slots in runs:
            if not 0 <= row < self.num_rows:
                raise IndexError(f"row {row} out of range [0, {self.num_rows})")
            if start < 0 or start + len(slots) > self.max_context:
                raise IndexError(f"positions [{start}, {start + len(slots)}) exceed max_context {self.max_context}")
            rows.extend([row] * len(slots))
            cols.extend(range(start, start + len(slots)))
            values.extend(slots)
        if not values:
            return
        idx = int64_tensor(rows + cols + values).view(3, -1)
        self.table[idx[0].to(self.table.device), idx[1].to(self.table.device)] = idx[2].to(self.table.device)
        if self.host is not self.table:
            self.host[idx[0], idx[1]] = idx[2]

    def release(self, row: int) -> None:
        """Forget ``row``'s mapping (the slots themselves belong to the scheduler)."""
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} out of range [0, {self.num_rows})")
        self.table[row].zero_()
        if self.host is not self.table:
            self.host[row].zero_()
