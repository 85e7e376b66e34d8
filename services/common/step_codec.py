"""Conversion between ``strata.worker.v1`` messages and ``services.common.step`` types.

Used only at the gRPC edge: by the scheduler's gRPC worker link and by the worker servicer.
"""

from __future__ import annotations

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


def step_to_pb(s: StepRequest) -> wpb.StepRequest:
    reqs = [
        wpb.ReqInput(
            request_id=r.request_id,
            row=r.row,
            input_ids=r.input_ids,
            start_pos=r.start_pos,
            prefix_slots=r.prefix_slots,
            new_slots=r.new_slots,
            mamba_slot=-1 if r.mamba_slot is None else r.mamba_slot,
            sample=r.sample,
            sampling=sampling_to_pb(r.sampling),
            seed=r.seed,
            output_index=r.output_index,
            history_ids=r.history_ids,
            token_bitmask=r.token_bitmask or b"",
            return_logprobs=r.return_logprobs,
            top_logprobs=r.top_logprobs,
            use_last_sample=r.use_last_sample,
            trace_context=r.trace_context,
            mask_follows=r.mask_follows,
        )
        for r in s.reqs
    ]
    return wpb.StepRequest(step_id=s.step_id, ops=[_op_to_pb(o) for o in s.ops], reqs=reqs)


def step_from_pb(m: wpb.StepRequest) -> StepRequest:
    reqs = [
        ReqInput(
            request_id=r.request_id,
            row=r.row,
            input_ids=list(r.input_ids),
            start_pos=r.start_pos,
            new_slots=list(r.new_slots),
            prefix_slots=list(r.prefix_slots),
            mamba_slot=None if r.mamba_slot < 0 else r.mamba_slot,
            sample=r.sample,
            sampling=sampling_from_pb(r.sampling),
            seed=r.seed,
            output_index=r.output_index,
            history_ids=list(r.history_ids),
            token_bitmask=r.token_bitmask or None,
            return_logprobs=r.return_logprobs,
            top_logprobs=r.top_logprobs,
            use_last_sample=r.use_last_sample,
            trace_context=dict(r.trace_context),
            mask_follows=r.mask_follows,
        )
        for r in m.reqs
    ]
    return StepRequest(step_id=m.step_id, ops=[_op_from_pb(o) for o in m.ops], reqs=reqs)


def late_masks_to_pb(m: LateMasks) -> wpb.StepRequest:
    return wpb.StepRequest(late_masks=wpb.LateMasks(step_id=m.step_id, token_bitmasks=m.masks))


def late_masks_from_pb(m: wpb.StepRequest) -> LateMasks | None:
    """The late masks a message carries, or None for an ordinary step."""
    if not m.HasField("late_masks"):
        return None
    return LateMasks(m.late_masks.step_id, list(m.late_masks.token_bitmasks))


def result_to_pb(r: StepResult) -> wpb.StepResult:
    outs = []
    for o in r.outputs:
        out = wpb.ReqOutput(request_id=o.request_id, row=o.row, token_id=o.token_id)
        if o.logprob is not None:
            out.logprob.CopyFrom(logprob_to_pb(o.logprob))
        outs.append(out)
    return wpb.StepResult(
        step_id=r.step_id,
        outputs=outs,
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


def result_from_pb(m: wpb.StepResult) -> StepResult:
    outs = [
        ReqOutput(
            o.request_id, o.row, o.token_id, logprob_from_pb(o.logprob) if o.HasField("logprob") else None
        )
        for o in m.outputs
    ]
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
    )
