"""Prompt scoring: the logprobs of a prompt's own tokens, from the forward that prefills them.

A request with ``ReqInput.prompt_logprobs`` gets logits for every input position of its chunk (not
only the last): position ``j`` predicts the token at ``j + 1``, which is the chunk's next input id,
or ``next_prompt_id`` after the chunk's last input. On the prompt's last chunk (no
``next_prompt_id``) the last position predicts the sample instead and is not scored.

Only what is asked leaves the vocabulary width: per scored position the target's logprob, its rank
and the ``top_logprobs`` best alternatives; rows are turned into those a slice at a time, so the
float32 log-softmax of a long chunk never exists whole beside its logits.

Logits rows of one forward, request by request (``want[b]`` rows each, see ``BatchInput``)::

    | req 0: want[0] rows | req 1: want[1] rows | ...
      a scoring request: one row per input position; its sample (if any) is the last row
      any other request: its sample rows (1, or 1 + num_draft), or none
"""

from __future__ import annotations

from itertools import accumulate

import torch

from services.common.step import PromptScores, ReqInput, TokenLogprob

SLICE_ROWS = 256  # positions turned into logprobs at once (bounds the float32 copy of their rows)


def want_logits(reqs: list[ReqInput]) -> list[int]:
    """Logits rows each request needs: every input position of a scoring chunk, else its samples."""
    return [len(r.input_ids) if r.prompt_logprobs else r.sample * (1 + r.num_draft) for r in reqs]


def sample_rows(reqs: list[ReqInput], want: list[int]) -> list[int]:
    """Indices of the logits rows the sampler reads, in the order it expects (each sampling
    request's last ``1 + num_draft`` rows)."""
    ends = list(accumulate(want))
    return [i for r, e in zip(reqs, ends, strict=True) if r.sample for i in range(e - 1 - r.num_draft, e)]


def _targets(r: ReqInput) -> list[int]:
    """The prompt tokens a scoring chunk's positions predict, one per scored position."""
    return r.input_ids[1:] + ([r.next_prompt_id] if r.next_prompt_id is not None else [])


def score_prompts(reqs: list[ReqInput], want: list[int], logits: torch.Tensor) -> list[PromptScores]:
    """One ``PromptScores`` per request with ``prompt_logprobs``, in request order, from ``logits``
    laid out as ``want`` says. Logprobs are the float32 log-softmax of the model's logits; a rank
    counts the tokens strictly more likely, plus one."""
    starts = [0, *accumulate(want)]
    scoring = [b for b, r in enumerate(reqs) if r.prompt_logprobs]
    targets = [_targets(reqs[b]) for b in scoring]
    rows = [i for b, t in zip(scoring, targets, strict=True) for i in range(starts[b], starts[b] + len(t))]
    flat = [x for t in targets for x in t]
    vocab = logits.shape[1]
    k = min(max((reqs[b].top_logprobs for b in scoring), default=0), vocab)
    chosen: list[float] = []
    ranks: list[int] = []
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    for a in range(0, len(rows), SLICE_ROWS):
        idx = torch.tensor(rows[a : a + SLICE_ROWS], device=logits.device)
        tgt = torch.tensor(flat[a : a + SLICE_ROWS], device=logits.device).unsqueeze(1)
        logp = logits.index_select(0, idx).float().log_softmax(dim=1)
        value = logp.gather(1, tgt)
        chosen += value.squeeze(1).tolist()
        ranks += ((logp > value).sum(dim=1) + 1).tolist()
        if k:
            best = logp.topk(k, dim=1)
            top_vals += best.values.tolist()
            top_ids += best.indices.tolist()
    out = []
    at = 0
    for b, t in zip(scoring, targets, strict=True):
        n = min(reqs[b].top_logprobs, vocab)
        lps = tuple(
            TokenLogprob(tok, chosen[j], tuple(zip(top_ids[j][:n], top_vals[j][:n], strict=True)) if n else ())
            for j, tok in zip(range(at, at + len(t)), t, strict=True)
        )
        out.append(PromptScores(lps, tuple(ranks[at : at + len(t)])))
        at += len(t)
    return out
