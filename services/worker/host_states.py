"""The host (L2) tier for Mamba states (hybrid models): whole recurrent states in CPU memory.

Layout (one block of host memory, raw bytes)::

    states  [num_states, bytes_per_state]   uint8
    state s = | conv0 | ssm0 | conv1 | ssm1 | … | conv{L-1} | ssm{L-1} |
              each field the C-order bytes of one device slot's tensor, in its own dtype

so a host state — every linear-attention layer's conv window and recurrent matrix for one
sequence position — is ONE contiguous run of ``bytes_per_state`` bytes, with no padding: it goes
to and comes from the kvstore (L3) as a single buffer, and its bytes are exactly what
``HostStatePool.layout`` names (the scheduler puts that name into the L3 keys of states, so a
state written under another layout never matches).

Fields mix dtypes (conv in the model dtype, ssm in fp32), so copies move bytes: each device field
is gathered as ``[n, *shape]``, reinterpreted as ``uint8`` and placed at its offset in a staging
block of whole states (built on the Mamba pool's device, so a GPU sends one transfer per call), and
the reverse for loads. Reinterpreting never converts, so round trips are bit-exact.

The Mamba pool (``MambaPool``) keeps a slot per running request and per cached state; this pool
keeps states evicted from it. The scheduler decides which slots and host states take part (the
worker keeps no bookkeeping). Index tensors are built per call from the given lists and die with
the call: nothing here keeps a view into a caller's list.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

if TYPE_CHECKING:
    from services.worker.mamba_pool import MambaPool, MambaSpec


class _Field(NamedTuple):
    """One tensor of one layer inside a host state."""

    offset: int  # bytes from the start of the state
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HostStatePool:
    """State-first Mamba states in host memory (see the module docstring for the layout).

    Unwritten states hold undefined bytes: a state is read only after ``backup`` or
    ``write_state`` filled it. ``pin_memory=True`` needs CUDA (page-locked memory makes
    device↔host copies DMA).
    """

    __slots__ = ("_fields", "num_states", "spec", "states")

    def __init__(self, num_states: int, spec: MambaSpec, pin_memory: bool = False) -> None:
        if num_states < 1:
            raise ValueError(f"HostStatePool.num_states must be >= 1, got {num_states}")
        self.num_states = num_states
        self.spec = spec
        fields, at = [], 0
        for _ in range(spec.num_layers):
            for dtype, shape in ((spec.conv_dtype, spec.conv_shape), (spec.ssm_dtype, spec.ssm_shape)):
                nbytes = math.prod(shape) * _itemsize(dtype)
                fields.append(_Field(at, nbytes, dtype, tuple(shape)))
                at += nbytes
        self._fields: tuple[_Field, ...] = tuple(fields)
        assert at == spec.bytes_per_slot  # no padding: a host state is exactly a device slot's bytes
        # empty, not zeros: a large host budget is then only committed as states are written.
        self.states = torch.empty((num_states, at), dtype=torch.uint8, pin_memory=pin_memory)

    @classmethod
    def from_budget(cls, budget_bytes: int, spec: MambaSpec, pin_memory: bool = False) -> HostStatePool:
        """The most states that fit in ``budget_bytes``; ValueError when not even one does."""
        per_state = spec.bytes_per_slot
        num_states = budget_bytes // per_state
        if num_states < 1:
            raise ValueError(
                f"a host state budget of {budget_bytes} bytes holds no Mamba state: one state needs "
                f"{per_state} bytes ({spec.num_layers} linear-attention layers of conv {spec.conv_shape} "
                f"{_dtype_name(spec.conv_dtype)} + ssm {spec.ssm_shape} {_dtype_name(spec.ssm_dtype)})"
            )
        return cls(num_states, spec, pin_memory)

    @property
    def bytes_per_state(self) -> int:
        return int(self.states.shape[1])

    @property
    def layout(self) -> str:
        """Names everything that decides a host state's bytes (field order, shapes, dtypes); the
        scheduler puts it into the L3 keys of states, so states written under another layout are
        never read back as this one."""
        s = self.spec

        def dims(shape: tuple[int, ...]) -> str:
            return "x".join(map(str, shape))

        return (
            f"state-first/L{s.num_layers}/conv{dims(s.conv_shape)}:{_dtype_name(s.conv_dtype)}"
            f"/ssm{dims(s.ssm_shape)}:{_dtype_name(s.ssm_dtype)}"
        )

    # --- device ↔ host --------------------------------------------------------------------------

    def backup(self, mamba: MambaPool, slots: Sequence[int], host_states: Sequence[int]) -> None:
        """Copy device Mamba slots into host states: ``slots[j]`` → ``host_states[j]``, every
        layer, conv and ssm. Synchronous: returns once the bytes are on the host. Raises
        ValueError/IndexError, copying nothing, for a mismatched pool or bad indices."""
        plan = self._plan(mamba, slots, host_states, unique="host_states")
        if plan is None:
            return
        on_cpu = mamba.device.type == "cpu"
        if on_cpu and plan.host_run is not None:
            staging = self.states[plan.host_run : plan.host_run + plan.n]  # a view: fill in place
        else:
            staging = torch.empty((plan.n, self.bytes_per_state), dtype=torch.uint8, device=mamba.device)
        for f, t in zip(self._fields, _tensors(mamba), strict=True):
            block = t.index_select(0, plan.dev_idx)  # [n, *shape], contiguous
            staging[:, f.offset : f.offset + f.nbytes] = block.view(torch.uint8).reshape(plan.n, f.nbytes)
        if on_cpu and plan.host_run is not None:
            return
        if plan.host_run is not None:
            self.states[plan.host_run : plan.host_run + plan.n].copy_(staging)  # one transfer
        else:
            self.states.index_copy_(0, plan.host_idx, staging.cpu())

    def load(self, host_states: Sequence[int], mamba: MambaPool, slots: Sequence[int]) -> None:
        """Copy host states into device Mamba slots: ``host_states[j]`` → ``slots[j]``, every
        layer, conv and ssm. Synchronous. Raises like ``backup``."""
        plan = self._plan(mamba, slots, host_states, unique="slots")
        if plan is None:
            return
        if plan.host_run is not None:
            host = self.states[plan.host_run : plan.host_run + plan.n]  # a view: no host-side copy
        else:
            host = self.states.index_select(0, plan.host_idx)
        staging = host.to(mamba.device)  # one transfer (none on a CPU)
        for f, t in zip(self._fields, _tensors(mamba), strict=True):
            raw = staging[:, f.offset : f.offset + f.nbytes].contiguous()
            t.index_copy_(0, plan.dev_idx, raw.view(f.dtype).reshape(plan.n, *f.shape))

    # --- host ↔ kvstore (L3) --------------------------------------------------------------------

    def state_bytes(self, host_state: int) -> memoryview:
        """A zero-copy, read-only byte view of one state (``bytes_per_state`` long), to send to L3.

        The view aliases the pool: it is only meaningful while the caller holds the state (a freed
        state may be overwritten by the next backup), so copy it or drop it once the put is sent.
        """
        return self._view(host_state).toreadonly()

    def write_state(self, host_state: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite one state with ``bytes_per_state`` bytes fetched from L3 (a single memcpy)."""
        view = self._view(host_state)
        size = memoryview(data).nbytes
        if size != view.nbytes:
            raise ValueError(f"state data is {size} bytes, a host state is {view.nbytes}")
        view[:] = memoryview(data).cast("B")

    # --- helpers --------------------------------------------------------------------------------

    def _view(self, host_state: int) -> memoryview:
        if not 0 <= host_state < self.num_states:
            raise IndexError(f"host state {host_state} out of range [0, {self.num_states})")
        flat: Any = self.states[host_state].numpy()  # a contiguous uint8 row; numpy is a Buffer
        return memoryview(flat)

    def _plan(
        self,
        mamba: MambaPool,
        slots: Sequence[int],
        host_states: Sequence[int],
        unique: Literal["host_states", "slots"],
    ) -> _Plan | None:
        """Validate a transfer and build its index tensors; None when there is nothing to move."""
        if mamba.spec != self.spec:
            raise ValueError(f"Mamba pool ({mamba.spec}) does not match the host state pool ({self.layout})")
        n = len(host_states)
        if len(slots) != n:
            raise ValueError(f"{n} host states need {n} Mamba slots, got {len(slots)}")
        if not n:
            return None
        if not 0 <= min(host_states) <= max(host_states) < self.num_states:
            raise IndexError(f"host states out of range [0, {self.num_states})")
        if not 0 <= min(slots) <= max(slots) < mamba.num_slots:
            raise IndexError(f"Mamba slots out of range [0, {mamba.num_slots})")
        # The destination of a copy must not repeat, or which source wins is undefined.
        dst = host_states if unique == "host_states" else slots
        if len(set(dst)) != len(dst):
            raise ValueError(f"{unique} repeat an index; each destination must be written once")
        first = host_states[0]
        return _Plan(
            n=n,
            host_idx=torch.tensor(host_states, dtype=torch.int64),
            dev_idx=torch.tensor(slots, dtype=torch.int64).to(mamba.device),
            host_run=first if list(host_states) == list(range(first, first + n)) else None,
        )


class _Plan(NamedTuple):
    """How one backup or load moves its ``n`` states (built and dropped within the call)."""

    n: int
    host_idx: torch.Tensor  # [n] host state ids (CPU)
    dev_idx: torch.Tensor  # [n] Mamba slots (on the pool's device)
    host_run: int | None  # first host state when host states are one ascending run


def _tensors(mamba: MambaPool) -> list[torch.Tensor]:
    """The pool's tensors in host-state field order: conv0, ssm0, conv1, ssm1, …"""
    return [t for pair in zip(mamba.conv, mamba.ssm, strict=True) for t in pair]
