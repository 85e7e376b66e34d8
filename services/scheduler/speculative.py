"""Speculative decoding, the scheduler's half: which decodes carry draft tokens, and how many.

The scheduler drafts (it knows every request's tokens); the worker verifies: one forward over
the last token and the drafts, one sample after each (``ReqInput.num_draft``), kept up to the
first sample that differs from the next draft. Because each of those samples is the token an
ordinary decode would draw at that output index (draws depend on seed and output index only),
output with speculation equals output without it, greedy or sampled.

``ngram`` (prompt lookup): the drafts are the tokens that followed the latest earlier occurrence
of the sequence's longest recurring suffix. No model, no memory: it pays where the output
repeats its context (edits, code, quoting, and the loops small models fall into). ``draft`` and
``mtp`` draft on the worker (a smaller checkpoint; Qwen3-Next's own multi-token-prediction head):
the scheduler sends ``num_draft`` placeholders with ``worker_drafts``. Under a grammar, prompt
lookup's drafts end before the first token the matcher rejects, and the worker samples each
position under the matcher's mask after the drafts before it (``Matcher.bitmasks``), so a
constrained request's output is unchanged too; the worker's drafters do not see the grammar, so
with them constrained requests decode without drafts.

When drafting does not pay it is skipped: above ``max_batch`` decoding requests (the verify pass
then costs more than the tokens it saves: on 2 CPU cores a verify of 4 drafts costs 1.5x a decode
at batch 1, 2x at 8, 2.8x at 32), at a batch size where the measured token rate with drafts is
not above the rate without (``adaptive``: spec_pacer.py; on a GPU, where decode steps replay CUDA
graphs and verify steps do not, that is every batch size so far), for a request whose known
tokens have nothing to look up (a drafting request gives up overlap scheduling for that step,
since it needs its last token before it can draft), and for a request whose drafts keep failing
— kept fewer than ``min_accepted`` tokens per verify on average: it backs off for 8, 16, ... up
to 64 of its decodes before it tries again.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from services.scheduler.request import Req
from services.scheduler.spec_pacer import Pacer

ALGORITHMS = ("ngram", "draft", "mtp")
Drafter = Callable[[Req, int], list[int]]


@dataclass(frozen=True, slots=True)
class SpecConfig:
    algorithm: Literal["", "ngram", "draft", "mtp"] = ""  # "" = off
    num_draft_tokens: int = 4  # K: drafts per verify step at most
    ngram_min: int = 1  # shortest suffix looked up
    ngram_max: int = 4  # longest suffix looked up (the longest that recurs wins)
    max_batch: int = 4  # draft only while at most this many requests decode
    min_accepted: float = 1.0  # drafts kept per verify (a request's running mean) below which it backs off
    adaptive: bool = True  # draft only at batch sizes where it was measured to pay (spec_pacer.py)

    def validate(self) -> None:
        if self.algorithm and self.algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm: {self.algorithm!r} is not one of {ALGORITHMS}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens: must be >= 1, got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram sizes: need 1 <= min <= max, got {self.ngram_min}, {self.ngram_max}")
        if self.min_accepted < 0:
            raise ValueError(f"speculative_min_accepted: must be >= 0, got {self.min_accepted}")
        if self.max_batch < 1:
            raise ValueError(f"speculative_max_batch: must be >= 1, got {self.max_batch}")


def ngram_draft(tokens: list[int], k: int, n_min: int = 1, n_max: int = 4) -> list[int]:
    """Up to ``k`` tokens predicted to follow ``tokens``: find the latest earlier occurrence of the
    longest suffix of ``n_max`` down to ``n_min`` tokens and continue from there. The continuation
    reads on into the draft itself, so a loop shorter than ``k`` is drafted whole cycles ahead."""
    total = len(tokens)
    if k < 1 or total < 2:
        return []
    buf = array("i", tokens).tobytes()  # rfind in C over 4-byte cells instead of a Python scan
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        pattern = buf[(total - n) * 4 :]
        end = (total - 1) * 4  # an occurrence must leave a token after it (so it is not the suffix)
        while (at := buf.rfind(pattern, 0, end)) >= 0 and at % 4:
            end = at + len(pattern) - 1  # a match across cells: look further left
        if at < 0:
            continue
        follow = at // 4 + n  # the token after the occurrence
        draft: list[int] = []
        for i in range(k):
            j = follow + i
            draft.append(tokens[j] if j < total else draft[j - total])
        return draft
    return []


@dataclass(slots=True)
class SpecCounters:
    verify_steps: int = 0  # request-steps that carried drafts
    draft_tokens: int = 0  # drafts sent
    accepted_tokens: int = 0  # drafts the worker kept
    draft_s: float = 0.0  # time spent drafting


class Speculator:
    """Drafts for one scheduler's decodes (``draft``) and learns from what was kept (``record``)."""

    def __init__(self, cfg: SpecConfig, context_length: int, drafter: Drafter | None = None) -> None:
        """``drafter(req, k)``: up to ``k`` drafts for ``req`` (default: ``cfg.algorithm``'s)."""
        cfg.validate()
        self.cfg = cfg
        self.context_length = context_length
        self.counters = SpecCounters()
        # ``draft`` / ``mtp``: the worker's draft model or MTP head writes the drafts; the
        # scheduler sends placeholders.
        self.worker_drafts = cfg.algorithm in ("draft", "mtp") and drafter is None
        if drafter is None:
            drafter = (lambda req, k: [0] * k) if self.worker_drafts else (
                lambda req, k: ngram_draft(req.seq, k, cfg.ngram_min, cfg.ngram_max))
        self.drafter: Drafter = drafter
        self.pacer = Pacer() if cfg.adaptive else None

    def _eligible(self, req: Req, decoding: int) -> bool:
        """Not over the batch limit, at a batch size where drafting pays, not backing off, and not
        constrained by a grammar when the worker drafts (the scheduler masks only drafts it can see)."""
        return (decoding <= self.cfg.max_batch and (self.pacer is None or self.pacer.allows(decoding))
                and not req.spec_wait and (req.grammar is None or not self.worker_drafts))  # fmt: skip

    def observe(self, decoding: int, tokens: int, counted: bool) -> None:
        """A step planned while ``decoding`` requests decoded was committed with ``tokens`` output
        tokens (``counted``: a pure decode step that followed another step without an idle pause):
        the pacer's measurement. The batch size comes from the step's plan: with overlap, the
        batcher has planned the next step by the time this one commits, and a request waiting to
        verify is not counted in that one."""
        if self.pacer is not None:
            self.pacer.observe(decoding, tokens, counted)

    def drafting(self, req: Req, decoding: int) -> bool:
        """Whether ``req`` drafts while ``decoding`` requests decode: then it is planned only once
        its last token is known (with overlap scheduling, every other step). With prompt lookup,
        only while the known tokens have something to look up that the request's grammar, if any,
        takes (a cheap probe: text that never recurs does not give up overlap for nothing)."""
        if not self._eligible(req, decoding):
            return False
        if self.worker_drafts:
            return True
        probe = self.drafter(req, 1)
        return bool(probe) and (req.grammar is None or req.grammar.accepted_prefix(probe) > 0)

    def draft(self, req: Req, decoding: int) -> list[int]:
        """Drafts for ``req``'s next decode (empty: an ordinary decode) while ``decoding`` requests
        decode this step. Only a request whose last token is known (nothing in flight) drafts; the
        drafts never take it past ``max_new_tokens`` or the context, and under a grammar they end
        before the first token it rejects (the worker samples each position under the matcher's
        mask after the drafts before it). A request whose drafts were mostly rejected pauses."""
        cfg = self.cfg
        if req.inflight or not self._eligible(req, decoding):
            if req.spec_wait:
                req.spec_wait -= 1  # backing off: one decode fewer to wait
            return []
        room = min(
            cfg.num_draft_tokens,
            req.gen.max_new_tokens - len(req.output) - 1,
            self.context_length - req.seq_len - 1,
        )
        if room < 1:
            return []
        t0 = time.perf_counter()
        draft = self.drafter(req, room)[:room]  # empty where nothing recurs: an ordinary decode
        if draft and req.grammar is not None:
            draft = draft[: req.grammar.accepted_prefix(draft)]
        self.counters.draft_s += time.perf_counter() - t0
        return draft

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """A verify step of ``req`` kept ``accepted`` of its ``drafted`` drafts."""
        c = self.counters
        c.verify_steps += 1
        c.draft_tokens += drafted
        c.accepted_tokens += accepted
        req.spec_score = 0.5 * req.spec_score + 0.5 * accepted
        if req.spec_score < self.cfg.min_accepted:
            self._back_off(req)
        else:
            req.spec_backoff = 0

    @staticmethod
    def _back_off(req: Req) -> None:
        """Wait 8, 16, 32, then 64 decodes before the next try."""
        req.spec_backoff = min(2 * req.spec_backoff or 8, 64)
        req.spec_wait = req.spec_backoff
