"""Speculative decoding with Qwen3-Next's MTP head (``models/qwen3_next_mtp.py``).

The head's entry at position ``p`` reads the token at ``p + 1`` and the target's hidden state at
``p`` and predicts the token at ``p + 2``. Its one attention layer keeps KV in a ``DraftPool`` at
the target's slot indices (slot of position ``p`` holds the head's KV of its entry at ``p``), so
prefix reuse and the scheduler's accounting serve it unchanged, as for a draft model.

An entry at ``p`` needs the token at ``p + 1``, which for a row's last position is not known in
the step that computes its hidden state (it is sampled there, or it opens the next prefill
chunk). So each row keeps one *pending* hidden state, that of its last position, and the entries
lag by one position::

    step over positions s .. e-1 (target hidden h_s .. h_{e-1}):
      propose (before the target, drafting rows):  entry s-1 = (x_s, pending h_{s-1}) -> draft 1,
                                                   entry s-1+j = (draft j, own output) -> draft j+1
      finish  (after sampling and rollback):       entry s-1 = (x_s, pending) if propose did not
                                                   write it; entries s .. v-2 = (x_{p+1}, h_p) over
                                                   the v positions the row kept; pending := h_{v-1}

So after every step the head's KV covers each kept position but the last one, from the target's
own hidden states (drafted entries are rewritten with them once verified). A row's pending state
is dropped by ``ReleaseRow``; a row that starts on a cached prefix has none, and the entry at
``start_pos - 1`` is whatever wrote that slot (another request with the same prefix: its token
after the prefix may differ). Stale or missing entries, like pages reloaded from the host or L3
(which hold the target's KV only), lower acceptance and never correctness: the target verifies
every draft (``Engine._sample``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from services.common.step import ReqInput
from services.worker.batch import BatchInput, ForwardBatch, int64_tensor
from services.worker.draft import DraftPool
from services.worker.engine_config import AttentionPath
from services.worker.models.qwen3_next_mtp import load_mtp
from services.worker.pools import KVPool, ReqToTokenTable


@dataclass(slots=True)
class _Entries:
    """Head entries of one forward, one list per field in request order (as ``BatchInput``), and
    their hidden states ``[T, H]`` in the same flat order."""

    rows: list[int]
    start: list[int]
    ids: list[list[int]]
    slots: list[list[int]]
    hidden: torch.Tensor


class MtpDrafter:
    """Drafts with the target checkpoint's MTP head (see the module docstring); a ``Drafter``."""

    wants_hidden = True

    def __init__(
        self, model_dir: Path, target: torch.nn.Module, dtype: torch.dtype, device: torch.device, target_kv: KVPool,
        req_to_token: ReqToTokenTable, attention: AttentionPath,
    ) -> None:
        self.head = load_mtp(model_dir, target, dtype, device)
        hidden_size = self.head.fc.out_features
        self.pool = DraftPool(self.head.num_kv_layers, self.head.num_kv_heads, self.head.head_dim, dtype, device,
                              target_kv, req_to_token, attention)  # fmt: skip
        self.req_to_token = req_to_token
        self.device = device
        # Each row's pending state: the position (``_pos``) and the target's hidden state there
        # (row ``row`` of ``_hidden``, written in place: no per-row tensor, no view of a step's).
        self._pos: dict[int, int] = {}
        self._hidden = torch.zeros((req_to_token.num_rows, hidden_size), dtype=dtype, device=device)

    def resize(self, num_slots: int) -> None:
        self.pool.resize(num_slots)

    def release(self, row: int) -> None:
        self._pos.pop(row, None)

    def propose(self, reqs: list[ReqInput], inp: BatchInput) -> None:
        """Write the drafts of the requests with ``worker_drafts``. One whose pending hidden state
        is not at ``start_pos - 1`` (none kept for its row) drafts its input token repeated: the
        verify rejects it unless it is right, and the step stays an ordinary decode in effect."""
        ready: list[int] = []
        for b, r in enumerate(reqs):
            if not r.worker_drafts:
                continue
            if self._pos.get(r.row) == r.start_pos - 1:
                del self._pos[r.row]  # its entry is written here
                ready.append(b)
            else:
                r.input_ids[1:] = [r.input_ids[0]] * r.num_draft
        if not ready:
            return
        host = self.req_to_token.host
        rows = [reqs[b].row for b in ready]
        entries = _Entries(
            rows, [reqs[b].start_pos - 1 for b in ready], [[inp.input_ids[b][0]] for b in ready],
            [[int(host[reqs[b].row, reqs[b].start_pos - 1])] for b in ready],
            self._hidden[int64_tensor(rows, self.device)],
        )  # fmt: skip
        tokens, g = self._forward(entries, want=1)
        live = list(range(len(ready)))  # indices into ready
        for j in range(1, max(reqs[b].num_draft for b in ready) + 1):
            for k, t in zip(live, tokens, strict=True):
                reqs[ready[k]].input_ids[j] = t
            keep = [n for n, k in enumerate(live) if reqs[ready[k]].num_draft > j]
            if not keep:
                break
            g = g[keep]
            live = [live[n] for n in keep]
            chain = [reqs[ready[k]] for k in live]
            entries = _Entries(
                [r.row for r in chain], [r.start_pos + j - 1 for r in chain], [[r.input_ids[j]] for r in chain],
                [[r.new_slots[j - 1]] for r in chain], g,
            )  # fmt: skip
            tokens, g = self._forward(entries, want=1)

    def finish(self, reqs: list[ReqInput], inp: BatchInput, kept: Counter[int], hidden: torch.Tensor | None) -> None:
        """Write the entries of every position the step kept but the last, from the target's
        ``hidden`` states; the last becomes the row's pending state."""
        assert hidden is not None  # wants_hidden
        rows: list[int] = []
        start: list[int] = []
        ids: list[list[int]] = []
        slots: list[list[int]] = []
        # Each entry's hidden state: a pending one (entry index, row) or one of the step's (entry
        # index, index in ``hidden``).
        lead_at: list[int] = []
        lead_rows: list[int] = []
        step_at: list[int] = []
        step_src: list[int] = []
        last: list[int] = []  # each request's last kept position, in hidden
        host = self.req_to_token.host
        cu = total = 0
        for b, r in enumerate(reqs):
            s, x, n = inp.start_pos[b], inp.input_ids[b], len(inp.input_ids[b])
            # A verify keeps its input and accepted drafts; without sampling (forward_logits) all.
            valid = kept.get(r.row, n) if r.num_draft else n
            lead = self._pos.get(r.row) == s - 1  # entry s-1 not yet written
            if valid - 1 + lead:
                rows.append(r.row)
                start.append(s - 1 if lead else s)
                ids.append(x[1 - lead : valid])
                slots.append(([int(host[r.row, s - 1])] if lead else []) + inp.out_slots[b][: valid - 1])
                if lead:
                    lead_at.append(total)
                    lead_rows.append(r.row)
                step_at += range(total + lead, total + lead + valid - 1)
                step_src += range(cu, cu + valid - 1)
                total += valid - 1 + lead
            self._pos[r.row] = s + valid - 1
            last.append(cu + valid - 1)
            cu += n
        h = hidden.new_empty((total, hidden.shape[1]))
        if lead_at:  # read before the pending states are overwritten below
            h[int64_tensor(lead_at, self.device)] = self._hidden[int64_tensor(lead_rows, self.device)]
        if step_at:
            h[int64_tensor(step_at, self.device)] = hidden[int64_tensor(step_src, self.device)]
        self._hidden[int64_tensor([r.row for r in reqs], self.device)] = hidden[int64_tensor(last, self.device)]
        if rows:
            self._forward(_Entries(rows, start, ids, slots, h), want=0)

    def _forward(self, e: _Entries, want: int) -> tuple[list[int], torch.Tensor]:
        """Run the head over ``e``; the greedy token of each request's last entry (``want`` 1) and
        the head's output of those entries ``[R, H]`` (``want`` 0: K/V written, no rows)."""
        inp = BatchInput(e.rows, e.start, e.ids, e.slots, None, [want] * len(e.rows))
        batch = ForwardBatch.build(inp, self.device, self.pool.attn)
        g = self.head(batch, self.pool.ctx, e.hidden)
        if not want:
            return [], g
        tokens = self.head.logits(g).argmax(dim=-1)  # g's rows are the logit rows (ForwardBatch.keep)
        return cast(list[int], tokens.tolist()), g
