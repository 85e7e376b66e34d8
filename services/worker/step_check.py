"""Validation of a ``StepRequest`` against the worker's pools, before anything is mutated.

``check_step`` is pure: it reads the request and a few sizes and returns the decoded grammar
bitmasks; every problem is a ``StepError`` naming the op or request and the field, so a buggy
scheduler gets an ``INVALID_ARGUMENT`` it can act on and the worker's pools stay intact.

Ops are simulated in order: a ``ReleaseRow`` earlier in the same step forgets that row's last
sample and length, so a later ``use_last_sample`` on it is refused; a ``PoolResize`` changes the
capacities that later ops and the step's requests are checked against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain

import torch

from services.common.step import (
    HostBackup,
    HostLoad,
    L3Get,
    L3Put,
    MambaCopy,
    MambaReset,
    PoolResize,
    ReleaseRow,
    ReqInput,
    StateBackup,
    StateLoad,
    StepError,
    StepRequest,
)
from services.worker.host_ops import check_host_op
from services.worker.pools import check_kv_capacity

_WORD_BITS = 32


def check_step(
    req: StepRequest,
    *,
    num_rows: int,
    num_slots: int,
    num_mamba_slots: int,
    max_slots: int,
    max_mamba_slots: int,
    slot_granularity: int,
    max_context: int,
    vocab_size: int,
    max_top_logprobs: int,
    rows_with_sample: set[int],
    row_len: Mapping[int, int],
    host_pages: int = 0,
    host_page_tokens: int = 0,
    l3: bool = False,
    host_states: int = 0,
) -> list[torch.Tensor | None]:
    """Raise ``StepError`` for the first problem found; return one bitmask (or ``None``) per request.

    ``num_slots`` / ``num_mamba_slots`` are the capacities before this step's ops; ``max_slots``
    / ``max_mamba_slots`` the reservations, ``slot_granularity`` the KV resize unit.
    ``max_mamba_slots == 0`` means a dense model: Mamba ops and ``mamba_slot`` are refused.
    ``rows_with_sample`` / ``row_len``: rows holding a previous sample / how many positions each
    row holds, before this step's ops. ``host_pages`` / ``host_page_tokens`` / ``l3``: the host
    pool (0 pages = none) and whether the kvstore is reachable, for the hierarchical-cache ops;
    ``host_states``: the host state pool of a hybrid model (0 = none), for the state ops.
    """
    sampled = set(rows_with_sample)
    lengths = dict(row_len)
    hybrid = max_mamba_slots > 0
    for i, op in enumerate(req.ops):
        where = f"ops[{i}] ({type(op).__name__})"
        if isinstance(op, PoolResize):
            _check_resize(op, where, max_slots, max_mamba_slots, slot_granularity)
            num_slots, num_mamba_slots = op.kv_slots, op.mamba_slots
        elif isinstance(op, MambaCopy):
            _mamba_slot(op.src, num_mamba_slots, f"{where}.src", hybrid)
            _mamba_slot(op.dst, num_mamba_slots, f"{where}.dst", hybrid)
            if op.src == op.dst:
                raise StepError(f"{where}: src == dst == {op.src}")
        elif isinstance(op, MambaReset):
            _mamba_slot(op.slot, num_mamba_slots, f"{where}.slot", hybrid)
        elif isinstance(op, ReleaseRow):
            _in_range(op.row, num_rows, f"{where}.row")
            sampled.discard(op.row)
            lengths.pop(op.row, None)
        elif isinstance(op, HostBackup | HostLoad | StateBackup | StateLoad | L3Put | L3Get):
            check_host_op(
                op, where, num_slots=num_slots, host_pages=host_pages, page_tokens=host_page_tokens, l3=l3,
                num_mamba_slots=num_mamba_slots, host_states=host_states,
            )
        else:
            raise StepError(f"{where}: unknown op type")

    limits = _Limits(num_rows, num_slots, num_mamba_slots, hybrid, max_context, vocab_size, max_top_logprobs)
    if not _batch_passes(req.reqs, limits, sampled, lengths):
        return _check_each(req.reqs, limits, sampled, lengths)
    return [
        None if r.token_bitmask is None else decode_bitmask(r.token_bitmask, vocab_size, _where(r), 1 + r.num_draft)
        for r in req.reqs
    ]


@dataclass(frozen=True, slots=True)
class _Limits:
    """What a step's requests are checked against (after the step's ops)."""

    num_rows: int
    num_slots: int
    num_mamba_slots: int
    hybrid: bool
    max_context: int
    vocab_size: int
    max_top_logprobs: int


def _where(r: ReqInput) -> str:
    return f"request {r.request_id!r} (row {r.row})"


def _batch_passes(reqs: list[ReqInput], lim: _Limits, sampled: set[int], lengths: Mapping[int, int]) -> bool:
    """Whether ``_check_each`` accepts every request, decided with a few list and set operations
    over the whole batch: a decode of hundreds of requests is the common case, and the loop spent
    microseconds per request on it. Never True for a batch the loop refuses (it may be False for
    one the loop accepts: then the loop decides), so the loop alone words the errors."""
    if not reqs:
        return True
    rows = [r.row for r in reqs]
    num_new = [r.num_new for r in reqs]
    new_slots = list(chain.from_iterable(r.new_slots for r in reqs))
    mamba = [r.mamba_slot for r in reqs if r.mamba_slot is not None]
    return (
        len(mamba) == (len(reqs) if lim.hybrid else 0)  # every request has one, or none does
        and _within(mamba, lim.num_mamba_slots)
        and len(set(mamba)) == len(mamba)
        and _within(rows, lim.num_rows)
        and len(set(rows)) == len(rows)
        and sampled.issuperset(r.row for r in reqs if r.use_last_sample)
        and all(r.input_ids or r.use_last_sample for r in reqs)
        and _within(list(chain.from_iterable(r.input_ids for r in reqs)), lim.vocab_size)
        and min(r.start_pos for r in reqs) >= 0
        and max(r.start_pos + n for r, n in zip(reqs, num_new, strict=True)) <= lim.max_context
        and all(
            len(r.prefix_slots) == r.start_pos if r.prefix_slots else r.start_pos <= lengths.get(r.row, 0)
            for r in reqs
        )
        and [len(r.new_slots) for r in reqs] == num_new
        and _within(new_slots, lim.num_slots)
        and len(set(new_slots)) == len(new_slots)
        and _within(list(chain.from_iterable(r.prefix_slots for r in reqs)), lim.num_slots)
        and _within([r.top_logprobs for r in reqs], lim.max_top_logprobs + 1)
        and _within(list(chain.from_iterable(r.history_ids for r in reqs)), lim.vocab_size)
        and (not any(r.num_draft or r.worker_drafts for r in reqs) or all(map(_drafts_pass, reqs)))
        and (
            not any(r.prompt_logprobs or r.next_prompt_id is not None for r in reqs)
            or all(_scoring_passes(r, lim.vocab_size) for r in reqs)
        )
    )


def _scoring_passes(r: ReqInput, vocab_size: int) -> bool:
    """``_check_scoring``'s rule for prompt scoring."""
    if r.next_prompt_id is not None and not (r.prompt_logprobs and not r.sample and 0 <= r.next_prompt_id < vocab_size):
        return False
    return not r.prompt_logprobs or not (r.use_last_sample or r.num_draft)


