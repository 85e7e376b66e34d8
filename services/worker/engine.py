"""The worker's model engine: one ``StepRequest`` in, one ``StepResult`` out.

A step runs in four stages, and nothing is mutated until the first one has passed:

1. **validate** every op and request (``StepError`` naming the request and field otherwise);
2. **ops** in order: ``MambaCopy``, ``MambaReset``, ``ReleaseRow``, ``PoolResize`` (commits or
   releases pool memory; the pools' tensors never move, so the forward sees the same buffers),
   ``HostBackup`` / ``HostLoad`` (device ↔ host pool), ``StateBackup`` / ``StateLoad`` (device
   Mamba pool ↔ host state pool, hybrid models) and ``L3Put`` / ``L3Get`` (host pools ↔ kvstore,
   started here and finished after sampling; see ``host_ops``);
3. **forward** over all requests at once (prefill chunks with or without a cached prefix and
   decodes mixed): ``prefix_slots`` and ``new_slots`` are written into each request's row of
   ``req_to_token``, then the model stores the new KV and returns logits;
4. **sample** one token for each request with ``sample=True``; a prefill chunk with
   ``prompt_logprobs`` also gets logits for every position, scored against the prompt's next
   tokens (``scoring.py``) before the sampler sees its last row.

Tensor parallelism (``tp``, see ``services.worker.tp``): every rank runs stages 1-3 on its shard
with the same indices; rank 0 alone samples (late grammar masks reach it only) and broadcasts the
ids, which the other ranks record as the next decode's input; host-op results are the minimum over
the ranks (a page one rank could not fetch is missing for all).

Per-row state kept between steps (dropped by ``ReleaseRow``): the last sampled token (the input
of a ``use_last_sample`` decode in overlap scheduling), how many positions the row holds, and the
token history for penalties (``history_ids`` from the row's first step, plus every token sampled
for the row; it must therefore list the whole prompt and prior output).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import torch

from kernels.linear import (
    BATCH_MIN_ROWS,
    BATCH_ROWS,
    NATIVE_ROWS,
    STEPS,
    batch_timing,
    few_rows,
    mark_native,
    native_timing,
    pack,
    pack_batches,
    packed_timing,
    unpack,
    unpack_batches,
)
from services.common.step import (
    MAX_TOP_LOGPROBS,
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
    StepError,
    StepRequest,
    StepResult,
    TokenLogprob,
    WorkerInfo,
)
from services.worker.attention import AttentionMeta, attention_backend
from services.worker.batch import BatchInput, ForwardBatch, ForwardContext, int64_tensor
from services.worker.cuda_graphs import DecodeGraphs, cuda_capture
from services.worker.draft import Drafter, DraftModel
from services.worker.engine_config import DTYPES, EngineConfig
from services.worker.host_cache import HostPool
from services.worker.host_malloc import keep_large_blocks_on_heap
from services.worker.host_ops import HostOpRunner, L3Port
from services.worker.host_states import HostStatePool
from services.worker.kv_budget import auto_kv_bytes
from services.worker.loader import LoadedModel, fingerprint, load_model
from services.worker.models.linear_attn import StateTrace
from services.worker.models.qwen3 import DenseConfig
from services.worker.models.registry import CausalLM
from services.worker.pool_backing import BackingChoice, choose_backing
from services.worker.pools import KVPool, ReqToTokenTable
from services.worker.sampler import SamplerInput, sample
from services.worker.scoring import sample_rows, score_prompts, want_logits
from services.worker.step_check import check_step, decode_bitmask
from services.worker.step_threads import StepCost, StepThreads
from services.worker.tp import SINGLE, Tp

if TYPE_CHECKING:
    from services.worker.mamba_pool import MambaPool

__all__ = ["Engine", "EngineConfig"]
log = logging.getLogger(__name__)
PACKED_GAIN = 1.1  # packed_weights=auto: how much faster the packed copies must measure to be kept
PREFILL_TIMING_ROWS = 64  # packed_weights=auto: the rows of the pass that stands for a prefill chunk
BATCH_TIMING_ROWS = 32  # packed_weights=auto: the rows of the pass that stands for a decode batch
# native_linear=auto: the row count each timed pass stands for. MKL's sgemm changes kernels with the
# row count, so one count's gain does not carry to the others: on the bench model here a pass at 4
# rows took MKL 1.4x its 3-row time and ran ~5 % faster native, while at 2-3 and at 6-8 rows the
# native kernel was 4-20 % slower (timing only 1 and 4 rows had turned it on for 2-8).
NATIVE_TIMED: dict[int, tuple[int, ...]] = {1: (1,), 2: (2, 3), 4: (4,), 8: (5, 6, 7, 8)}


class Engine:
    """Owns the weights and the device pools; executes steps. Not thread-safe (one step at a time)."""

    def __init__(
        self, model_dir: Path | str, cfg: EngineConfig | None = None, l3: L3Port | None = None, tp: Tp = SINGLE
    ) -> None:
        """``l3``: the kvstore shards, for ``L3Put`` / ``L3Get`` (needs a host pool). ``tp``: this
        engine is one rank of a tensor-parallel group: it holds its shard of the weights and of
        every pool, runs every step the group runs, and only rank 0 samples (``step``)."""
        cfg = cfg or EngineConfig()
        model_dir = Path(model_dir)
        device = torch.device(cfg.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        dtype = DTYPES[cfg.dtype]
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if device.type == "cpu":
            keep_large_blocks_on_heap()
        loaded = load_model(model_dir, dtype=dtype, device=str(device), tp=tp)
        self.tp = tp
        model = cast(CausalLM, loaded.model)
        context = cfg.max_context or int(loaded.hf_config["max_position_embeddings"])
        self.cfg = cfg
        self.device = device
        self.model = model
        self._pack_weights()
        self._pack_batches()
        self._choose_native_linear()
        backing = choose_backing(device)
        slot_bytes = self._make_pools(dtype, context, backing, l3)
        self.info = self._worker_info(model_dir, loaded, context, slot_bytes, backing)
        self.attn = attention_backend(cfg.attention, self.kv, self.req_to_token)  # chosen once, here
        self._ctx = ForwardContext(self.attn, self.mamba)
        self.draft = self._drafter(model_dir, loaded, dtype)
        self.graphs = self._decode_graphs()
        self._threads = self._step_threads(loaded)
        self._last_sample: dict[int, int] = {}
        self._row_len: dict[int, int] = {}
        self._history: dict[int, list[int]] = {}
        self._last_end: float | None = None

    def _pack_weights(self) -> None:
        """oneDNN-packed copies of the linear weights (``kernels.linear.pack``), for decode steps and
        for prefill chunks: with ``packed_weights`` on, both; auto, each where a pass over the weights
        measured at least ``PACKED_GAIN`` times faster than MKL's: at 2 rows (a small decode batch)
        for decode steps, at ``PREFILL_TIMING_ROWS`` rows over all but the LM head (which a prefill
        multiplies at its sampled rows only) for prefill chunks. Where decode steps keep the copies,
        prefill chunks take them unless they measured slower: the memory is spent either way, and
        on the bench model that pass measured 1.11-1.53x from one start to the next for a 1.17x
        faster prefill step. CPU and fp32 only."""
        mode = self.cfg.packed_weights
        if mode == "off" or self.device.type != "cpu" or self.cfg.dtype != "float32":
            return
        if not torch.backends.mkldnn.is_available():
            log.info("linear weights: MKL (this torch has no oneDNN)")
            return
        model = cast(torch.nn.Module, self.model)
        added = pack(model)
        if not added:  # no fp32 linear layer of ours: nothing to choose between
            return
        steps, how = STEPS, "on"
        if mode == "auto":
            head = getattr(model, "lm_head", None)
            body = (head,) if head is not None else ()
            rows = PREFILL_TIMING_ROWS
            passes = {"decode": (2, packed_timing(model)), "prefill": (rows, packed_timing(model, rows, skip=body))}
            how = "a pass over them at " + "; ".join(
                f"{rows} rows: MKL {mkl * 1e3:.1f} ms, packed {p * 1e3:.1f} ms" for rows, (mkl, p) in passes.values()
            )
            gains = {step: mkl / max(p, 1e-9) for step, (_, (mkl, p)) in passes.items()}
            steps = packed_steps(gains["decode"], gains["prefill"])
            if not steps:
                unpack(model)
                log.info("linear weights: MKL for every step (%s)", how)
                return
            pack(model, steps)
        log.info("linear weights: oneDNN-packed copies for %s steps, +%.0f MiB (%s)",
                 " and ".join(sorted(steps)), added / (1 << 20), how)  # fmt: skip

    def _pack_batches(self) -> None:
        """MKL-packed copies of the linear weights for decode steps of more than 8 rows
        (``kernels.linear.pack_batches``): MKL's ``sgemm`` repacks each weight on every call, and at
        a decode batch that copy is a large part of the product (a quarter of a 64-row decode step
        of the bench model, in ``perf``). With ``packed_weights`` on, always; auto, where a pass over
        the weights at ``BATCH_TIMING_ROWS`` rows measured at least ``PACKED_GAIN`` times faster with
        them than as a decode step multiplies without. CPU and fp32 only."""
        mode = self.cfg.packed_weights
        if mode == "off" or self.device.type != "cpu" or self.cfg.dtype != "float32":
            return
        model = cast(torch.nn.Module, self.model)
        added = pack_batches(model)
        if not added:
            return
        how = "on"
        if mode == "auto":
            without, with_ = batch_timing(model, BATCH_TIMING_ROWS)
            how = f"a pass at {BATCH_TIMING_ROWS} rows: without {without * 1e3:.1f} ms, with {with_ * 1e3:.1f} ms"
            if without < PACKED_GAIN * with_:
                unpack_batches(model)
                log.info("linear weights: no MKL-packed copies for decode batches (%s)", how)
                return
        log.info("linear weights: MKL-packed copies (for %d rows) for decode steps over %d rows, +%.0f MiB (%s)",
                 BATCH_ROWS, BATCH_MIN_ROWS, added / (1 << 20), how)  # fmt: skip

    def _step_threads(self, loaded: LoadedModel) -> StepThreads | None:
        """CPU: forwards of fewer than ``serial_step_mflops`` MFLOPs run on one thread
        (``step_threads.py``); None where every forward uses every thread."""
        threads = torch.get_num_threads()
        if self.device.type != "cpu" or not self.cfg.serial_step_mflops or threads < 2:
            return None
        heads = int(loaded.hf_config.get("num_attention_heads", 0)) // self.tp.size
        model = self.model
        cost = StepCost.of(cast(torch.nn.Module, model), heads, model.head_dim, model.num_kv_layers)
        below = int(self.cfg.serial_step_mflops * 1e6)
        log.info("forwards under %g MFLOPs run on one thread of %d (a token: %.1f MFLOPs, the weights' read: %.0f)",
                 self.cfg.serial_step_mflops, threads, cost.token / 1e6, cost.body_read / 1e6)  # fmt: skip
        return StepThreads(cost, threads, below)

    def _choose_native_linear(self) -> None:
        """The native 8-lane kernel for decode steps of 1-8 rows (``kernels.linear.mark_native``):
        with ``native_linear`` on, or auto for the row counts whose timed pass over the weights
        (``NATIVE_TIMED``) measured at least ``PACKED_GAIN`` times faster with it than as a decode
        step multiplies without it (the packed copies where kept, else MKL). CPU and fp32 only."""
        mode = self.cfg.native_linear
        if mode == "off" or self.device.type != "cpu" or self.cfg.dtype != "float32":
            return
        model = cast(torch.nn.Module, self.model)
        if not mark_native(model):
            return
        rows, how = NATIVE_ROWS, "on"
        if mode == "auto":
            passes = {n: native_timing(model, n) for n in NATIVE_TIMED}
            how = "; ".join(
                f"{n} row(s): without {a * 1e3:.1f} ms, with {b * 1e3:.1f} ms" for n, (a, b) in passes.items()
            )
            rows = frozenset(r for n, (a, b) in passes.items() if a >= PACKED_GAIN * b for r in NATIVE_TIMED[n])
            mark_native(model, rows)
        if rows:
            log.info("linear layers: the native kernel for decode steps of %s rows (%s)", sorted(rows), how)
        else:
            log.info("linear layers: no native kernel (%s)", how)

    def _make_pools(self, dtype: torch.dtype, context: int, backing: BackingChoice, l3: L3Port | None) -> int:
        """The KV pool and slot table, the Mamba pool of a hybrid model, the host tier; returns the
        bytes of one slot the scheduler plans with (the target's KV and, with MTP, the head's)."""
        cfg, model, device, tp = self.cfg, self.model, self.device, self.tp
        kv_max, mamba_max = cfg.kv_max_bytes, cfg.mamba_max_slots
        if not backing.elastic:
            if kv_max or mamba_max:
                log.warning("pools cannot grow beyond their starting size on %s: %s", device, backing.reason)
            kv_max = mamba_max = 0  # a fixed allocation of the whole reservation would be wasted
        target_slot = KVPool.slot_bytes(model.num_kv_layers, model.num_kv_heads, model.head_dim, dtype)
        # A drafter keeps KV at the target's slots in a pool of its own (services/worker/draft.py): the
        # KV budget and the bytes per slot the scheduler plans with cover both pools.
        slot_bytes = target_slot + _draft_slot_bytes(cfg, model, dtype)
        kv_bytes = cfg.kv_cache_bytes or auto_kv_bytes(device, cfg.kv_mem_fraction, slot_bytes, cfg.max_rows * context)
        kv_bytes = tp.agree_min([kv_bytes])[0]  # the same slot indices on every rank
        self.kv = KVPool.from_budget(
            kv_bytes * target_slot // slot_bytes, model.num_kv_layers, model.num_kv_heads, model.head_dim, dtype,
            device, cfg.page_size, max_bytes=kv_max * target_slot // slot_bytes, backing=backing,
        )  # fmt: skip
        if cfg.kv_populate and device.type == "cpu":
            start = time.perf_counter()
            written = self.kv.populate(threads=max(1, min(8, torch.get_num_threads())))
            log.info("KV pool: %.0f MiB written at start in %.2f s", written / 2**20, time.perf_counter() - start)
        self.req_to_token = ReqToTokenTable(cfg.max_rows, context, device)
        self.mamba: MambaPool | None = None
        spec = getattr(model, "mamba_spec", None)
        if spec is not None:
            from services.worker.mamba_pool import MambaPool as Pool  # only hybrid models need it

            self.mamba = Pool(cfg.initial_mamba_slots, spec, device, max_slots=mamba_max or None, backing=backing)
        self.host: HostOpRunner | None = None
        if cfg.host_cache_bytes:
            self.host = _host_tier(cfg, model, self.mamba, dtype, device, l3, tp)
        elif l3 is not None:
            raise ValueError("an L3 connection needs a host pool (host_cache_bytes > 0)")
        return slot_bytes

    def _worker_info(
        self, model_dir: Path, loaded: LoadedModel, context: int, slot_bytes: int, backing: BackingChoice
    ) -> WorkerInfo:
        """What the scheduler plans with: the model, the pools' sizes and granularity, the tiers."""
        cfg, kv, mamba, host, tp = self.cfg, self.kv, self.mamba, self.host, self.tp
        host_states = host.states if host else None
        return WorkerInfo(
            model=model_dir.resolve().name,
            architecture=loaded.architecture,
            fingerprint=fingerprint(model_dir),
            vocab_size=self.model.vocab_size,
            context_length=context,
            eos_token_ids=loaded.eos_token_ids,
            num_slots=kv.num_slots,
            bytes_per_slot=slot_bytes,
            page_size=cfg.page_size,
            num_rows=cfg.max_rows,
            num_mamba_slots=mamba.num_slots if mamba else 0,
            bytes_per_mamba_slot=mamba.bytes_per_slot if mamba else 0,
            dtype=cfg.dtype,
            hybrid=mamba is not None,
            device=str(self.device),
            max_slots=kv.max_slots,
            max_mamba_slots=mamba.max_slots if mamba else 0,
            slot_granularity=kv.slot_granularity,
            mamba_slot_granularity=mamba.slot_granularity if mamba else 0,
            pool_page_bytes=backing.page_bytes,
            elastic=backing.elastic,
            host_pages=host.pool.num_pages if host else 0,
            host_page_tokens=cfg.host_page_tokens if host else 0,
            kv_layout=f"{host.pool.layout}/tp0of{tp.size}" if host else "",
            l3=host is not None and host.l3 is not None,
            host_states=host_states.num_states if host_states else 0,
            state_layout=f"{host_states.layout}/tp0of{tp.size}" if host_states else "",
            tp_size=tp.size,
            draft_model="mtp" if cfg.mtp else Path(cfg.draft_model).resolve().name if cfg.draft_model else "",
        )

    def _drafter(self, model_dir: Path, loaded: LoadedModel, dtype: torch.dtype) -> Drafter | None:
        """The draft model's or the MTP head's drafter (``--speculative-draft-model`` / ``--speculative-mtp``)."""
        cfg = self.cfg
        if (cfg.draft_model or cfg.mtp) and self.tp.size > 1:
            raise ValueError("speculative decoding: not supported with tensor parallelism")
        if cfg.draft_model:
            return DraftModel(Path(cfg.draft_model), dtype, self.device, self.model.vocab_size, self.kv,
                              self.req_to_token, cfg.attention)  # fmt: skip
        if cfg.mtp:
            from services.worker.mtp import MtpDrafter  # only Qwen3-Next checkpoints have the head

            return MtpDrafter(model_dir, loaded.model, dtype, self.device, self.kv, self.req_to_token, cfg.attention)
        return None

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for decode steps (cuda_graphs.py) where they apply: a CUDA device, the Triton
        attention backend, a model without Mamba state, one rank, ``cuda_graph_max_batch`` > 0."""
        cfg = self.cfg
        if not (cfg.cuda_graph_max_batch and self.device.type == "cuda" and self.attn.graphs_replay_decodes
                and self.mamba is None and self.tp.size == 1):  # fmt: skip
            return None
        max_batch = min(cfg.cuda_graph_max_batch, cfg.max_rows)
        return DecodeGraphs(self.model, self._ctx, self.device, max_batch, cuda_capture(torch.cuda.graph_pool_handle()))

    # -- public ----------------------------------------------------------------------------------

    def step(self, req: StepRequest, late_masks: Callable[[], LateMasks] | None = None) -> StepResult:
        """Validate, run ops, forward and sample. ``StepError`` leaves every pool untouched.

        Requests with ``mask_follows`` get their bitmasks from ``late_masks`` (blocking) after the
        forward: the scheduler sends them once the previous step's tokens are known (overlap with
        grammars). The wait counts as idle time. Bad late masks raise ``StepError`` after the
        forward (its KV is written to slots the scheduler already owns; nothing else changes).
        """
        start = time.perf_counter()
        idle = 0.0 if self._last_end is None else start - self._last_end
        try:
            with torch.inference_mode(), few_rows(_decodes_only(req.reqs)):
                result = self._step(req, late_masks)
        finally:
            self._last_end = time.perf_counter()
        result.idle_s += idle
        return result

    def forward_logits(self, req: StepRequest) -> torch.Tensor:
        """Like ``step`` without sampling: fp32 logits ``[T, vocab]`` for every new token, in order.

        KV and Mamba state are written exactly as ``step`` would (so later steps can reuse them).
        """
        with torch.inference_mode(), few_rows(_decodes_only(req.reqs)):
            self._validate(req)
            self._run_ops(req)
            if not req.reqs:
                return torch.empty((0, self.info.vocab_size), dtype=torch.float32, device=self.device)
            inp = self._batch_input(req.reqs)
            if self._threads is not None:
                self._threads.fit(inp)
            if self.draft is not None:
                self.draft.propose(req.reqs, inp)
            logits, hidden = self._run_target(inp, all_logits=True)
            if self.draft is not None:
                self.draft.finish(req.reqs, inp, Counter(), hidden)
            return logits.float()

    # -- stages ----------------------------------------------------------------------------------

    def _step(self, req: StepRequest, late_masks: Callable[[], LateMasks] | None) -> StepResult:
        masks = self._validate(req)
        late = [i for i, r in enumerate(req.reqs) if r.mask_follows]
        if late and late_masks is None and self.tp.rank == 0:
            raise StepError(f"step {req.step_id}: mask_follows is set but no late masks can arrive")
        self._run_ops(req)
        result = StepResult(
            step_id=req.step_id,
            ops_done=len(req.ops),
            num_slots=self.kv.num_slots,
            num_mamba_slots=self.mamba.num_slots if self.mamba else 0,
            kv_committed_bytes=self._kv_committed_bytes(),
            mamba_committed_bytes=self.mamba.committed_bytes if self.mamba else 0,
        )
        if not req.reqs:
            if self.host is not None:
                result.jobs = self._finish_host()
            return result
        drafting = [r for r in req.reqs if r.num_draft]
        if self.draft is None and any(r.worker_drafts for r in drafting):
            raise StepError(f"step {req.step_id}: worker_drafts is set but this worker has no draft model")
        t0 = time.perf_counter()
        # Hybrid rows verifying drafts: the pass records their states after each token, to drop the
        # rejected ones by taking the state after the last kept token.
        trace = StateTrace(frozenset(cast(int, r.mamba_slot) for r in drafting)) if drafting and self.mamba else None
        inp = self._batch_input(req.reqs)
        if self._threads is not None:
            self._threads.fit(inp)
        if self.draft is not None:  # its KV follows the target's; the drafts it owes are written
            self.draft.propose(req.reqs, inp)
        if self.mamba is not None:
            self.mamba.tracing = trace
        try:
            logits, hidden = self._run_target(inp, all_logits=False)
        finally:
            if self.mamba is not None:
                self.mamba.tracing = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # so forward_s measures the forward, not the launch
        t1 = time.perf_counter()
        # Samples rank 0 shares with the followers: one per sampling request, or with drafts up to
        # 1 + num_draft each (the kept ones, padded with -1).
        n = sum(1 + r.num_draft for r in req.reqs if r.sample)
        if any(r.prompt_logprobs for r in req.reqs):  # scoring chunks brought a row per position
            if self.tp.rank == 0:
                result.prompt = score_prompts(req.reqs, inp.want_logits, logits)
            logits = logits.index_select(0, int64_tensor(sample_rows(req.reqs, inp.want_logits), logits.device))
        kept = Counter[int]()  # tokens each drafting row kept
        if self.tp.rank:  # a follower: rank 0 samples and sends the ids
            ids = self.tp.share_ints(None, n)
            if ids is None:
                raise StepError(f"step {req.step_id}: rank 0 failed to sample it")
            if drafting:
                kept = self._record_verified(req.reqs, ids)
            else:
                self._record_samples(req.reqs, ids)
            t2 = time.perf_counter()
        else:
            try:
                if late:
                    assert late_masks is not None
                    self._apply_late_masks(req, late, late_masks(), masks)
                t2 = time.perf_counter()
                result.outputs = self._sample(req.reqs, masks, logits.float())
            except BaseException:
                if self.tp.size > 1:
                    self.tp.share_ints(None, n)  # the followers fail this step too
                raise
            if drafting:
                kept = Counter(o.row for o in result.outputs)
            if self.tp.size > 1:
                self.tp.share_ints(_padded_samples(req.reqs, result.outputs) if drafting else
                                   [o.token_id for o in result.outputs], n)  # fmt: skip
        t3 = time.perf_counter()
        if trace is not None:
            self._roll_back_states(drafting, trace, kept)
        if self.draft is not None:  # the drafter catches up with the kept tokens
            self.draft.finish(req.reqs, inp, kept, hidden)
        result.forward_s, result.sample_s = t1 - t0 + time.perf_counter() - t3, t3 - t2
        if self.host is not None:  # L3 transfers ran alongside the forward
            result.jobs = self._finish_host()
        result.idle_s = t2 - t1 if late else 0.0  # waiting for the late masks
        return result

    def _kv_committed_bytes(self) -> int:
        """The KV pool's committed bytes, and the drafter's pool's (counted in ``bytes_per_slot``)."""
        if self.draft is not None:
            return self.kv.committed_bytes + self.draft.pool.kv.committed_bytes
        return self.kv.committed_bytes

    def _finish_host(self) -> list[JobResult]:
        """The host jobs' results; with tensor parallelism, what every rank achieved (an L3 get
        counts the pages every rank fetched: a page one rank lacks is missing for all)."""
        assert self.host is not None
        jobs = self.host.finish()
        if self.tp.size == 1 or not jobs:
            return jobs
        counts = self.tp.agree_min([j.pages for j in jobs] + [int(j.ok) for j in jobs])
        k = len(jobs)
        return [JobResult(j.job_id, bool(ok), c) for j, c, ok in zip(jobs, counts[:k], counts[k:], strict=True)]

    def _apply_late_masks(
        self, req: StepRequest, late: list[int], lm: LateMasks, masks: list[torch.Tensor | None]
    ) -> None:
        if lm.step_id != req.step_id or len(lm.masks) != len(late):
            raise StepError(
                f"late masks for step {lm.step_id} ({len(lm.masks)} masks) do not match step "
                f"{req.step_id} ({len(late)} requests with mask_follows)"
            )
        for i, raw in zip(late, lm.masks, strict=True):
            masks[i] = decode_bitmask(raw, self.info.vocab_size, f"step {req.step_id} late mask {i}")

    def _validate(self, req: StepRequest) -> list[torch.Tensor | None]:
        """All checks of ``check_step``; returns the decoded bitmask of each request."""
        try:
            return check_step(
                req,
                num_rows=self.req_to_token.num_rows,
                num_slots=self.kv.num_slots,
                num_mamba_slots=self.mamba.num_slots if self.mamba else 0,
                max_slots=self.kv.max_slots,
                max_mamba_slots=self.mamba.max_slots if self.mamba else 0,
                slot_granularity=self.kv.slot_granularity,
                max_context=self.req_to_token.max_context,
                vocab_size=self.info.vocab_size,
                max_top_logprobs=MAX_TOP_LOGPROBS,
                rows_with_sample=set(self._last_sample),
                row_len=self._row_len,
                host_pages=self.info.host_pages,
                host_page_tokens=self.info.host_page_tokens,
                l3=self.info.l3,
                host_states=self.info.host_states,
            )
        except StepError:
            raise
        except ValueError as e:  # a check helper raising plain ValueError is still the client's fault
            raise StepError(str(e)) from e

    def _run_ops(self, req: StepRequest) -> None:
        if self.host is not None:
            self.host.begin()
        for op in req.ops:
            if isinstance(op, MambaCopy):
                assert self.mamba is not None  # validated
                self.mamba.copy(op.src, op.dst)
            elif isinstance(op, MambaReset):
                assert self.mamba is not None
                self.mamba.reset(op.slot)
            elif isinstance(op, PoolResize):  # validated: the scheduler has freed any tail it cuts
                self._resize(op)
            elif isinstance(op, ReleaseRow):
                self.req_to_token.release(op.row)
                self._last_sample.pop(op.row, None)
                self._row_len.pop(op.row, None)
                self._history.pop(op.row, None)
                if self.draft is not None:
                    self.draft.release(op.row)
            elif isinstance(op, HostBackup | HostLoad | StateBackup | StateLoad | L3Put | L3Get):
                assert self.host is not None  # validated
                self.host.run(op, self.kv, self.mamba)

    def _resize(self, op: PoolResize) -> None:
        """The shrinking pool first, so that memory held never peaks above max(before, after)."""
        if self.draft is not None:  # the draft pool has the target pool's slots
            self.draft.resize(op.kv_slots)
        kv, mamba = self.kv, self.mamba
        if mamba is not None and op.kv_slots > kv.num_slots:
            mamba.resize(op.mamba_slots)
            kv.resize(op.kv_slots)
            return
        kv.resize(op.kv_slots)
        if mamba is not None:
            mamba.resize(op.mamba_slots)

    def _batch_input(self, reqs: list[ReqInput]) -> BatchInput:
        """Write the step's slots into req_to_token and gather its inputs; list operations over
        the batch rather than a loop per request (a decode step holds hundreds)."""
        last = self._last_sample
        rows = [r.row for r in reqs]
        start = [r.start_pos for r in reqs]
        ids = [[last[r.row]] if r.use_last_sample else r.input_ids for r in reqs]
        new_slots = [r.new_slots for r in reqs]
        prefixes = [(r.row, 0, r.prefix_slots) for r in reqs if r.prefix_slots]  # row[0:start_pos] first
        self.req_to_token.write_runs(prefixes + list(zip(rows, start, new_slots, strict=True)))
        self._row_len.update(zip(rows, (s + len(x) for s, x in zip(start, ids, strict=True)), strict=True))
        self._history.update((r.row, list(r.history_ids)) for r in reqs if r.history_ids)
        mamba = [r.mamba_slot for r in reqs if r.mamba_slot is not None]
        return BatchInput(rows, start, ids, new_slots, mamba or None, want_logits(reqs))

    def _run(self, inp: BatchInput, all_logits: bool) -> torch.Tensor:
        meta: AttentionMeta | None = None
        if self.graphs is not None and not all_logits and self.graphs.fits(inp):
            meta = self.attn.prepare(inp.rows, inp.start_pos, [1] * len(inp.rows))
            if meta.empty:  # e.g. no prefix group formed: the flat decode, replayable
                return self.graphs.run(inp)
        batch = ForwardBatch.build(inp, self.device, self.attn, all_logits=all_logits, meta=meta)
        return self.model.forward(batch, self._ctx)

    def _run_target(self, inp: BatchInput, all_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's forward: logits, and the hidden state of every token when the drafter
        reads them (MTP)."""
        if self.draft is None or not self.draft.wants_hidden:
            return self._run(inp, all_logits), None
        batch = ForwardBatch.build(inp, self.device, self.attn, all_logits=all_logits)
        logits, hidden = cast(_HiddenLM, self.model).forward_hidden(batch, self._ctx)
        return logits, hidden

    def _sample(
        self, reqs: list[ReqInput], masks: list[torch.Tensor | None], logits: torch.Tensor
    ) -> list[ReqOutput]:
        """One token per request with ``sample``; ``logits`` row j belongs to the j-th of them.

        Plain greedy rows (no penalties, mask or logprobs: every row of the usual decode batch)
        are one argmax over the batch; only the other rows become ``SamplerInput``s. The sampler
        treats each row on its own (its draws depend only on seed and output index), so sampling
        a subset gives each row the token it would get in the whole batch.

        A request verifying drafts has one logits row per input (offset ``j`` samples output index
        ``output_index + j``, after the drafts before it): every row is sampled as if it were an
        ordinary decode, so a sample depends on (seed, output index) alone and speculation changes
        no token, greedy or not; the request keeps the samples up to the first that differs from
        the next draft (``accepted_len``).
        """
        chosen = [i for i, r in enumerate(reqs) if r.sample]
        drafting = any(reqs[i].num_draft for i in chosen)
        # One logits row per (request, offset).
        cells = [(i, j) for i in chosen for j in range(reqs[i].num_draft + 1)] if drafting else [(i, 0) for i in chosen]
        general = [
            k
            for k, (i, _) in enumerate(cells)
            if masks[i] is not None or reqs[i].return_logprobs or not _plain_greedy(reqs[i].sampling)
        ]
        tokens: list[int] = logits.argmax(dim=1).tolist() if len(general) < len(cells) else [0] * len(cells)
        logprobs: dict[int, TokenLogprob] = {}
        if general:
            inputs = []
            for k in general:
                i, j = cells[k]
                r = reqs[i]
                history = self._history.setdefault(r.row, []) if r.sampling.has_penalties else None
                if history is not None and j:
                    history = history + _drafts(r)[:j]
                inputs.append(
                    SamplerInput(
                        params=r.sampling,
                        seed=r.seed,
                        output_index=r.output_index + j,
                        history=history,
                        bitmask=_to(_position_mask(masks[i], j), self.device),
                        return_logprobs=r.return_logprobs,
                        top_logprobs=r.top_logprobs,
                    )
                )
            rows = logits.index_select(0, torch.tensor(general, device=logits.device))
            try:
                picks = sample(rows, inputs)
            except ValueError as e:
                raise StepError(f"sampling failed: {e}") from e
            for k, x, pick in zip(general, inputs, picks, strict=True):
                tokens[k] = pick.token_id
                if x.return_logprobs:
                    logprobs[k] = pick
        if not drafting:
            self._record_samples(reqs, tokens)
            return [
                ReqOutput(reqs[i].row, t, logprobs.get(k)) for k, (i, t) in enumerate(zip(chosen, tokens, strict=True))
            ]
        outputs: list[ReqOutput] = []
        k = 0
        for i in chosen:
            r = reqs[i]
            samples = tokens[k : k + r.num_draft + 1]
            kept = samples[: accepted_len(samples, _drafts(r))]
            outputs += [ReqOutput(r.row, t, logprobs.get(k + j)) for j, t in enumerate(kept)]
            self._record_kept(r, kept)
            k += r.num_draft + 1
        return outputs

    def _record_verified(self, reqs: list[ReqInput], padded: list[int]) -> Counter[int]:
        """A follower's ``_sample`` bookkeeping for a step with drafts, from rank 0's padded
        samples (``_padded_samples``); returns the tokens each drafting row kept."""
        kept: Counter[int] = Counter()
        k = 0
        for r in (r for r in reqs if r.sample):
            ids = [t for t in padded[k : k + r.num_draft + 1] if t >= 0]
            self._record_kept(r, ids)
            if r.num_draft:
                kept[r.row] = len(ids)
            k += r.num_draft + 1
        return kept

    def _record_kept(self, r: ReqInput, kept: list[int]) -> None:
        """``r`` kept ``kept`` (1 to ``1 + num_draft`` samples): its next input, penalty history and,
        with drafts, its length (the input and the accepted drafts; the rest of the pass is void)."""
        self._last_sample[r.row] = kept[-1]
        if r.row in self._history:
            self._history[r.row].extend(kept)
        if r.num_draft:
            self._row_len[r.row] = r.start_pos + len(kept)

    def _roll_back_states(self, drafting: list[ReqInput], trace: StateTrace, kept: Counter[int]) -> None:
        """Hybrid rows whose drafts were not all accepted (``kept``: tokens each row kept, >= 1):
        their recurrent states went through the rejected tokens; each takes the state the verify
        pass recorded after its last kept token. Their KV past it is the scheduler's to drop."""
        assert self.mamba is not None
        for r in drafting:
            if kept[r.row] < r.num_draft + 1:
                self.mamba.keep_traced(trace, cast(int, r.mamba_slot), kept[r.row])

    def _record_samples(self, reqs: list[ReqInput], ids: list[int]) -> None:
        """Remember each sampling request's token: the next decode's input and penalty history."""
        for r, token in zip((r for r in reqs if r.sample), ids, strict=True):
            self._last_sample[r.row] = token
            if r.row in self._history:
                self._history[r.row].append(token)


class _HiddenLM(Protocol):
    """A model that also returns its hidden states after the final norm (Qwen3-Next, for MTP)."""

    def forward_hidden(self, batch: ForwardBatch, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]: ...


def _host_tier(
    cfg: EngineConfig, model: CausalLM, mamba: MambaPool | None, dtype: torch.dtype, device: torch.device,
    l3: L3Port | None, tp: Tp,
) -> HostOpRunner:
    """The host pools for ``cfg.host_cache_bytes``: all KV pages on a dense model; on a hybrid one
    ``host_state_share`` of the bytes for Mamba states (a state-first ``HostStatePool``) and the
    rest for KV pages."""
    pin = device.type == "cuda"
    total = cfg.host_cache_bytes
    state_bytes = int(total * cfg.host_state_share) if mamba is not None else 0
    try:
        pool = HostPool.from_budget(
            total - state_bytes, cfg.host_page_tokens, model.num_kv_layers, model.num_kv_heads, model.head_dim,
            dtype, pin_memory=pin,
        )
        states = HostStatePool.from_budget(state_bytes, mamba.spec, pin_memory=pin) if mamba is not None else None
    except ValueError as e:
        if mamba is None:
            raise
        raise ValueError(
            f"host_cache_bytes={total} with host_state_share={cfg.host_state_share} gives {total - state_bytes} "
            f"bytes to KV pages and {state_bytes} to Mamba states: {e}; raise host_cache_bytes or move "
            "host_state_share"
        ) from e
    return HostOpRunner(pool, l3, states=states, tp_rank=tp.rank, tp_size=tp.size)


def _draft_slot_bytes(cfg: EngineConfig, model: CausalLM, dtype: torch.dtype) -> int:
    """Bytes of one slot in the drafter's pool: the MTP head's one attention layer of the target's
    shape, or every layer of the draft checkpoint (read from its config; its weights load later)."""
    if cfg.mtp:
        return KVPool.slot_bytes(1, model.num_kv_heads, model.head_dim, dtype)
    if not cfg.draft_model:
        return 0
    path = Path(cfg.draft_model) / "config.json"
    try:
        d = DenseConfig.from_hf(json.loads(path.read_text()), qk_norm=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_draft_model {cfg.draft_model}: {e}") from e
    return KVPool.slot_bytes(d.num_layers, d.num_kv_heads, d.head_dim, dtype)


def packed_steps(decode_gain: float, prefill_gain: float) -> frozenset[str]:
    """The steps that keep the packed copies, from how many times faster a pass measured with them
    than with MKL: each at ``PACKED_GAIN`` or more; prefill chunks also at 1.0 or more where decode
    steps keep them (the copies' memory is spent either way)."""
    decode = decode_gain >= PACKED_GAIN
    prefill = prefill_gain >= (1.0 if decode else PACKED_GAIN)
    return frozenset(step for step, kept in (("decode", decode), ("prefill", prefill)) if kept)


def _decodes_only(reqs: list[ReqInput]) -> bool:
    """No prefill chunk among ``reqs``: every one is a decode (one input) or a verify pass. Such a
    step's GEMMs of a few rows may take the native kernel (``kernels.linear.few_rows``)."""
    return all(len(r.input_ids) <= 1 or r.num_draft for r in reqs)


def _padded_samples(reqs: list[ReqInput], outputs: list[ReqOutput]) -> list[int]:
    """What rank 0 sends its followers after a step with drafts: each sampling request's kept
    tokens (consecutive outputs of its row), padded with -1 to ``1 + num_draft``."""
    ids: list[int] = []
    k = 0
    for r in (r for r in reqs if r.sample):
        n = 0
        while n <= r.num_draft and k + n < len(outputs) and outputs[k + n].row == r.row:
            n += 1
        ids += [o.token_id for o in outputs[k : k + n]] + [-1] * (r.num_draft + 1 - n)
        k += n
    return ids


def _position_mask(mask: torch.Tensor | None, j: int) -> torch.Tensor | None:
    """The mask of a request's ``j``-th sampled position: a verify pass under a grammar carries
    one row per position (``[1 + num_draft, words]``), anything else one mask."""
    return mask if mask is None or mask.dim() == 1 else mask[j]


def _drafts(r: ReqInput) -> list[int]:
    """The draft tokens of ``r`` (the last ``num_draft`` input ids)."""
    return r.input_ids[len(r.input_ids) - r.num_draft :]


def accepted_len(samples: list[int], drafts: list[int]) -> int:
    """How many of a verify pass's samples stand: ``samples[j]`` is sampled after the input and the
    first ``j`` drafts, so it stands while ``drafts[:j]`` all equal the samples before them; the
    first sample always does (it is the plain decode's token)."""
    n = 1
    while n < len(samples) and samples[n - 1] == drafts[n - 1]:
        n += 1
    return n


def _plain_greedy(p: SamplingParams) -> bool:
    """Greedy with no penalties: the token is the row's argmax of the raw logits."""
    return p.greedy and not p.has_penalties


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
