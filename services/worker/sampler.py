"""Turn one step's logits into tokens: grammar mask, penalties, temperature, truncation, draw.

Pipeline for each row, in this order:

1. **Grammar bitmask** — tokens whose bit is clear get ``-inf``. A mask that allows no token
   raises ``ValueError`` (naming the row) before ``logits`` is touched; a disallowed token is
   never returned, greedy or sampled.
2. **Penalties** (only when ``params.has_penalties``), counts taken over ``history``:
   repetition penalty ``r`` divides positive logits and multiplies non-positive ones of every
   token present in ``history``; then ``logit -= frequency * count + presence * (count > 0)``.
   The engine only knows history as prompt + output, so frequency and presence penalties here
   count occurrences over the *whole* history, prompt included.
3. **Temperature** — sampled rows use ``(logit - row_max) / temperature``; subtracting the
   maximum first keeps a tiny but positive temperature finite (no ``inf - inf``).
4. **Truncation** — top-k (0 = off), then top-p over the distribution renormalised after
   top-k (the smallest prefix, best first, whose mass reaches ``top_p``; 1 = off), then min-p
   (drop tokens with ``p < min_p * p_max``; 0 = off). Each keeps a prefix of the sorted row, and
   the most likely token always survives.
5. **Draw** — inverse CDF over the kept probabilities (sorted best first, ties by token id)
   with one uniform ``u`` that depends only on ``(seed, output_index)``: never on batch size,
   batch order or the other rows.

Greedy rows (``temperature == 0`` or ``top_k == 1``) take ``argmax`` of the masked, penalised
logits (first index on ties); with no mask and no penalties that is exactly ``logits.argmax``.
When every row is plain greedy the whole batch is one ``argmax`` call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.step import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1
_WORD_BITS = 32


@dataclass(slots=True)
class SamplerInput:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams  # already validated by the scheduler
    seed: int  # the request's seed
    output_index: int  # tokens this request generated before this sample
    history: list[int] | None  # prompt + output so far when penalties are on, else None
    bitmask: torch.Tensor | None  # [ceil(V/32)] int32; bit i of word w = token 32*w+i allowed
    return_logprobs: bool
    top_logprobs: int  # 0..MAX_TOP_LOGPROBS


def splitmix64(x: int) -> int:
    """One splitmix64 step: a bijective, well-avalanched 64-bit mix of ``x`` (taken mod 2**64)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_uniform(seed: int, output_index: int) -> float:
    """The uniform in ``[0, 1)`` used for draw ``output_index`` of a request seeded ``seed``.

    Mixing the seed before adding the index keeps nearby (seed, index) pairs uncorrelated,
    which ``seed + index`` would not (seed 1 / index 0 would equal seed 0 / index 1).
    """
    h = splitmix64(splitmix64(seed & _MASK64) ^ (output_index & _MASK64))
    return (h >> 11) * 2.0**-53  # top 53 bits: every value exactly representable


def process_logits(logits: torch.Tensor, inputs: list[SamplerInput]) -> torch.Tensor:
    """Validate, then apply grammar masks and penalties to ``logits`` **in place**; return it.

    Raises ``ValueError`` (leaving ``logits`` unchanged) on a shape/dtype mismatch, a bitmask of
    the wrong size or one that allows no token, a ``history`` token outside ``[0, V)``,
    penalties without ``history``, or ``top_logprobs`` outside ``0..20``.
    """
    _validate(logits, inputs)
    _apply_bitmasks(logits, inputs)
    _apply_penalties(logits, inputs)
    return logits


def sample(logits: torch.Tensor, inputs: list[SamplerInput]) -> list[TokenLogprob]:
    """Pick one token per row of ``logits`` ``[B, V]`` float32; one result per input, in order.

    ``logits`` is modified in place and must not be reused: on return each row holds the logits
    its logprobs are computed from (masked and penalised; sampled rows also temperature-scaled).

    Logprobs are the log-softmax of that row — after mask, penalties and temperature, before
    top-k/top-p/min-p truncation, so alternatives stay informative; greedy rows use temperature
    1. ``top`` holds the ``top_logprobs`` best finite alternatives, best first (masked tokens
    are left out). When ``return_logprobs`` is false, ``logprob`` is 0.0 and ``top`` is empty.
    """
    process_logits(logits, inputs)
    random_rows = [i for i, x in enumerate(inputs) if not x.params.greedy]
    tokens = logits.argmax(dim=1)  # right for greedy rows; sampled rows are overwritten below
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        scaled = _scale(logits.index_select(0, idx), [inputs[i].params for i in random_rows])
        uniforms = [draw_uniform(inputs[i].seed, inputs[i].output_index) for i in random_rows]
        tokens[idx] = _draw(scaled, [inputs[i].params for i in random_rows], uniforms)
        logits[idx] = scaled
    return _results(logits, tokens, inputs)