def _drafts_pass(r: ReqInput) -> bool:
    """``_check_tokens``'s rule for draft tokens."""
    if r.worker_drafts and not r.num_draft:
        return False
    return not r.num_draft or (
        0 < r.num_draft < len(r.input_ids)
        and r.sample and not r.use_last_sample and not r.mask_follows
        and (r.token_bitmask is None or not r.worker_drafts)
    )


def _within(values: list[int], size: int) -> bool:
    """Every value in ``[0, size)``; an empty list passes."""
    return not values or (min(values) >= 0 and max(values) < size)


def _check_each(
    reqs: list[ReqInput], lim: _Limits, sampled: set[int], lengths: Mapping[int, int]
) -> list[torch.Tensor | None]:
    """Request by request: ``StepError`` for the first problem, naming the request and field."""
    num_rows, num_slots, num_mamba_slots, hybrid = lim.num_rows, lim.num_slots, lim.num_mamba_slots, lim.hybrid
    vocab_size, max_context, max_top_logprobs = lim.vocab_size, lim.max_context, lim.max_top_logprobs
    masks: list[torch.Tensor | None] = []
    seen_rows: set[int] = set()
    seen_mamba: set[int] = set()
    seen_slots: set[int] = set()
    for r in reqs:
        where = f"request {r.request_id!r}"
        _in_range(r.row, num_rows, f"{where} row")
        if r.row in seen_rows:
            raise StepError(f"{where}: row {r.row} appears twice in one step")
        seen_rows.add(r.row)
        where = _where(r)
        _check_tokens(r, where, vocab_size, sampled, max_context, lengths)
        _check_slots(r, where, num_slots, seen_slots)
        if not hybrid:
            if r.mamba_slot is not None:
                raise StepError(f"{where}: mamba_slot={r.mamba_slot} but the model has no Mamba state")
        else:
            if r.mamba_slot is None:
                raise StepError(f"{where}: a hybrid model needs mamba_slot")
            _mamba_slot(r.mamba_slot, num_mamba_slots, f"{where} mamba_slot", hybrid)
            if r.mamba_slot in seen_mamba:
                raise StepError(f"{where}: mamba_slot {r.mamba_slot} is used by two requests")
            seen_mamba.add(r.mamba_slot)
        if not 0 <= r.top_logprobs <= max_top_logprobs:
            raise StepError(f"{where}: top_logprobs={r.top_logprobs} outside [0, {max_top_logprobs}]")
        bad = [t for t in r.history_ids if not 0 <= t < vocab_size]
        if bad:
            raise StepError(f"{where}: history_ids has token {bad[0]} outside [0, {vocab_size})")
        _check_scoring(r, where, vocab_size)
        masks.append(
            None if r.token_bitmask is None else decode_bitmask(r.token_bitmask, vocab_size, where, 1 + r.num_draft)
        )
    return masks


