"""Speculative decoding with a draft model: a smaller checkpoint with the target's tokenizer.

``Drafter`` is what the engine asks of any worker-side drafter (this draft model, Qwen3-Next's
MTP head in ``mtp.py``), and ``DraftPool`` the KV pool at the target's slot indices they share.

The draft model's KV lives in its own pool at the target's slot indices: slot ``s`` of the draft
pool holds the draft's KV of the token whose target KV is in slot ``s``. So the target's
``req_to_token`` rows, the radix tree's prefix reuse and the scheduler's slot accounting serve the
draft unchanged, and the scheduler only sends ``num_draft`` placeholders with ``worker_drafts``.
Every step mirrors its inputs through the draft model (prefill chunks and decodes), keeping its KV
in step with the target's. A slot whose draft KV is stale — a page that came back from the host
or L3, which hold the target's KV only — lowers acceptance, never correctness: the target
verifies every draft exactly (``Engine._sample``).

Per step, for the requests that draft: the mirror pass ends at their input token, whose greedy
next token is the first draft; each further draft is one more draft forward over the previous
one. A request whose drafts are all kept gets one more draft forward over its last draft (its KV
only) after the verify, so the draft pool covers every kept position.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Protocol, cast

import torch

from services.common.step import ReqInput
from services.worker.attention import attention_backend
from services.worker.batch import BatchInput, ForwardBatch, ForwardContext
from services.worker.engine_config import AttentionPath
from services.worker.loader import load_model
from services.worker.models.registry import CausalLM
from services.worker.pools import KVPool, ReqToTokenTable


class Drafter(Protocol):
    """What the engine asks of a worker-side drafter (a draft model, Qwen3-Next's MTP head).

    Per step, ``propose`` runs after the step's slots are in ``req_to_token`` and before the
    target's forward: it writes the drafts of the requests with ``worker_drafts`` into their
    ``input_ids`` (after the first id). ``finish`` runs after sampling and any state rollback,
    with ``kept[row]`` the tokens each verifying row kept and ``hidden`` the target's hidden
    states of the step's tokens (flat, in ``inp`` order) when ``wants_hidden``. ``release`` forgets
    a row (``ReleaseRow``); ``resize`` follows the target KV pool's capacity (``PoolResize``).
    """

    wants_hidden: bool
    pool: DraftPool

    def resize(self, num_slots: int) -> None: ...

    def propose(self, reqs: list[ReqInput], inp: BatchInput) -> None: ...

    def finish(self, reqs: list[ReqInput], inp: BatchInput, kept: Counter[int], hidden: torch.Tensor | None) -> None:
        ...

    def release(self, row: int) -> None: ...


class DraftPool:
    """A drafter's own KV pool at the target pool's slot indices (slot ``s`` holds the drafter's
    KV of the token whose target KV is in slot ``s``), with an attention backend over it and the
    target's ``req_to_token``. It follows the target pool's capacity, so the scheduler's slot
    accounting covers it unchanged."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
        target_kv: KVPool, req_to_token: ReqToTokenTable, attention: AttentionPath,
    ) -> None:
        self.kv = KVPool(
            num_layers, target_kv.num_slots, num_kv_heads, head_dim, dtype, device,
            max_slots=target_kv.max_slots, backing=target_kv.backing,
        )  # fmt: skip
        self.attn = attention_backend(attention, self.kv, req_to_token)
        self.ctx = ForwardContext(self.attn, None)

    def resize(self, num_slots: int) -> None:
        self.kv.resize(num_slots)


class DraftModel:
    """The draft checkpoint, its KV pool (the target pool's slots) and its attention backend."""

    wants_hidden = False

    def __init__(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, vocab_size: int, target_kv: KVPool,
        req_to_token: ReqToTokenTable, attention: AttentionPath,
    ) -> None:
        loaded = load_model(model_dir, dtype=dtype, device=str(device))
        model = cast(CausalLM, loaded.model)
        if getattr(model, "mamba_spec", None) is not None:
            raise ValueError(f"speculative_draft_model {model_dir}: a hybrid draft model is not supported")
        if model.vocab_size != vocab_size:
            raise ValueError(
                f"speculative_draft_model {model_dir}: vocabulary of {model.vocab_size} tokens, the target's "
                f"is {vocab_size} (a draft model needs the target's tokenizer)"
            )
        self.name = model_dir.resolve().name
        self.model = model
        self.device = device
        self.pool = DraftPool(model.num_kv_layers, model.num_kv_heads, model.head_dim, dtype, device, target_kv,
                              req_to_token, attention)  # fmt: skip

    def resize(self, num_slots: int) -> None:
        """Follow the target pool's capacity (``PoolResize``)."""
        self.pool.resize(num_slots)

    def release(self, row: int) -> None:
        """Nothing per row: the draft KV lives in the slots the scheduler owns."""

    def propose(self, reqs: list[ReqInput], inp: BatchInput) -> None:
        """Mirror the step's inputs ``inp`` through the draft model and write the drafts of the
        requests with ``worker_drafts`` into their ``input_ids`` (after the first id)."""
        drafting = [i for i, r in enumerate(reqs) if r.worker_drafts]
        if not drafting:  # the draft KV alone: no logits, so its last layer stops at K and V
            self._forward(BatchInput(inp.rows, inp.start_pos, inp.input_ids, inp.out_slots, None, [0] * len(reqs)))
            return
        first = set(drafting)
        # The mirror: drafting requests contribute their input token only, with its logits.
        mirror = BatchInput(
            inp.rows, inp.start_pos,
            [ids[:1] if i in first else ids for i, ids in enumerate(inp.input_ids)],
            [slots[:1] if i in first else slots for i, slots in enumerate(inp.out_slots)],
            None, [1 if i in first else 0 for i in range(len(reqs))],
        )  # fmt: skip
        tokens = self._forward(mirror)
        live = drafting
        for j in range(1, max(reqs[i].num_draft for i in drafting) + 1):
            for i, t in zip(live, tokens, strict=True):
                reqs[i].input_ids[j] = t
            live = [i for i in live if reqs[i].num_draft > j]
            if not live:
                break
            tokens = self._forward(self._single(reqs, live, j, want=1))

    def finish(self, reqs: list[ReqInput], inp: BatchInput, kept: Counter[int], hidden: torch.Tensor | None) -> None:
        """After the verify: the requests whose drafts were all kept (``kept[row]`` tokens) get
        their last draft's KV written."""
        full = [i for i, r in enumerate(reqs) if r.worker_drafts and kept.get(r.row, 0) == r.num_draft + 1]
        if full:
            self._forward(self._single(reqs, full, None, want=0))

    @staticmethod
    def _single(reqs: list[ReqInput], which: list[int], j: int | None, want: int) -> BatchInput:
        """One token per request ``which``: input ``j`` (None: the last draft) at its position."""
        at = [reqs[i].num_draft if j is None else j for i in which]
        return BatchInput(
            [reqs[i].row for i in which], [reqs[i].start_pos + k for i, k in zip(which, at, strict=True)],
            [[reqs[i].input_ids[k]] for i, k in zip(which, at, strict=True)],
            [[reqs[i].new_slots[k]] for i, k in zip(which, at, strict=True)],
            None, [want] * len(which),
        )  # fmt: skip

    def _forward(self, inp: BatchInput) -> list[int]:
        """Run the draft model on ``inp``; the greedy token after each request with logits."""
        batch = ForwardBatch.build(inp, self.device, self.pool.attn)
        logits = self.model.forward(batch, self.pool.ctx)
        return cast(list[int], logits.argmax(dim=-1).tolist()) if logits.shape[0] else []
