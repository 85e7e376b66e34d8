"""What a model forward sees: the flattened batch (``ForwardBatch``) and the pools (``ForwardContext``).

The engine builds one ``ForwardBatch`` per step from the step's ``ReqInput``s (gathered into a
``BatchInput``) after validating them, with its attention backend's plan for the batch, and hands
it with a ``ForwardContext`` to ``model.forward(batch, ctx)``. Every model (Qwen3, Qwen3-Next, ...)
reads only these two objects, so they are the stable interface between the engine and the model
code; attention goes through ``ctx.attn`` (``services.worker.attention``), never a path of its own.

Layout of one batch of B requests with T new tokens in total (request order = step order)::

    tokens     |<- req 0: extend_lens[0] ->|<- req 1 ->| ... |<- req B-1 ->|
    cu_seqlens  0                           e0          e0+e1 ...            T
    positions   start_pos[0] ... start_pos[0]+e0-1 | start_pos[1] ... | ...

Token ``j`` of request ``b`` sits at position ``start_pos[b] + j``; its KV goes to slot
``out_slots[cu_seqlens[b] + j]`` and it attends causally to ``req_to_token[rows[b], 0 : start_pos[b]
+ j + 1]`` (the engine writes ``out_slots`` into that row before the forward, so the row covers the
cached prefix and the new tokens alike). A decode is simply a request with ``extend_len == 1``.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.worker.attention import AttentionBackend, AttentionMeta
    from services.worker.mamba_pool import MambaPool


def int64_tensor(values: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64, device=device)``, several times faster on long
    lists (through an ``array`` buffer rather than torch's element-by-element list parsing): a step
    of hundreds of requests builds a dozen such index tensors."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(array("q", values), dtype=torch.int64).to(device)


@dataclass(frozen=True, slots=True)
class BatchInput:
    """The requests of one forward as the engine resolved them (token ids known), one list per
    field in request order: the batch is flattened with list operations, not per request."""

    rows: list[int]
    start_pos: list[int]
    input_ids: list[list[int]]  # at least one id per request
    out_slots: list[list[int]]  # one slot per input id
    mamba_slots: list[int] | None  # None: the model has no Mamba state
    # Logits for the last ``want_logits[b]`` new tokens of request b: 0 or 1 (True), or
    # 1 + num_draft for a request verifying draft tokens.
    want_logits: list[int]


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """The flattened inputs of one forward. All tensors live on the model's device.

    Per token ``[T]``: ``input_ids``, ``positions``, ``out_slots`` (int64).
    Per request ``[B]``: ``rows``, ``start_pos``, ``extend_lens``, ``seq_lens`` (= start_pos +
    extend_lens), ``mamba_slots`` (int64; ``None`` for a model without Mamba state).
    ``cu_seqlens`` ``[B + 1]``: token offsets of each request in the flat token axis.
    ``logit_index`` ``[N]``: flat token indices whose logits the model returns, in order.
    ``attn``: what the attention backend planned for this batch (``AttentionBackend.prepare``).

    Python copies of the per-request lengths (``*_list``) are kept so that host-side loops (the
    torch references, chunk splitting in linear attention) need no device synchronisation.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    rows: torch.Tensor
    start_pos: torch.Tensor
    extend_lens: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    logit_index: torch.Tensor
    mamba_slots: torch.Tensor | None
    start_pos_list: list[int]
    extend_lens_list: list[int]
    attn: AttentionMeta
    # Rows past the real batch (a graphed decode's bucket) write KV slot -1: dropped on store.
    padded: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_list)

    @property
    def keep(self) -> torch.Tensor | None:
        """``logit_index`` where it names fewer than every token (the rows a model's last layer runs
        past its K/V, ``keep``), else ``None``: every row goes on, and ``logit_index`` is every
        token in order, so a model's last rows are its logit rows either way."""
        return self.logit_index if len(self.logit_index) < self.num_tokens else None

    @property
    def is_decode(self) -> bool:
        """True when every request contributes exactly one token (a pure decode batch)."""
        return all(n == 1 for n in self.extend_lens_list)

    @classmethod
    def build(
        cls,
        inp: BatchInput,
        device: torch.device,
        attn: AttentionBackend,
        all_logits: bool = False,
        meta: AttentionMeta | None = None,
    ) -> ForwardBatch:
        """Flatten ``inp`` (at least one request, each with >= 1 token, validated by the caller) and
        plan its attention with ``attn`` (``req_to_token`` must already hold this step's slots), or
        take ``meta``, the plan ``attn.prepare`` already made for it.

        ``all_logits`` asks for the logits of every new token (exactness tests); otherwise the last
        ``want_logits[b]`` tokens of request b get logits.
        """
        rows, start = inp.rows, inp.start_pos
        if not rows:
            raise ValueError("ForwardBatch.build needs at least one request")
        lens = [len(ids) for ids in inp.input_ids]
        if 0 in lens or [len(s) for s in inp.out_slots] != lens:
            b = next(b for b, n in enumerate(lens) if n == 0 or len(inp.out_slots[b]) != n)
            raise ValueError(
                f"request for row {rows[b]}: {lens[b]} input ids and {len(inp.out_slots[b])} out slots "
                "(need equal counts, at least one)"
            )
        if inp.mamba_slots is not None and len(inp.mamba_slots) != len(rows):
            raise ValueError("either every request of a batch has a mamba_slot or none has")
        cu = [0, *accumulate(lens)]
        positions = [p for s, n in zip(start, lens, strict=True) for p in range(s, s + n)]
        want = inp.want_logits
        if all_logits:
            logit_index = list(range(cu[-1]))
        elif max(want) <= 1:
            logit_index = [e - 1 for e, w in zip(cu[1:], want, strict=True) if w]
        else:
            logit_index = [i for e, w in zip(cu[1:], want, strict=True) for i in range(e - w, e)]
        # The models' last layer asks attention for the logit rows alone when they are fewer (``keep``).
        logit_rows = None if len(logit_index) == cu[-1] else [int(w) for w in want]

        def t(values: list[int]) -> torch.Tensor:
            return int64_tensor(values, device)

        return cls(
            input_ids=t(list(chain.from_iterable(inp.input_ids))),
            positions=t(positions),
            out_slots=t(list(chain.from_iterable(inp.out_slots))),
            rows=t(rows),
            start_pos=t(start),
            extend_lens=t(lens),
            seq_lens=t([s + n for s, n in zip(start, lens, strict=True)]),
            cu_seqlens=t(cu),
            logit_index=t(logit_index),
            mamba_slots=None if inp.mamba_slots is None else t(inp.mamba_slots),
            start_pos_list=start,
            extend_lens_list=lens,
            attn=attn.prepare(rows, start, lens, logit_rows) if meta is None else meta,
        )


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """The device state a forward reads and writes.

    ``attn``: the engine's attention backend, which owns the KV pool and the slot table; a model
    numbers its full-attention layers 0, 1, ... in order and calls
    ``attn.forward(q, k, v, layer, batch, scale)`` with that number as the pool layer index.
    ``mamba``: the Mamba state pool for hybrid models (``None`` for dense models); linear-
    attention layers read and update ``mamba.conv[i][slot]`` / ``mamba.ssm[i][slot]`` in place
    for ``slot`` in ``batch.mamba_slots``.
    """

    attn: AttentionBackend
    mamba: MambaPool | None = None
