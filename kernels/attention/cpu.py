"""Attention on the CPU over the slot-indexed KV pool, with prefix-shared (cascade) passes.

The torch references (``kernels.attention.reference``) gather every request's whole row token by
token into a tensor padded to the longest request and materialise every score. This path does
neither:

* every pass runs in the fused flash-attention kernel of torch's CPU backend
  (``aten._scaled_dot_product_flash_attention_for_cpu``: blocked, online softmax, GQA without copies,
  and it returns the log-sum-exp that lets passes be merged exactly), except decodes with fp32 pools,
  which read their own range in place with the native paged kernel (``kernels.native.paged_attend``),
  and, in the same call, the shared run of every prefix group whose members are all decodes (read
  once for the group; the kernel merges each decode's segments itself). Where the head size is a
  multiple of 16 (``native_extend``), prefill chunks go to the same kernel too, each as one causal
  segment over its own range (cached prefix, then its new tokens up to each token), and every
  group's shared run is a segment: one kernel call per layer, no flash pass and no merge in Python
  (a 2,048-token prefill step of the bench model: 405-435 -> 377-398 ms; the causal pass ~2x
  flash's, whose blocks compute the masked half);
* a request's **own** pass reads only what is its own: a decode reads ``[kv_start, seq_len)`` of its
  row (natively in place; else gathered by ``index_select`` of whole slot rows, requests bucketed by
  length so padding stays small, a long leading contiguous run read as a view); a prefill chunk
  reads its cached prefix ``[kv_start, start_pos)`` (a view when the slots are one contiguous run,
  one ``index_select`` otherwise) and then its new tokens, causally, straight from this step's K/V
  (no gather at all);
* a **shared** pass per prefix group (``kernels.attention.prefix_groups``): all the group's query
  tokens at once against the run its members share, read once;
* passes of one token are merged by log-sum-exp (``kernels.attention.merge``), exact up to rounding.

Everything that depends only on the batch (slot index tensors, buckets, masks) is computed once per
forward by ``plan_attention`` and reused by every layer by ``run_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import native
from kernels.attention.merge import merge_states
from kernels.attention.prefix_groups import PrefixGroups

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# A bucket of decodes may pad a row by at most this fraction of the bucket's longest row.
_BUCKET_SLACK = 0.25
# A decode's leading run of contiguous slots at least this long is read in place (one pass of its
# own over a view) instead of being gathered: gathering costs a write and a read of every key and
# value, a pass of its own one more kernel call and a merge (break-even near 64 tokens here).
RUN_MIN_TOKENS = 96

Slots = torch.Tensor | slice
"""Slots to read: a ``slice`` when they form one increasing contiguous run (read as a view, no
copy), else an int64 tensor for ``index_select``."""


@dataclass(frozen=True, slots=True)
class SharedPass:
    tokens: torch.Tensor  # [N] flat token indices of every member's new tokens
    slots: Slots  # the shared run (length L)


@dataclass(frozen=True, slots=True)
class DecodeBucket:
    tokens: torch.Tensor  # [b] flat token index of each decode
    slots: torch.Tensor  # [b * lmax] slots, row-major; padding reads slot 0 and is masked
    lmax: int
    mask: torch.Tensor | None  # [b, 1, 1, lmax] additive (0 / -inf); None when every row is full


@dataclass(frozen=True, slots=True)
class PagedSegments:
    """Passes the native kernel (``kernels.native.paged_attend``) reads in place, as segments of the
    slot table: each decode's own range, and the shared run of each prefix group whose members are
    all decodes, read once for the whole group; with ``native_extend``, every request's own range
    (a prefill chunk's causally) and every group's shared run."""

    slots: torch.Tensor  # the slot table (req_to_token) itself
    starts: torch.Tensor  # [G] flat index into ``slots`` where segment s begins
    ends: torch.Tensor  # [G] and ends (exclusive)
    ptr: torch.Tensor  # [G + 1] segment s is read by tokens[ptr[s] : ptr[s + 1]]
    tokens: torch.Tensor  # flat token indices
    causal: torch.Tensor  # [G] -1, or the cached slots before a prefill chunk's first new token


@dataclass(frozen=True, slots=True)
class RunPass:
    token: int  # flat index of the decode's token
    slots: slice  # the leading contiguous run of its own range, read in place


@dataclass(frozen=True, slots=True)
class ExtendPass:
    first: int  # flat index of the request's first new token
    count: int  # new tokens
    prefix: Slots | None  # its own cached prefix [kv_start, start_pos), None if empty


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """What every layer of one forward does (see ``plan_attention``)."""

    num_tokens: int
    shared: list[SharedPass]
    decodes: list[DecodeBucket]
    extends: list[ExtendPass]
    runs: list[RunPass]
    run_tokens: torch.Tensor  # [len(runs)] the runs' token indices
    paged: PagedSegments | None = None  # replaces runs and buckets when the native kernel runs
    # The same passes for the logit rows alone (a model's last layer: ``run_attention(kept=True)``),
    # their tokens numbered in ``logit_rows`` order; planned where ``paged`` covers every pass.
    kept: PagedSegments | None = None
    num_kept: int = 0


def _i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _as_slots(slots: torch.Tensor) -> Slots:
    n = slots.numel()
    if n == 0:
        return slice(0, 0)
    first, last = int(slots[0]), int(slots[-1])
    if last - first == n - 1 and (n == 1 or bool((slots[1:] - slots[:-1] == 1).all())):
        return slice(first, last + 1)
    return slots


def plan_attention(
    req_to_token: torch.Tensor,
    rows: list[int],
    start_pos: list[int],
    extend_lens: list[int],
    groups: PrefixGroups | None,
    native_decode: bool = False,
    native_extend: bool = False,
    logit_rows: list[int] | None = None,
) -> AttentionPlan:
    """The passes of one forward. ``req_to_token`` must already hold this step's slots; request
    ``b`` owns ``rows[b]``, has ``start_pos[b]`` cached tokens and ``extend_lens[b]`` new ones.
    ``native_decode``: decodes read their own ranges in place with ``kernels.native.paged_attend``
    (fp32 pools, the library built) instead of runs and gathered buckets, and so do the shared runs
    of groups whose members are all decodes. ``native_extend`` (with ``native_decode``; head sizes
    that are multiples of 16): every pass goes to that kernel, prefill chunks causally over their own
    range, and nothing is merged in Python. ``logit_rows[b]``: how many of request ``b``'s last new
    tokens give logits; with ``native_extend``, the passes of those tokens alone are planned too
    (``AttentionPlan.kept``)."""
    batch = len(rows)
    cu = [0]
    for n in extend_lens:
        cu.append(cu[-1] + n)
    kv_start = groups.kv_start if groups is not None else [0] * batch
    native_extend = native_extend and native_decode
    decodes = [b for b in range(batch) if extend_lens[b] == 1]
    width = req_to_token.shape[1]
    # Segments for the native kernel: [(first flat index into the table, end, token indices, causal)].
    segments: list[tuple[int, int, list[int], int]] = []
    shared: list[SharedPass] = []
    if groups is not None:
        for g in range(groups.num_groups):
            members = groups.group(g)
            tokens = [t for b in members for t in range(cu[b], cu[b + 1])]
            if native_extend or (native_decode and all(extend_lens[b] == 1 for b in members)):
                first = rows[members[0]] * width
                segments.append((first, first + groups.shared_lens[g], tokens, -1))
                continue
            shared_run = req_to_token[rows[members[0]], : groups.shared_lens[g]]
            shared.append(SharedPass(torch.tensor(tokens, dtype=torch.int64), _as_slots(shared_run)))
    if native_extend:
        readers, extends = list(range(batch)), []
    else:
        readers, extends = decodes, _extend_passes(req_to_token, rows, start_pos, extend_lens, kv_start, cu)
    if native_decode and readers:
        # Request b reads row rows[b] of the table from kv_start[b] through its last new token, in
        # place (a prefill chunk causally): the kernel gets flat indices into the table, nothing is
        # gathered.
        for b in readers:
            n = extend_lens[b]
            start = rows[b] * width
            segments.append((start + kv_start[b], start + start_pos[b] + n, list(range(cu[b], cu[b + 1])),
                             start_pos[b] - kv_start[b] if n > 1 else -1))
        ptr = [0]
        for seg in segments:
            ptr.append(ptr[-1] + len(seg[2]))
        paged = PagedSegments(req_to_token, _i64([seg[0] for seg in segments]), _i64([seg[1] for seg in segments]),
                              _i64(ptr), _i64([tok for seg in segments for tok in seg[2]]),
                              _i64([seg[3] for seg in segments]))
        kept, num_kept = None, 0
        if native_extend and logit_rows is not None:
            kept, num_kept = _kept_segments(req_to_token, segments, cu, logit_rows), sum(logit_rows)
        return AttentionPlan(cu[-1], shared, [], extends, [], torch.empty(0, dtype=torch.int64), paged, kept, num_kept)
    runs: list[RunPass] = []
    rest_start = list(kv_start)  # where the gathered part of each decode's own range begins
    for b in decodes:
        own = req_to_token[rows[b], kv_start[b] : start_pos[b]]  # the new token always stays gathered
        run = _leading_run(own)
        if run >= RUN_MIN_TOKENS:
            first = int(own[0])
            runs.append(RunPass(cu[b], slice(first, first + run)))
            rest_start[b] += run
    buckets = _bucket_decodes(req_to_token, rows, start_pos, rest_start, decodes, cu)
    run_tokens = torch.tensor([r.token for r in runs], dtype=torch.int64)
    return AttentionPlan(cu[-1], shared, buckets, extends, runs, run_tokens)


def _kept_segments(
    req_to_token: torch.Tensor, segments: list[tuple[int, int, list[int], int]], cu: list[int], logit_rows: list[int]
) -> PagedSegments:
    """``segments`` read by the logit rows only: request ``b``'s last ``logit_rows[b]`` tokens,
    renumbered in that order. A segment's readers are whole requests' tokens in order, so its kept
    readers are a suffix of them, and a causal segment's base moves past the tokens dropped."""
    new_index: dict[int, int] = {}
    for b, m in enumerate(logit_rows):
        for tok in range(cu[b + 1] - m, cu[b + 1]):
            new_index[tok] = len(new_index)
    starts, ends, ptr, tokens, causal = [], [], [0], [], []
    for first, end, readers, base in segments:
        mine = [new_index[tok] for tok in readers if tok in new_index]
        if not mine:
            continue
        starts.append(first)
        ends.append(end)
        tokens += mine
        ptr.append(len(tokens))
        causal.append(base + len(readers) - len(mine) if base >= 0 else -1)
    return PagedSegments(req_to_token, _i64(starts), _i64(ends), _i64(ptr), _i64(tokens), _i64(causal))


def _extend_passes(
    req_to_token: torch.Tensor, rows: list[int], start_pos: list[int], extend_lens: list[int], kv_start: list[int],
    cu: list[int],
) -> list[ExtendPass]:
    return [
        ExtendPass(
            cu[b],
            extend_lens[b],
            _as_slots(req_to_token[rows[b], kv_start[b] : start_pos[b]]) if kv_start[b] < start_pos[b] else None,
        )
        for b in range(len(rows))
        if extend_lens[b] > 1
    ]


def _leading_run(slots: torch.Tensor) -> int:
    """Length of the longest prefix of ``slots`` that is one increasing contiguous run."""
    n = slots.numel()
    if n < 2:
        return n
    breaks = ((slots[1:] - slots[:-1]) != 1).nonzero()
    return int(breaks[0]) + 1 if breaks.numel() else n


def _bucket_decodes(
    req_to_token: torch.Tensor, rows: list[int], start_pos: list[int], kv_start: list[int], decodes: list[int],
    cu: list[int],
) -> list[DecodeBucket]:
    """Decodes sorted by own length, cut where padding would pass ``_BUCKET_SLACK`` of the longest."""
    order = sorted(decodes, key=lambda b: start_pos[b] + 1 - kv_start[b], reverse=True)
    buckets: list[DecodeBucket] = []
    i = 0
    while i < len(order):
        lmax = start_pos[order[i]] + 1 - kv_start[order[i]]
        j = i
        while j < len(order) and start_pos[order[j]] + 1 - kv_start[order[j]] >= lmax * (1 - _BUCKET_SLACK):
            j += 1
        members = order[i:j]
        lens = torch.tensor([start_pos[b] + 1 - kv_start[b] for b in members], dtype=torch.int64)
        first = torch.tensor([kv_start[b] for b in members], dtype=torch.int64)
        pos = torch.arange(lmax, dtype=torch.int64)
        valid = pos[None, :] < lens[:, None]
        cols = (first[:, None] + pos[None, :]).clamp_max(req_to_token.shape[1] - 1)
        row_idx = torch.tensor([rows[b] for b in members], dtype=torch.int64)
        slots = torch.where(valid, req_to_token[row_idx[:, None], cols], 0).reshape(-1)
        mask = None
        if not bool(valid.all()):
            mask = torch.zeros(len(members), 1, 1, lmax).masked_fill_(~valid[:, None, None, :], float("-inf"))
        tokens = torch.tensor([cu[b] for b in members], dtype=torch.int64)
        buckets.append(DecodeBucket(tokens, slots, lmax, mask))
        i = j
    return buckets


def _read(cache: torch.Tensor, slots: Slots) -> torch.Tensor:
    return cache[slots] if isinstance(slots, slice) else cache.index_select(0, slots)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Hq, n, D]`` over ``k, v [B, Hkv, L, D]`` -> (out ``[B, Hq, n, D]``, lse ``[B, Hq, n]`` fp32).

    Without a causal mask every query row is attended on its own, so the ``Hq / Hkv`` query heads
    that read one KV head go in as more rows of that head (query head ``h`` reads KV head
    ``h // (Hq / Hkv)``): the same values, in longer row blocks (a 160-token extend over a 2k
    prefix: ~1.5x faster here). A mask must then be the same for every row (``[B, 1, 1, L]``).
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    if causal or hq == hkv or (mask is not None and mask.shape[-2] != 1):
        return _flash(q, k, v, is_causal=causal, attn_mask=mask, scale=scale)
    out, lse = _flash(q.reshape(b, hkv, hq // hkv * n, d), k, v, attn_mask=mask, scale=scale)[:2]
    return out.reshape(b, hq, n, d), lse.reshape(b, hq, n)


def run_attention(
    plan: AttentionPlan,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    kept: bool = False,
) -> torch.Tensor:
    """Attention of ``q [T, Hq, D]`` for one layer, following ``plan``. ``k_new, v_new [T, Hkv, D]``
    are this step's keys and values (already stored in the caches too). Returns ``[T, Hq, D]`` in
    q's dtype. ``kept``: ``q`` holds the logit rows alone, which ``plan.kept`` attends."""
    if kept:
        p = plan.kept
        if p is None or q.shape[0] != plan.num_kept:
            raise ValueError(f"no plan for {q.shape[0]} kept rows (planned: {plan.num_kept if p else 'none'})")
        out = torch.empty(q.shape, dtype=torch.float32)
        native.paged_attend(q.contiguous(), k_cache, v_cache, p.slots, p.starts, p.ends, p.ptr, p.tokens, scale, out,
                            torch.empty(q.shape[:2], dtype=torch.float32), p.causal)
        return out.to(q.dtype)
    t, hq, d = q.shape
    merging = bool(plan.shared or plan.runs)
    out = torch.empty((t, hq, d), dtype=torch.float32 if merging else q.dtype)
    lse = torch.empty((t, hq), dtype=torch.float32) if merging else None
    if plan.paged is not None:  # fp32 pools only: out is fp32 either way
        p = plan.paged
        native.paged_attend(q.contiguous(), k_cache, v_cache, p.slots, p.starts, p.ends, p.ptr, p.tokens, scale, out,
                            lse if lse is not None else torch.empty((t, hq), dtype=torch.float32), p.causal)
    for bucket in plan.decodes:
        b = bucket.tokens.numel()
        keys = k_cache.index_select(0, bucket.slots).view(b, bucket.lmax, *k_cache.shape[1:]).transpose(1, 2)
        vals = v_cache.index_select(0, bucket.slots).view(b, bucket.lmax, *v_cache.shape[1:]).transpose(1, 2)
        o, s = _attend(q.index_select(0, bucket.tokens)[:, :, None, :], keys, vals, scale, mask=bucket.mask)
        out[bucket.tokens] = o[:, :, 0, :].to(out.dtype)
        if lse is not None:
            lse[bucket.tokens] = s[:, :, 0]
    for ext in plan.extends:
        sl = slice(ext.first, ext.first + ext.count)
        qe = q[sl].transpose(0, 1)[None]
        o, s = _attend(qe, k_new[sl].transpose(0, 1)[None], v_new[sl].transpose(0, 1)[None], scale, causal=True)
        o, s = o[0].transpose(0, 1), s[0].transpose(0, 1)  # [n, Hq, D], [n, Hq]
        if ext.prefix is not None:
            keys = _read(k_cache, ext.prefix).transpose(0, 1)[None]
            vals = _read(v_cache, ext.prefix).transpose(0, 1)[None]
            op, sp = _attend(qe, keys, vals, scale)
            o, s = merge_states(o, s, op[0].transpose(0, 1), sp[0].transpose(0, 1))
        out[sl] = o.to(out.dtype)
        if lse is not None:
            lse[sl] = s
    if lse is None:
        return out
    if plan.runs:
        run_o = torch.empty((len(plan.runs), hq, d), dtype=q.dtype)
        run_lse = torch.empty((len(plan.runs), hq), dtype=torch.float32)
        for i, run in enumerate(plan.runs):
            keys = k_cache[run.slots].transpose(0, 1)[None]
            vals = v_cache[run.slots].transpose(0, 1)[None]
            o, s = _attend(q[run.token][None, :, None, :], keys, vals, scale)
            run_o[i], run_lse[i] = o[0, :, 0, :], s[0, :, 0]
        tokens = plan.run_tokens
        run_merged, run_merged_lse = merge_states(
            out.index_select(0, tokens), lse.index_select(0, tokens), run_o, run_lse
        )
        out[tokens], lse[tokens] = run_merged, run_merged_lse
    for sp_ in plan.shared:
        qs = q.index_select(0, sp_.tokens).transpose(0, 1)[None]
        keys = _read(k_cache, sp_.slots).transpose(0, 1)[None]
        vals = _read(v_cache, sp_.slots).transpose(0, 1)[None]
        o, s = _attend(qs, keys, vals, scale)
        merged, merged_lse = merge_states(
            out.index_select(0, sp_.tokens), lse.index_select(0, sp_.tokens), o[0].transpose(0, 1),
            s[0].transpose(0, 1),
        )
        out[sp_.tokens] = merged
        lse[sp_.tokens] = merged_lse
    return out.to(q.dtype)
