"""The Mamba state pool: one recurrent state per *Mamba slot*, for every linear-attention layer.

A Mamba slot holds what a hybrid model (Qwen3-Next) carries from one token to the next in its
linear-attention layers: the short-convolution window (``conv``) and the gated-delta-rule matrix
(``ssm``, the "temporal" state). Unlike KV, this state is overwritten in place at every step, so
a cached state may never be handed to a running request directly: the scheduler sends
``MambaCopy(src, dst)`` first (copy-on-write when a request starts from a cached state, fork when
a request checkpoints into the tree) and the request then mutates only ``dst``.

Layout (per linear-attention layer ``i``)::

    conv[i]  [max_slots, *spec.conv_shape]   dtype spec.conv_dtype   (conv_dim, kernel - 1)
    ssm[i]   [max_slots, *spec.ssm_shape]    dtype spec.ssm_dtype    (v_heads, k_dim, v_dim), fp32

Every tensor is a contiguous field-major view of one ``ElasticPool``: slots ``[0, num_slots)``
are backed, the rest of the ``max_slots`` reservation holds no memory until ``resize`` grows
the pool. Tensors never move. Slot indices are plain row indices into every tensor; the pool
does no allocation bookkeeping (the scheduler's allocator owns which slots are free).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.elastic import ElasticPool, ElasticPoolLayout, FieldSpec, Grouping, ResizeResult
from services.worker.pool_backing import BackingChoice, choose_backing, held_bytes

if TYPE_CHECKING:
    from services.worker.models.linear_attn import StateTrace


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """Shape of one Mamba slot, as a model declares it (``model.mamba_spec``).

    ``num_layers`` counts linear-attention layers only; the model maps its layer index to a
    pool layer index. The recurrent state is kept in fp32 whatever the model dtype, because it
    accumulates over the whole sequence and low precision there drifts visibly.
    """

    num_layers: int
    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    conv_dtype: torch.dtype = torch.float32
    ssm_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"MambaSpec.num_layers must be >= 1, got {self.num_layers}")
        for name, shape in (("conv_shape", self.conv_shape), ("ssm_shape", self.ssm_shape)):
            if not shape or any(d < 1 for d in shape):
                raise ValueError(f"MambaSpec.{name} must be non-empty and positive, got {shape}")

    def layout(self, max_slots: int, page_bytes: int, grouping: Grouping = "slot_major") -> ElasticPoolLayout:
        """The elastic pool's fields ``conv0, ssm0, conv1, ssm1, …``, one slot as ``MambaPool`` lays it out."""
        fields = tuple(f for i in range(self.num_layers) for f in (
            FieldSpec(f"conv{i}", self.conv_dtype, self.conv_shape),
            FieldSpec(f"ssm{i}", self.ssm_dtype, self.ssm_shape)))  # fmt: skip
        return ElasticPoolLayout(fields, max_slots, page_bytes, grouping)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot occupies over all layers (conv + ssm)."""
        conv = math.prod(self.conv_shape) * _itemsize(self.conv_dtype)
        ssm = math.prod(self.ssm_shape) * _itemsize(self.ssm_dtype)
        return self.num_layers * (conv + ssm)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class MambaPool:
    """Per-layer conv and recurrent state tensors indexed by Mamba slot.

    Every slot starts zeroed (the empty state of a fresh request). ``copy``, ``reset`` and
    ``resize`` are the only mutations the pool itself performs; model forwards write the slots
    of the requests in their batch.
    """

    __slots__ = ("_pool", "backing", "conv", "device", "spec", "ssm", "tracing")

    def __init__(self, num_slots: int, spec: MambaSpec, device: torch.device | str = "cpu", *,
                 max_slots: int | None = None, backing: BackingChoice | None = None) -> None:
        """``max_slots`` (default ``num_slots``) is the reservation ``resize`` may grow into."""
        if num_slots < 1:
            raise ValueError(f"MambaPool needs at least one slot, got num_slots={num_slots}")
        max_slots = num_slots if max_slots is None else max_slots
        if max_slots < num_slots:
            raise ValueError(f"MambaPool.max_slots ({max_slots}) must be >= num_slots ({num_slots})")
        self.spec = spec
        self.device = torch.device(device)
        # Set by the engine around a verify pass: the slots whose per-token states it records.
        self.tracing: StateTrace | None = None
        self.backing = backing or choose_backing(self.device)
        layout = spec.layout(max_slots, self.backing.page_bytes, grouping="field_major")
        self._pool = ElasticPool(layout, num_slots, backing=self.backing.make)
        self.conv: list[torch.Tensor] = [self._pool.view(f"conv{i}") for i in range(spec.num_layers)]
        self.ssm: list[torch.Tensor] = [self._pool.view(f"ssm{i}") for i in range(spec.num_layers)]

    @property
    def num_slots(self) -> int:
        """Current capacity: slots ``[0, num_slots)`` are backed and may be used."""
        return self._pool.capacity

    @property
    def max_slots(self) -> int:
        return self._pool.layout.max_slots

    @property
    def slot_granularity(self) -> int:
        """Capacities that are multiples of this end on a page boundary in every tensor (any
        capacity is allowed; others keep the page holding their last slot)."""
        return self._pool.layout.slot_granularity

    @property
    def committed_bytes(self) -> int:
        """Bytes of memory the buffers hold now: the committed pages, or on a fixed (not elastic)
        backing the whole allocation, which no shrink gives back."""
        return held_bytes(self._pool, self.backing)

    def resize(self, num_slots: int) -> ResizeResult:
        """Back exactly slots ``[0, num_slots)``; live slots below it keep their state bit for bit.

        Shrink precondition (the scheduler's): no request or cached state uses a slot at or above
        ``num_slots``. Raises ``ValueError``, changing nothing, outside ``[0, max_slots]``.
        """
        if not 0 <= num_slots <= self.max_slots:
            raise ValueError(f"Mamba capacity {num_slots} outside [0, {self.max_slots}] (max_slots)")
        return self._pool.resize(num_slots)

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.bytes_per_slot

    def _check(self, slot: int, what: str) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"Mamba {what} slot {slot} out of range [0, {self.num_slots})")

    def copy(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into ``dst`` in every layer; ``src`` stays bit-for-bit unchanged.

        Used both for copy-on-write (a request starting from a cached state) and for fork (a
        request checkpointing its state into the cache). ``src == dst`` is refused because it
        always means the caller lost track of which slot the request owns.
        """
        self._check(src, "source")
        self._check(dst, "destination")
        if src == dst:
            raise ValueError(f"Mamba copy with src == dst == {src}: a request must own its own slot")
        for t in (*self.conv, *self.ssm):
            t[dst].copy_(t[src])

    def copy_many(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Batched ``copy``: ``dst[i] := src[i]``; destinations must be distinct and disjoint from sources."""
        if src.shape != dst.shape or src.dim() != 1:
            raise ValueError(
                f"copy_many wants two 1-D index tensors of equal length, got {src.shape}, {dst.shape}"
            )
        s, d = src.tolist(), dst.tolist()
        for i in (*s, *d):
            self._check(int(i), "copy")
        if len(set(d)) != len(d) or set(s) & set(d):
            raise ValueError("copy_many destinations must be distinct and never a source")
        src_i, dst_i = src.to(self.device, torch.long), dst.to(self.device, torch.long)
        for t in (*self.conv, *self.ssm):
            t.index_copy_(0, dst_i, t.index_select(0, src_i))

    def keep_traced(self, trace: StateTrace, slot: int, n: int) -> None:
        """Set ``slot``'s state in every layer to the one after the first ``n`` (>= 1) tokens of
        the forward ``trace`` recorded (speculative decoding: drafts after them were rejected)."""
        records = trace.records[slot]
        if not 1 <= n <= records[0][1].shape[0] or len(records) != len(self.ssm):
            raise ValueError(f"slot {slot}: cannot keep {n} tokens of a trace of {records[0][1].shape[0]} "
                             f"over {len(records)} of {len(self.ssm)} layers")  # fmt: skip
        for (window, states), conv, ssm in zip(records, self.conv, self.ssm, strict=True):
            conv[slot].copy_(window[:, n : n + conv.shape[-1]])
            ssm[slot].copy_(states[n - 1])

    def reset(self, slot: int) -> None:
        """Zero ``slot`` in every layer (the state before any token)."""
        self._check(slot, "reset")
        for t in (*self.conv, *self.ssm):
            t[slot].zero_()
