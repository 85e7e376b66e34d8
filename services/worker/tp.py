"""Tensor parallelism: one model over ``size`` ranks joined in a torch.distributed process group.

Sharding (as the peers do it, one all-reduce per block):

* attention by heads: rank ``r`` computes query heads ``[r*Hq/n, (r+1)*Hq/n)`` and the KV heads
  they read; when there are fewer KV heads than ranks, a KV head is replicated on ``n / Hkv``
  ranks (rank ``r`` holds head ``r * Hkv // n``). ``o_proj`` is row-parallel, then all-reduced;
* MLP and every MoE expert: ``gate_proj`` / ``up_proj`` column-parallel, ``down_proj``
  row-parallel; one all-reduce per MLP / MoE block (experts and shared expert summed first);
* Qwen3-Next's gated DeltaNet by key-head groups (each with its value heads; with more ranks than
  key heads, a key head replicated and its value heads split), so the conv channels and the
  recurrent state of a rank are those of its heads;
* the embedding, the LM head, the norms and the MoE router are replicated: logits are whole on
  every rank, and only rank 0 samples (it sends the sampled ids to the others, which need them
  for the next decode's input).

A parameter learns its slice of the checkpoint tensor from ``shard_rows`` / ``shard_cols``: the
loader reads exactly that slice from the safetensors file (``Shard``), so no rank materialises the
whole model.

One process group carries the steps from rank 0 and the collectives inside them, every call
bounded by ``timeout_s``: a rank that dies or hangs makes the others fail within it
(``GroupBroken``), never hang. A gloo broadcast waits for its receivers, so an idle rank 0 sends a
heartbeat every third of the timeout (``send_heartbeat``): the followers' waits for the next step
stay bounded too, and a follower that stops answering is noticed while idle.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from kernels.linear import Linear, linear

HEARTBEAT = -1  # a message length meaning "no step: still here"
JOIN_MIN_S = 60.0  # the least time the ranks get to find each other at start


class GroupBroken(RuntimeError):
    """A collective failed (a peer is gone, or it timed out): the ranks are out of step for good."""


def _collective(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:  # gloo / NCCL errors (DistBackendError, timeouts) are RuntimeErrors
        raise GroupBroken(f"tensor-parallel collective {fn.__name__} failed: {e}") from e


@dataclass(frozen=True, slots=True)
class Shard:
    """The part of a checkpoint tensor a rank holds: ``pieces`` (start, stop) along ``dim``,
    concatenated in order (several pieces when a fused tensor's parts are sharded each)."""

    dim: int
    pieces: tuple[tuple[int, int], ...]

    def take(self, full_shape: tuple[int, ...], read: object) -> torch.Tensor:
        """The rank's slice from ``read`` (a safetensors slice or a tensor), indexed per piece."""
        parts = []
        for a, b in self.pieces:
            index = tuple(slice(a, b) if d == self.dim else slice(None) for d in range(len(full_shape)))
            parts.append(read[index])  # type: ignore[index]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    @property
    def length(self) -> int:
        return sum(b - a for a, b in self.pieces)


class Tp:
    """A rank's view of its tensor-parallel group. ``Tp.single()`` is the one-device case: every
    collective is a no-op and every shard is the whole tensor."""

    def __init__(self, rank: int, size: int, group: object = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tensor parallel: need 0 <= rank < size, got rank {rank} of {size}")
        self.rank, self.size = rank, size
        self._group = group
        self.last_sent = time.monotonic()  # rank 0: when it last sent the followers a message
        self.reduced_bytes = 0  # bytes all-reduced so far (per rank), for the benchmark
        self.reduce_s = 0.0  # time spent in those all-reduces (waiting for the slowest rank included)

    @classmethod
    def single(cls) -> Tp:
        return cls(0, 1)

    @classmethod
    def join(cls, init_method: str, rank: int, size: int, timeout_s: float, device: str = "cpu") -> Tp:
        """Join (or create, on rank 0) the process group at ``init_method`` (``tcp://host:port``);
        returns once all ``size`` ranks are in, or raises after ``max(timeout_s, JOIN_MIN_S)``: a
        rank's start (importing torch, on a loaded host) is not a hung collective, which
        ``timeout_s`` bounds from then on. Gloo carries CPU tensors (the steps, and the model's
        all-reduces on a CPU device); on a CUDA ``device`` the model's all-reduces go over NCCL."""
        url = urlsplit(init_method)
        if url.scheme != "tcp" or url.hostname is None or url.port is None:
            raise ValueError(f"tensor parallel: init_method must be tcp://host:port, got {init_method!r}")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(url.hostname, url.port, size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=max(timeout_s, JOIN_MIN_S)))  # fmt: skip
        store.set_timeout(timeout)
        backend = "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device).index or 0)
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        return cls(rank, size, dist.group.WORLD)

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    # -- sharding --------------------------------------------------------------------------------

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's ``(start, count)`` of ``n`` units split evenly; ``ValueError`` naming ``what``."""
        if n % self.size:
            raise ValueError(f"tensor parallel size {self.size} does not divide {what} ({n})")
        per = n // self.size
        return self.rank * per, per

    def kv_heads(self, num_kv_heads: int, num_heads: int) -> tuple[int, int]:
        """``(first, count)`` of the KV heads this rank's query heads read: split when there are at
        least as many KV heads as ranks, else one head replicated on ``size / num_kv_heads`` ranks."""
        self.split(num_heads, "num_attention_heads")
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"tensor parallel size {self.size} is not a multiple of num_key_value_heads ({num_kv_heads})"
            )
        return self.rank * num_kv_heads // self.size, 1

    # -- collectives -----------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it (a no-op on one rank)."""
        if self.size > 1:
            self.reduced_bytes += x.numel() * x.element_size()
            t0 = time.perf_counter()
            _collective(dist.all_reduce, x, group=self._group)
            self.reduce_s += time.perf_counter() - t0
        return x

    def agree_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum of ``values`` over the ranks (same length on every rank)."""
        if self.size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        _collective(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self._group)
        return [int(v) for v in t.tolist()]

    def share_ints(self, values: list[int] | None, n: int) -> list[int] | None:
        """Rank 0 sends ``values`` (``n`` ints, or None for "the step failed"); every rank gets them."""
        t = torch.zeros(n + 1, dtype=torch.int64)
        if self.rank == 0:
            if values is None:
                t[0] = 1
            else:
                t[1:] = torch.tensor(values, dtype=torch.int64)
        if self.size > 1:
            _collective(dist.broadcast, t, 0, group=self._group)
        return None if int(t[0]) else [int(v) for v in t[1:].tolist()]

    def send_bytes(self, data: bytes) -> None:
        """Rank 0: send one message (a serialized step; empty = stop) to the followers."""
        self._send_length(len(data))
        if data:
            _collective(dist.broadcast, torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self._group)

    def send_heartbeat(self) -> None:
        """Rank 0, idle: tell the followers it is alive (and learn that they are)."""
        self._send_length(HEARTBEAT)

    def _send_length(self, n: int) -> None:
        _collective(dist.broadcast, torch.tensor([n], dtype=torch.int64), 0, group=self._group)
        self.last_sent = time.monotonic()

    def recv_bytes(self) -> bytes | None:
        """A follower: wait for rank 0's next message (empty = stop, None = a heartbeat)."""
        n = torch.zeros(1, dtype=torch.int64)
        _collective(dist.broadcast, n, 0, group=self._group)
        if int(n) == HEARTBEAT:
            return None
        if not int(n):
            return b""
        buf = torch.empty(int(n), dtype=torch.uint8)
        _collective(dist.broadcast, buf, 0, group=self._group)
        return buf.numpy().tobytes()


