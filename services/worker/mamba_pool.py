"""The Mamba state pool: one recurrent state per *Mamba slot*, for every linear-attention layer.

A Mamba slot holds what a hybrid model (Qwen3-Next) carries from one token to the next in its
linear-attention layers: the short-convolution window (``conv``) and the gated-delta-rule matrix
(``ssm``, the "temporal" state). Unlike KV, this state is overwritten in place at every step, so
a cached state may never be handed to a running request directly: the scheduler sends
``MambaCopy(src, dst)`` first (copy-on-write when a request starts from a cached state, fork when
a request checkpoints into the tree) and the request then mutates only ``dst``.

Layout (per linear-attention layer ``i``)::

    conv[i]  [num_slots, *spec.conv_shape]   dtype spec.conv_dtype   (conv_dim, kernel - 1)
    ssm[i]   [num_slots, *spec.ssm_shape]    dtype spec.ssm_dtype    (v_heads, k_dim, v_dim), fp32

Slot indices are plain row indices into every tensor; the pool does no allocation bookkeeping
(the scheduler's allocator owns which slots are free).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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

    Every slot starts zeroed (the empty state of a fresh request). ``copy`` and ``reset`` are
    the only mutations the pool itself performs; model forwards write the slots of the
    requests in their batch.
    """

    __slots__ = ("_num_slots", "conv", "device", "spec", "ssm")

    def __init__(self, num_slots: int, spec: MambaSpec, device: torch.device | str = "cpu") -> None:
        if num_slots < 1:
            raise ValueError(f"MambaPool needs at least one slot, got num_slots={num_slots}")
        self.spec = spec
        self.device = torch.device(device)
        self._num_slots = num_slots
        self.conv: list[torch.Tensor] = [
            torch.zeros((num_slots, *spec.conv_shape), dtype=spec.conv_dtype, device=self.device)
            for _ in range(spec.num_layers)
        ]
        self.ssm: list[torch.Tensor] = [
            torch.zeros((num_slots, *spec.ssm_shape), dtype=spec.ssm_dtype, device=self.device)
            for _ in range(spec.num_layers)
        ]

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.bytes_per_slot

    def _check(self, slot: int, what: str) -> None:
        if not 0 <= slot < self._num_slots:
            raise IndexError(f"Mamba {what} slot {slot} out of range [0, {self._num_slots})")

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

    def reset(self, slot: int) -> None:
        """Zero ``slot`` in every layer (the state before any token)."""
        self._check(slot, "reset")
        for t in (*self.conv, *self.ssm):
            t[slot].zero_()
