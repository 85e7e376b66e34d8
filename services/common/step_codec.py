"""Conversion between ``strata.worker.v1`` messages and ``services.common.step`` types.

Used only at the gRPC edge: by the scheduler's gRPC worker link and by the worker servicer.

The batch travels as columns (``ReqColumns``) and the samples as two packed lists: the per-request
cost of a step on the wire is a few list entries, not a protobuf submessage per request, which is
what a decode step of hundreds of requests spends its CPU on otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, chain, pairwise

from services.common.step import (
    CacheOp,
    HostBackup,
    HostLoad,
    JobResult,
    L3Get,
    L3Put,
    LateMasks,
    MambaCopy,
    MambaReset,
    PoolResize,
    PromptScores,
    ReleaseRow,
    ReqInput,
    ReqOutput,
    SamplingParams,
    StateBackup,
    StateLoad,
    StepRequest,
    StepResult,
    TokenLogprob,
    WorkerInfo,
)
from strata.v1 import strata_pb2 as pb
from strata.worker.v1 import worker_pb2 as wpb


def sampling_to_pb(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
    )


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Fields are already validated and defaulted by the scheduler; unset optionals take defaults."""
    return SamplingParams(
        temperature=m.temperature if m.HasField("temperature") else 1.0,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        top_k=m.top_k,
        min_p=m.min_p,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        frequency_penalty=m.frequency_penalty,
        presence_penalty=m.presence_penalty,
    )