def _check_scoring(r: ReqInput, where: str, vocab_size: int) -> None:
    """Prompt scoring runs on a prefill chunk's own input ids; ``next_prompt_id`` only with it, on a
    chunk that does not sample."""
    if r.prompt_logprobs and (r.use_last_sample or r.num_draft):
        raise StepError(f"{where}: prompt_logprobs scores a prefill chunk; not with use_last_sample or num_draft")
    if r.next_prompt_id is None:
        return
    if not r.prompt_logprobs or r.sample:
        raise StepError(f"{where}: next_prompt_id needs prompt_logprobs and no sample (a sampled position "
                        "predicts the sample, not a prompt token)")  # fmt: skip
    if not 0 <= r.next_prompt_id < vocab_size:
        raise StepError(f"{where}: next_prompt_id={r.next_prompt_id} outside [0, {vocab_size})")


def _in_range(value: int, size: int, what: str) -> None:
    if not 0 <= value < size:
        raise StepError(f"{what}={value} out of range [0, {size})")


def _mamba_slot(slot: int, num: int, what: str, hybrid: bool) -> None:
    if not hybrid:
        raise StepError(f"{what}: the model has no Mamba state (dense model)")
    _in_range(slot, num, what)


def _check_resize(op: PoolResize, where: str, max_slots: int, max_mamba_slots: int, granularity: int) -> None:
    try:
        check_kv_capacity(op.kv_slots, max_slots, granularity)
    except ValueError as e:
        raise StepError(f"{where}.kv_slots: {e}") from None
    if max_mamba_slots == 0 and op.mamba_slots:
        raise StepError(f"{where}.mamba_slots={op.mamba_slots}: the model has no Mamba state (dense model); send 0")
    if not 0 <= op.mamba_slots <= max_mamba_slots:
        raise StepError(f"{where}.mamba_slots: Mamba capacity {op.mamba_slots} outside "
                        f"[0, {max_mamba_slots}] (max_mamba_slots)")