SINGLE = Tp.single()


def shard_rows(param: torch.Tensor, *pieces: tuple[int, int]) -> torch.Tensor:
    """Mark ``param`` as holding rows ``pieces`` (start, stop) of the checkpoint tensor."""
    param.tp_shard = Shard(0, tuple(pieces))  # type: ignore[attr-defined]
    return param


def shard_cols(param: torch.Tensor, *pieces: tuple[int, int]) -> torch.Tensor:
    """Mark ``param`` as holding columns ``pieces`` of the checkpoint tensor."""
    param.tp_shard = Shard(1, tuple(pieces))  # type: ignore[attr-defined]
    return param


def column_linear(
    in_features: int, out_features: int, tp: Tp, bias: bool = False, pieces: tuple[tuple[int, int], ...] = ()
) -> Linear:
    """A ``Linear`` holding output rows ``pieces`` (default: this rank's even split of
    ``out_features``); its output is this rank's part, not reduced."""
    if not pieces:
        start, per = tp.split(out_features, "a column-parallel projection's outputs")
        pieces = ((start, start + per),)
    rows = sum(b - a for a, b in pieces)
    layer = Linear(in_features, rows, bias=bias)
    if tp.size > 1:
        shard_rows(layer.weight, *pieces)
        if layer.bias is not None:
            shard_rows(layer.bias, *pieces)
    return layer


class RowLinear(Linear):
    """A ``Linear`` holding input columns ``[r*in/n, (r+1)*in/n)``: ``forward`` returns this rank's
    partial sum (the bias is added by rank 0 only), for the caller to all-reduce once per block."""

    def __init__(self, in_features: int, out_features: int, tp: Tp, bias: bool = False) -> None:
        start, per = tp.split(in_features, "a row-parallel projection's inputs")
        super().__init__(per, out_features, bias=bias)
        self.tp_rank = tp.rank
        if tp.size > 1:
            shard_cols(self.weight, (start, start + per))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return linear(x, self.weight, bias)