def _validate(logits: torch.Tensor, inputs: list[SamplerInput]) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be [B, V] float32, got {list(logits.shape)} {logits.dtype}")
    batch, vocab = logits.shape
    if batch != len(inputs):
        raise ValueError(f"logits has {batch} rows but {len(inputs)} sampler inputs were given")
    words = -(-vocab // _WORD_BITS)
    for row, x in enumerate(inputs):
        if not 0 <= x.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"row {row}: top_logprobs={x.top_logprobs} is outside 0..{MAX_TOP_LOGPROBS}")
        if x.bitmask is not None and (x.bitmask.shape != (words,) or x.bitmask.dtype != torch.int32):
            raise ValueError(
                f"row {row}: bitmask must be [{words}] int32 for vocab {vocab}, "
                f"got {list(x.bitmask.shape)} {x.bitmask.dtype}"
            )
        if x.params.has_penalties:
            if x.history is None:
                raise ValueError(f"row {row}: penalties are on but no history was given")
            if x.history and not (min(x.history) >= 0 and max(x.history) < vocab):
                raise ValueError(f"row {row}: history has a token id outside [0, {vocab})")


def _apply_bitmasks(logits: torch.Tensor, inputs: list[SamplerInput]) -> None:
    rows = [i for i, x in enumerate(inputs) if x.bitmask is not None]
    masks = [x.bitmask for x in inputs if x.bitmask is not None]
    if not masks:
        return
    vocab = logits.shape[1]
    words = torch.stack(masks).to(logits.device)
    shifts = torch.arange(_WORD_BITS, device=logits.device, dtype=torch.int32)
    # Arithmetic shift of a negative word still yields the right low bit after "& 1".
    allowed = ((words.unsqueeze(2) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    empty = (~allowed.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"row {rows[empty[0]]}: grammar bitmask allows no token")
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))


def _apply_penalties(logits: torch.Tensor, inputs: list[SamplerInput]) -> None:
    rows = [i for i, x in enumerate(inputs) if x.params.has_penalties]
    if not rows:
        return
    vocab = logits.shape[1]
    dev = logits.device
    # One bincount for all rows: token t of penalised row j lands in bucket j * V + t.
    flat = [j * vocab + t for j, i in enumerate(rows) for t in inputs[i].history or ()]
    counts = torch.bincount(torch.tensor(flat, dtype=torch.int64, device=dev), minlength=len(rows) * vocab)
    counts = counts.view(len(rows), vocab).to(logits.dtype)
    seen = counts > 0

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=dev).unsqueeze(1)

    params = [inputs[i].params for i in rows]
    rep = column([p.repetition_penalty for p in params])
    idx = torch.tensor(rows, device=dev)
    sub = logits.index_select(0, idx)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= column([p.frequency_penalty for p in params]) * counts
    sub -= column([p.presence_penalty for p in params]) * seen.to(logits.dtype)
    logits[idx] = sub


def _scale(sub: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], dtype=sub.dtype, device=sub.device)
    # Shifting by the (finite) row max first: the max maps to 0, others to <= 0 or -inf.
    return (sub - sub.amax(dim=1, keepdim=True)) / temps.unsqueeze(1)


def _draw(scaled: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> torch.Tensor:
    """Token ids drawn from temperature-scaled rows after top-k, top-p and min-p truncation."""
    dev = scaled.device
    vocab = scaled.shape[1]
    # Stable sort: ties are ordered by token id, so a row's order never depends on its batch.
    ordered, order = scaled.sort(dim=1, descending=True, stable=True)
    probs = ordered.softmax(dim=1)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
    keep = ranks < top_k.unsqueeze(1)

    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=dev).unsqueeze(1)
    kept = probs.masked_fill(~keep, 0.0)
    kept = kept / kept.sum(dim=1, keepdim=True)
    mass_before = kept.cumsum(dim=1) - kept
    # top_p == 1 is skipped outright: rounding in the cumsum must not trim the tail.
    keep &= (mass_before < top_p) | (top_p >= 1.0)

    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=dev).unsqueeze(1)
    keep &= probs >= min_p * probs[:, :1]

    final = probs.masked_fill(~keep, 0.0)
    cdf = final.cumsum(dim=1)
    u = torch.tensor(uniforms, dtype=cdf.dtype, device=dev).unsqueeze(1)
    pos = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    # Zero-mass entries form a suffix (sorted, prefix filters); u * total rounding up to the
    # total would point past the last kept token, so clamp to it.
    last = ((final > 0).sum(dim=1, keepdim=True) - 1).clamp_min(0)
    pos = torch.minimum(pos, last)
    return order.gather(1, pos).squeeze(1)


def _results(logits: torch.Tensor, tokens: torch.Tensor, inputs: list[SamplerInput]) -> list[TokenLogprob]:
    token_list: list[int] = tokens.tolist()
    rows = [i for i, x in enumerate(inputs) if x.return_logprobs]
    if not rows:
        return [TokenLogprob(token_id=t, logprob=0.0) for t in token_list]
    idx = torch.tensor(rows, device=logits.device)
    logp = logits.index_select(0, idx).log_softmax(dim=1)
    chosen: list[float] = logp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
    n = min(max(inputs[i].top_logprobs for i in rows), logits.shape[1])
    top_vals: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if n > 0:
        values, ids = logp.topk(n, dim=1)
        top_vals, top_ids = values.tolist(), ids.tolist()
    out = [TokenLogprob(token_id=t, logprob=0.0) for t in token_list]
    for j, i in enumerate(rows):
        k = inputs[i].top_logprobs
        pairs = zip(top_ids[j][:k], top_vals[j][:k], strict=True)
        top = tuple((t, v) for t, v in pairs if v != float("-inf"))
        out[i] = TokenLogprob(token_id=token_list[i], logprob=chosen[j], top=top)
    return out
