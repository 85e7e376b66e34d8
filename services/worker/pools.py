"""Device memory the worker owns for attention: the KV pool and the ``req_to_token`` table.

The scheduler decides which slot holds which token's KV and which row a request uses; the worker
only stores bytes at the indices it is told. Neither structure does any allocation bookkeeping.

KV pool layout (one pair per full-attention layer ``i``, numbered in model order)::

    k[i], v[i]   [num_slots, num_kv_heads, head_dim]   model dtype

``req_to_token[row, p]`` is the slot of position ``p`` of the request that owns ``row``.
"""

from __future__ import annotations

import torch


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVPool:
    """Per-layer K and V buffers indexed by slot (one slot = one token's KV in every layer)."""

    __slots__ = ("device", "dtype", "head_dim", "k", "num_kv_heads", "num_layers", "num_slots", "v")

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_slots", num_slots),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"KVPool.{name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        # Zero-filled so a slot read before it is written yields finite values, not garbage.
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device)
            for _ in range(num_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device)
            for _ in range(num_layers)
        ]

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
    ) -> KVPool:
        """The largest pool whose buffers fit in ``budget_bytes``, rounded down to whole pages.

        Raises ``ValueError`` when the budget does not hold a single page.
        """
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        per_slot = cls.slot_bytes(num_layers, num_kv_heads, head_dim, dtype)
        num_slots = budget_bytes // per_slot // page_size * page_size
        if num_slots < 1:
            raise ValueError(
                f"kv_cache_bytes={budget_bytes} holds no page: one page of {page_size} slot(s) needs "
                f"{per_slot * page_size} bytes"
            )
        return cls(num_layers, num_slots, num_kv_heads, head_dim, dtype, device)

    @property
    def bytes_per_slot(self) -> int:
        return self.slot_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` buffers of full-attention layer ``i``."""
        return self.k[i], self.v[i]


class ReqToTokenTable:
    """``[num_rows, max_context]`` int64 table mapping (row, position) → slot.

    Rows are handed out by the scheduler; the worker writes the slots it is told into them and
    clears a row when the scheduler releases it. Stale entries are harmless (a row is only read
    up to the sequence length of the step that wrote it) but clearing keeps dumps readable.
    """

    __slots__ = ("max_context", "num_rows", "table")

    def __init__(self, num_rows: int, max_context: int, device: torch.device | str = "cpu") -> None:
        if num_rows < 1:
            raise ValueError(f"ReqToTokenTable.num_rows must be >= 1, got {num_rows}")
        if max_context < 1:
            raise ValueError(f"ReqToTokenTable.max_context must be >= 1, got {max_context}")
        self.num_rows = num_rows
        self.max_context = max_context
        self.table = torch.zeros((num_rows, max_context), dtype=torch.int64, device=torch.device(device))

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """``table[row, start : start + len(slots)] := slots`` (bounds checked)."""
        n = int(slots.numel())
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} out of range [0, {self.num_rows})")
        if start < 0 or start + n > self.max_context:
            raise IndexError(f"positions [{start}, {start + n}) exceed max_context {self.max_context}")
        self.table[row, start : start + n] = slots

    def release(self, row: int) -> None:
        """Forget ``row``'s mapping (the slots themselves belong to the scheduler)."""
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} out of range [0, {self.num_rows})")
        self.table[row].zero_()