def _check_tokens(
    r: ReqInput,
    where: str,
    vocab_size: int,
    sampled: set[int],
    max_context: int,
    lengths: Mapping[int, int],
) -> None:
    if r.use_last_sample:
        if r.row not in sampled:
            raise StepError(f"{where}: use_last_sample but the row has no previous sample")
    elif not r.input_ids:
        raise StepError(f"{where}: input_ids is empty")
    else:
        bad = [t for t in r.input_ids if not 0 <= t < vocab_size]
        if bad:
            raise StepError(f"{where}: input_ids has token {bad[0]} outside [0, {vocab_size})")
    if r.worker_drafts and not r.num_draft:
        raise StepError(f"{where}: worker_drafts needs num_draft > 0")
    if r.num_draft:
        if not 0 < r.num_draft < len(r.input_ids):
            raise StepError(
                f"{where}: num_draft={r.num_draft} must be in [0, {len(r.input_ids)}) (one input id "
                "before the drafts)"
            )
        if not r.sample or r.use_last_sample or r.mask_follows:
            raise StepError(f"{where}: num_draft needs sample and no use_last_sample or mask_follows")
        if r.worker_drafts and r.token_bitmask is not None:
            raise StepError(f"{where}: worker_drafts with a token_bitmask: the worker's drafts cannot be masked")
    n = r.num_new
    if r.start_pos < 0:
        raise StepError(f"{where}: start_pos={r.start_pos} is negative")
    if r.start_pos + n > max_context:
        raise StepError(
            f"{where}: start_pos {r.start_pos} + {n} new tokens exceeds max_context {max_context}"
        )
    if r.prefix_slots:
        if len(r.prefix_slots) != r.start_pos:
            raise StepError(
                f"{where}: prefix_slots has {len(r.prefix_slots)} entries, start_pos is {r.start_pos}"
            )
    elif r.start_pos > lengths.get(r.row, 0):
        raise StepError(
            f"{where}: start_pos {r.start_pos} but the row holds only {lengths.get(r.row, 0)} positions "
            "and no prefix_slots were sent"
        )


def _check_slots(r: ReqInput, where: str, num_slots: int, seen: set[int]) -> None:
    if len(r.new_slots) != r.num_new:
        raise StepError(f"{where}: new_slots has {len(r.new_slots)} entries for {r.num_new} new tokens")
    for field, slots in (("new_slots", r.new_slots), ("prefix_slots", r.prefix_slots)):
        if slots and (min(slots) < 0 or max(slots) >= num_slots):
            bad = next(s for s in slots if not 0 <= s < num_slots)
            raise StepError(f"{where}: {field} has slot {bad} outside [0, {num_slots})")
    before = len(seen)
    seen.update(r.new_slots)
    if len(seen) != before + len(r.new_slots):
        raise StepError(f"{where}: new_slots repeats a slot already written in this step")


def decode_bitmask(raw: bytes, vocab_size: int, where: str, masks: int = 1) -> torch.Tensor:
    """``masks`` packed bitmasks back to back (a request verifying drafts: one per sampled
    position) as int32 words: ``[words]`` for one mask, ``[masks, words]`` for more. Each must
    allow a token."""
    words = -(-vocab_size // _WORD_BITS)
    if len(raw) != 4 * words * masks:
        each = "" if masks == 1 else f"{masks} masks (1 + num_draft) of "
        raise StepError(
            f"{where}: token_bitmask has {len(raw)} bytes, expected {4 * words * masks} "
            f"({each}ceil({vocab_size}/32) int32 words)"
        )
    mask = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(masks, words)
    valid = mask.clone()
    tail = vocab_size - _WORD_BITS * (words - 1)  # bits of the last word that name real tokens
    if tail < _WORD_BITS:
        valid[:, -1] &= (1 << tail) - 1
    empty = (~valid.any(dim=1)).nonzero()
    if len(empty):
        which = "" if masks == 1 else f" (mask {int(empty[0])})"
        raise StepError(f"{where}: token_bitmask allows no token{which}")
    return mask[0] if masks == 1 else mask