def logprob_to_pb(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprob_from_pb(m: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(m.token_id, m.logprob, tuple((t.token_id, t.logprob) for t in m.top))


def _op_to_pb(op: CacheOp) -> wpb.CacheOp:
    if isinstance(op, MambaCopy):
        return wpb.CacheOp(mamba_copy=wpb.MambaCopy(src=op.src, dst=op.dst))
    if isinstance(op, MambaReset):
        return wpb.CacheOp(mamba_reset=wpb.MambaReset(slot=op.slot))
    if isinstance(op, PoolResize):
        return wpb.CacheOp(pool_resize=wpb.PoolResize(kv_slots=op.kv_slots, mamba_slots=op.mamba_slots))
    if isinstance(op, HostBackup):
        return wpb.CacheOp(host_backup=wpb.HostBackup(job_id=op.job_id, slots=op.slots, host_pages=op.host_pages))
    if isinstance(op, HostLoad):
        return wpb.CacheOp(host_load=wpb.HostLoad(job_id=op.job_id, host_pages=op.host_pages, slots=op.slots))
    if isinstance(op, StateBackup):
        return wpb.CacheOp(
            state_backup=wpb.StateBackup(job_id=op.job_id, slots=op.slots, host_states=op.host_states)
        )
    if isinstance(op, StateLoad):
        return wpb.CacheOp(state_load=wpb.StateLoad(job_id=op.job_id, host_states=op.host_states, slots=op.slots))
    if isinstance(op, L3Put):
        return wpb.CacheOp(
            l3_put=wpb.L3Put(job_id=op.job_id, host_pages=op.host_pages, keys=op.keys, states=op.states)
        )
    if isinstance(op, L3Get):
        return wpb.CacheOp(
            l3_get=wpb.L3Get(job_id=op.job_id, keys=op.keys, host_pages=op.host_pages, states=op.states)
        )
    return wpb.CacheOp(release_row=wpb.ReleaseRow(row=op.row))


def _op_from_pb(m: wpb.CacheOp) -> CacheOp:
    kind = m.WhichOneof("op")
    if kind == "mamba_copy":
        return MambaCopy(m.mamba_copy.src, m.mamba_copy.dst)
    if kind == "mamba_reset":
        return MambaReset(m.mamba_reset.slot)
    if kind == "release_row":
        return ReleaseRow(m.release_row.row)
    if kind == "pool_resize":
        return PoolResize(m.pool_resize.kv_slots, m.pool_resize.mamba_slots)
    if kind == "host_backup":
        b = m.host_backup
        return HostBackup(b.job_id, tuple(b.slots), tuple(b.host_pages))
    if kind == "host_load":
        ld = m.host_load
        return HostLoad(ld.job_id, tuple(ld.host_pages), tuple(ld.slots))
    if kind == "state_backup":
        sb = m.state_backup
        return StateBackup(sb.job_id, tuple(sb.slots), tuple(sb.host_states))
    if kind == "state_load":
        sl = m.state_load
        return StateLoad(sl.job_id, tuple(sl.host_states), tuple(sl.slots))
    if kind == "l3_put":
        put = m.l3_put
        return L3Put(put.job_id, tuple(put.host_pages), tuple(put.keys), put.states)
    if kind == "l3_get":
        get = m.l3_get
        return L3Get(get.job_id, tuple(get.keys), tuple(get.host_pages), get.states)
    raise ValueError(f"cache op with no operation set ({kind!r})")


# The bits of ReqColumns.flags.
_SAMPLE = wpb.REQ_FLAG_SAMPLE
_USE_LAST_SAMPLE = wpb.REQ_FLAG_USE_LAST_SAMPLE
_RETURN_LOGPROBS = wpb.REQ_FLAG_RETURN_LOGPROBS
_MASK_FOLLOWS = wpb.REQ_FLAG_MASK_FOLLOWS
_WORKER_DRAFTS = wpb.REQ_FLAG_WORKER_DRAFTS
_PROMPT_LOGPROBS = wpb.REQ_FLAG_PROMPT_LOGPROBS
_ALL_FLAGS = _SAMPLE | _USE_LAST_SAMPLE | _RETURN_LOGPROBS | _MASK_FOLLOWS | _WORKER_DRAFTS | _PROMPT_LOGPROBS

# The columns of ReqColumns with one entry per request (``rows`` sets the count).
_PER_REQUEST = (
    "request_ids", "start_pos", "num_input_ids", "num_prefix_slots", "num_new_slots", "mamba_slots", "flags",
    "seeds", "output_index", "top_logprobs", "sampling_index",
)  # fmt: skip


def step_to_pb(s: StepRequest) -> wpb.StepRequest:
    m = wpb.StepRequest(step_id=s.step_id, ops=[_op_to_pb(o) for o in s.ops])
    if s.reqs:
        m.batch.CopyFrom(_batch_to_pb(s.reqs))
    return m


def step_from_pb(m: wpb.StepRequest) -> StepRequest:
    """Raises ``ValueError`` naming the field when the columns do not describe one batch."""
    return StepRequest(step_id=m.step_id, ops=[_op_from_pb(o) for o in m.ops], reqs=_batch_from_pb(m.batch))


def _batch_to_pb(reqs: list[ReqInput]) -> wpb.ReqColumns:
    """One column per field: the per-request cost is a few list appends, not a submessage."""
    table: dict[SamplingParams, int] = {}  # the batch's distinct parameters (usually one)
    sampling_index = [table.setdefault(r.sampling, len(table)) for r in reqs]
    return wpb.ReqColumns(
        request_ids=[r.request_id for r in reqs],
        rows=[r.row for r in reqs],
        start_pos=[r.start_pos for r in reqs],
        num_input_ids=[len(r.input_ids) for r in reqs],
        input_ids=list(chain.from_iterable(r.input_ids for r in reqs)),
        num_prefix_slots=[len(r.prefix_slots) for r in reqs],
        prefix_slots=list(chain.from_iterable(r.prefix_slots for r in reqs)),
        num_new_slots=[len(r.new_slots) for r in reqs],
        new_slots=list(chain.from_iterable(r.new_slots for r in reqs)),
        mamba_slots=[-1 if r.mamba_slot is None else r.mamba_slot for r in reqs],
        flags=[
            _SAMPLE * r.sample
            | _USE_LAST_SAMPLE * r.use_last_sample
            | _RETURN_LOGPROBS * r.return_logprobs
            | _MASK_FOLLOWS * r.mask_follows
            | _WORKER_DRAFTS * r.worker_drafts
            | _PROMPT_LOGPROBS * r.prompt_logprobs
            for r in reqs
        ],
        seeds=[r.seed for r in reqs],
        output_index=[r.output_index for r in reqs],
        top_logprobs=[r.top_logprobs for r in reqs],
        sampling_table=[sampling_to_pb(p) for p in table],
        sampling_index=sampling_index,
        extras=[
            wpb.ReqExtra(
                index=i, history_ids=r.history_ids, token_bitmask=r.token_bitmask or b"", trace_context=r.trace_context,
                next_prompt_id=r.next_prompt_id,
            )
            for i, r in enumerate(reqs)
            if r.history_ids or r.token_bitmask or r.trace_context or r.next_prompt_id is not None
        ],
        num_draft=[r.num_draft for r in reqs] if any(r.num_draft for r in reqs) else [],
    )


def _batch_from_pb(m: wpb.ReqColumns) -> list[ReqInput]:
    """Check the columns' shape (counts, sums, flag bits, indices); what they mean against the
    worker's pools is ``check_step``'s job."""
    n = len(m.rows)
    for name in _PER_REQUEST:
        if len(getattr(m, name)) != n:
            raise ValueError(f"batch.{name} has {len(getattr(m, name))} entries for {n} requests (batch.rows)")
    flags = list(m.flags)
    bad = next((i for i, f in enumerate(flags) if f & ~_ALL_FLAGS), None)
    if bad is not None:
        raise ValueError(f"batch.flags[{bad}]={flags[bad]} sets bits outside ReqFlag ({_ALL_FLAGS:#x})")
    both = _PROMPT_LOGPROBS | _USE_LAST_SAMPLE
    bad = next((i for i, f in enumerate(flags) if f & both == both), None)
    if bad is not None:
        raise ValueError(
            f"batch.flags[{bad}]={flags[bad]}: PROMPT_LOGPROBS scores a prefill chunk's input ids, and "
            "USE_LAST_SAMPLE has none"
        )
    drafts = list(m.num_draft)
    if drafts and len(drafts) != n:
        raise ValueError(f"batch.num_draft has {len(drafts)} entries for {n} requests (batch.rows; or none)")
    table = [sampling_from_pb(p) for p in m.sampling_table]
    sampling_index = list(m.sampling_index)
    if sampling_index and max(sampling_index) >= len(table):
        bad = next(i for i, k in enumerate(sampling_index) if k >= len(table))
        raise ValueError(
            f"batch.sampling_index[{bad}]={sampling_index[bad]} is outside the sampling_table "
            f"({len(table)} entries)"
        )
    reqs = [
        ReqInput(
            request_id=rid,
            row=row,
            input_ids=ids,
            start_pos=start,
            new_slots=new,
            prefix_slots=prefix,
            mamba_slot=None if mamba < 0 else mamba,
            sample=bool(f & _SAMPLE),
            sampling=table[k],
            seed=seed,
            output_index=index,
            return_logprobs=bool(f & _RETURN_LOGPROBS),
            top_logprobs=top,
            use_last_sample=bool(f & _USE_LAST_SAMPLE),
            mask_follows=bool(f & _MASK_FOLLOWS),
            worker_drafts=bool(f & _WORKER_DRAFTS),
            prompt_logprobs=bool(f & _PROMPT_LOGPROBS),
        )
        for rid, row, start, ids, prefix, new, mamba, f, k, seed, index, top in zip(
            m.request_ids, m.rows, m.start_pos,
            _split(m.input_ids, m.num_input_ids, "input_ids"),
            _split(m.prefix_slots, m.num_prefix_slots, "prefix_slots"),
            _split(m.new_slots, m.num_new_slots, "new_slots"),
            m.mamba_slots, flags, sampling_index, m.seeds, m.output_index, m.top_logprobs,
            strict=True,
        )
    ]
    last = -1
    for k, e in enumerate(m.extras):
        if not last < e.index < n:
            raise ValueError(
                f"batch.extras: index {e.index} after {last} (indices must increase, each in [0, {n}))"
            )
        last = e.index
        r = reqs[e.index]
        r.history_ids = list(e.history_ids)
        r.token_bitmask = e.token_bitmask or None
        r.trace_context = dict(e.trace_context)
        if e.HasField("next_prompt_id"):
            if not r.prompt_logprobs or r.sample:
                raise ValueError(
                    f"batch.extras[{k}].next_prompt_id: request {e.index} must set PROMPT_LOGPROBS and not "
                    "SAMPLE (the token after a sampled position is the sample, not a prompt token)"
                )
            r.next_prompt_id = e.next_prompt_id
    for r, d in zip(reqs, drafts, strict=False):  # range checks against the inputs: check_step
        r.num_draft = d
    return reqs


def _split(flat: Sequence[int], counts: Sequence[int], name: str) -> list[list[int]]:
    """``flat`` cut into consecutive lists of ``counts[i]`` entries (the ``name`` column)."""
    ends = list(accumulate(counts))
    total = ends[-1] if ends else 0
    if total != len(flat):
        raise ValueError(f"batch.{name} has {len(flat)} entries but batch.num_{name} adds up to {total}")
    values = list(flat)
    return [values[a:b] for a, b in pairwise([0, *ends])]


def late_masks_to_pb(m: LateMasks) -> wpb.StepRequest:
    return wpb.StepRequest(late_masks=wpb.LateMasks(step_id=m.step_id, token_bitmasks=m.masks))


def late_masks_from_pb(m: wpb.StepRequest) -> LateMasks | None:
    """The late masks a message carries, or None for an ordinary step."""
    if not m.HasField("late_masks"):
        return None
    return LateMasks(m.late_masks.step_id, list(m.late_masks.token_bitmasks))


def result_to_pb(r: StepResult) -> wpb.StepResult:
    outs = r.outputs
    m = wpb.StepResult(
        step_id=r.step_id,
        sampled_rows=[o.row for o in outs],
        token_ids=[o.token_id for o in outs],
        logprobs=[
            wpb.SampleLogprob(index=i, logprob=logprob_to_pb(o.logprob))
            for i, o in enumerate(outs)
            if o.logprob is not None
        ],
        ops_done=r.ops_done,
        forward_s=r.forward_s,
        sample_s=r.sample_s,
        idle_s=r.idle_s,
        num_slots=r.num_slots,
        num_mamba_slots=r.num_mamba_slots,
        kv_committed_bytes=r.kv_committed_bytes,
        mamba_committed_bytes=r.mamba_committed_bytes,
        jobs=[wpb.JobResult(job_id=j.job_id, ok=j.ok, pages=j.pages) for j in r.jobs],
    )
    if r.prompt:
        _prompt_to_pb(r.prompt, m)
    return m


def _prompt_to_pb(scores: list[PromptScores], m: wpb.StepResult) -> None:
    """``StepResult.prompt`` into ``m``'s packed ``prompt_*`` columns."""
    lps = [lp for s in scores for lp in s.logprobs]
    m.prompt_counts.extend(len(s.logprobs) for s in scores)
    m.prompt_num_top.extend(len(s.logprobs[0].top) if s.logprobs else 0 for s in scores)
    m.prompt_token_ids.extend(lp.token_id for lp in lps)
    m.prompt_logprobs.extend(lp.logprob for lp in lps)
    m.prompt_ranks.extend(r for s in scores for r in s.ranks)
    m.prompt_top_ids.extend(t for lp in lps for t, _ in lp.top)
    m.prompt_top_logprobs.extend(v for lp in lps for _, v in lp.top)


def _prompt_from_pb(m: wpb.StepResult) -> list[PromptScores]:
    """The ``prompt_*`` columns back as ``PromptScores``; ``ValueError`` naming the column when they
    do not add up."""
    counts, tops = list(m.prompt_counts), list(m.prompt_num_top)
    if len(tops) != len(counts):
        raise ValueError(f"result prompt_num_top has {len(tops)} entries for {len(counts)} prompt_counts")
    total, alternatives = sum(counts), sum(c * t for c, t in zip(counts, tops, strict=True))
    for name, want in (("prompt_token_ids", total), ("prompt_logprobs", total), ("prompt_ranks", total),
                       ("prompt_top_ids", alternatives), ("prompt_top_logprobs", alternatives)):  # fmt: skip
        if len(getattr(m, name)) != want:
            raise ValueError(f"result {name} has {len(getattr(m, name))} entries; prompt_counts and "
                             f"prompt_num_top call for {want}")  # fmt: skip
    ids, values, ranks = list(m.prompt_token_ids), list(m.prompt_logprobs), list(m.prompt_ranks)
    top_ids, top_values = list(m.prompt_top_ids), list(m.prompt_top_logprobs)
    out, at, top_at = [], 0, 0
    for c, t in zip(counts, tops, strict=True):
        lps = []
        for j in range(at, at + c):
            top = tuple(zip(top_ids[top_at : top_at + t], top_values[top_at : top_at + t], strict=True))
            lps.append(TokenLogprob(ids[j], values[j], top))
            top_at += t
        out.append(PromptScores(tuple(lps), tuple(ranks[at : at + c])))
        at += c
    return out


def result_from_pb(m: wpb.StepResult) -> StepResult:
    """Raises ``ValueError`` naming the field when the sample columns do not line up."""
    rows, tokens = m.sampled_rows, m.token_ids
    if len(rows) != len(tokens):
        raise ValueError(f"result token_ids has {len(tokens)} entries for {len(rows)} sampled_rows")
    outs = [ReqOutput(row, token) for row, token in zip(rows, tokens, strict=True)]
    last = -1
    for e in m.logprobs:
        if not last < e.index < len(outs):
            raise ValueError(
                f"result logprobs: index {e.index} after {last} (indices must increase, each in [0, {len(outs)}))"
            )
        last = e.index
        outs[e.index] = ReqOutput(rows[e.index], tokens[e.index], logprob_from_pb(e.logprob))
    return StepResult(
        step_id=m.step_id,
        outputs=outs,
        ops_done=m.ops_done,
        forward_s=m.forward_s,
        sample_s=m.sample_s,
        idle_s=m.idle_s,
        num_slots=m.num_slots,
        num_mamba_slots=m.num_mamba_slots,
        kv_committed_bytes=m.kv_committed_bytes,
        mamba_committed_bytes=m.mamba_committed_bytes,
        jobs=[JobResult(j.job_id, j.ok, j.pages) for j in m.jobs],
        prompt=_prompt_from_pb(m),
    )


def info_to_pb(i: WorkerInfo) -> wpb.WorkerInfo:
    return wpb.WorkerInfo(
        model=i.model,
        architecture=i.architecture,
        fingerprint=i.fingerprint,
        vocab_size=i.vocab_size,
        context_length=i.context_length,
        eos_token_ids=list(i.eos_token_ids),
        num_slots=i.num_slots,
        bytes_per_slot=i.bytes_per_slot,
        page_size=i.page_size,
        num_rows=i.num_rows,
        num_mamba_slots=i.num_mamba_slots,
        bytes_per_mamba_slot=i.bytes_per_mamba_slot,
        dtype=i.dtype,
        hybrid=i.hybrid,
        device=i.device,
        max_slots=i.max_slots,
        max_mamba_slots=i.max_mamba_slots,
        slot_granularity=i.slot_granularity,
        mamba_slot_granularity=i.mamba_slot_granularity,
        pool_page_bytes=i.pool_page_bytes,
        elastic=i.elastic,
        host_pages=i.host_pages,
        host_page_tokens=i.host_page_tokens,
        kv_layout=i.kv_layout,
        l3=i.l3,
        host_states=i.host_states,
        state_layout=i.state_layout,
        tp_size=i.tp_size,
        draft_model=i.draft_model,
    )


def info_from_pb(m: wpb.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        model=m.model,
        architecture=m.architecture,
        fingerprint=m.fingerprint,
        vocab_size=m.vocab_size,
        context_length=m.context_length,
        eos_token_ids=tuple(m.eos_token_ids),
        num_slots=m.num_slots,
        bytes_per_slot=m.bytes_per_slot,
        page_size=m.page_size,
        num_rows=m.num_rows,
        num_mamba_slots=m.num_mamba_slots,
        bytes_per_mamba_slot=m.bytes_per_mamba_slot,
        dtype=m.dtype,
        hybrid=m.hybrid,
        device=m.device,
        max_slots=m.max_slots,
        max_mamba_slots=m.max_mamba_slots,
        slot_granularity=m.slot_granularity,
        mamba_slot_granularity=m.mamba_slot_granularity,
        pool_page_bytes=m.pool_page_bytes,
        elastic=m.elastic,
        host_pages=m.host_pages,
        host_page_tokens=m.host_page_tokens,
        kv_layout=m.kv_layout,
        l3=m.l3,
        host_states=m.host_states,
        state_layout=m.state_layout,
        tp_size=m.tp_size or 1,
        draft_model=m.draft_model,
    )
