"""Forming one step: which requests run, which tokens, which slots (continuous batching).

Pure bookkeeping over ``Memory`` (``memory/core.py``) and the queues; no I/O. The loop calls ``plan`` once per step
and ``commit`` with the step's result.

Order of a plan:
  1. finalize aborted requests;
  2. decodes of running requests (one token each); when memory runs out, retract the newest
     running request (its KV goes to the cache, it goes back to the front of the queue);
  3. continue chunked prefills, then admit waiting requests, under the prefill token budget.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common.step import CacheOp, JobResult, LateMasks, PromptScores, ReqInput, StepRequest, TokenLogprob
from services.scheduler.elastic_control import ElasticControl
from services.scheduler.memory import Memory
from services.scheduler.request import Finish, FinishEvent, Fork, PromptEvent, Req, TokenEvent
from services.scheduler.speculative import Speculator

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_prefill_tokens: int  # new prompt tokens per step (chunk budget)
    max_running: int  # requests holding a row
    fcfs: bool = True  # False: longest cached prefix first


@dataclass(slots=True)
class Plan:
    step: StepRequest
    reqs: list[Req]  # one per ReqInput, same order
    prefills: list[Req] = field(default_factory=list)  # inputs that were prefill chunks
    prefill_tokens: int = 0  # their tokens (what makes a step long: overlap.py)
    late: list[Req] = field(default_factory=list)  # samples whose grammar mask is sent after commit
    sampled: list[Req] = field(default_factory=list)  # those with sample=True, in order
    drafts: list[int] = field(default_factory=list)  # per sampled request, its draft tokens (0: none)
    forks: list[tuple[Req, Fork]] = field(default_factory=list)  # checkpoints to insert on commit
    scored: list[tuple[Req, int]] = field(default_factory=list)  # chunks scoring their prompt: (req, start)
    decoding: int = 0  # requests decoding when it was planned, those waiting to draft included (the pacer's batch)


# Waiting for a sibling is only worth it when it saves at least this many tokens of prefill.
MIN_HOLD_TOKENS = 16


def _common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most ``limit`` (slice compares, no per-token
    loop until the last few tokens)."""
    n = min(len(a), len(b), limit)
    lo, hi = 0, n
    if a[:n] == b[:n]:
        return n
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def _decoding(req: Req) -> bool:
    """Its only uncomputed token is the last one sampled (known or still in flight)."""
    return bool(req.output or req.inflight) and req.remaining_prefill == 1


def _prefilling(req: Req) -> bool:
    return req.remaining_prefill > 0 and not _decoding(req)


class Batcher:
    def __init__(self, memory: Memory, limits: BatchLimits, eos: frozenset[int], context_length: int) -> None:
        self.mem = memory
        self.limits = limits
        self.eos = eos
        self.context_length = context_length
        # Elastic pools (set by the loop when a budget is configured): resizes go first in a step.
        self.elastic: ElasticControl | None = None
        self.resize_ops: list[CacheOp] = []
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.step_id = 0
        self.retractions = 0
        self.cached_tokens = 0  # Σ prompt tokens reused on first admission
        self.prompt_tokens = 0  # Σ prompt tokens on first admission
        self.held_back = 0  # admissions deferred to wait for a sibling's prefix
        # Called with the seconds from submit to first admission (the queue-time metric).
        self.on_queue_wait: Callable[[float], None] | None = None
        self.late_masks_sent = 0  # grammar masks sent after their step (overlap with grammars)
        self.spec: Speculator | None = None  # speculative decoding (set by the loop when on)
        self._drafts: dict[int, list[int]] = {}  # id(req) -> this plan's drafts
        # Prefill role: requests ended with Finish.HANDOFF, waiting (until the deadline) for their
        # prompt's pages to reach the kvstore before their end goes out.
        self.handoffs: list[tuple[Req, float, float]] = []  # (request, since, deadline)
        self.handoff_wait_s = 2.0
        # (seconds waited, pages stored) of recent hand-overs, drained by the metrics (bounded without them).
        self.handed_over: deque[tuple[float, bool]] = deque(maxlen=1024)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- plan -----------------------------------------------------------------------------------
    def plan(self) -> Plan | None:
        self._drop_aborted()
        if self.elastic is not None:
            busy = bool(self.running or self.waiting)
            self.resize_ops += self.elastic.before_plan(list(self.waiting), busy)
        inputs: list[tuple[Req, int]] = []  # (req, number of new tokens)
        self._drafts.clear()
        decodes, batch = self._schedule_decodes(inputs)
        budget = self.limits.max_prefill_tokens
        for req in self.running:
            if _prefilling(req) and budget > 0:
                n = self._grant(req, self.mem.chunk_limit(req, min(req.remaining_prefill, budget)))
                if n:
                    inputs.append((req, n))
                    budget -= n
        budget = self._admit(inputs, budget)
        stuck = any(_prefilling(r) for r in self.running) and not any(r.inflight for r in self.running)
        if not inputs and stuck and not self.mem.pending:
            # Running requests need memory to go on and none is waiting for a result: retract.
            if self._retract_newest(exclude=self.running[0]) is None:
                raise AssertionError("a single prefilling request cannot fit the pool")
            return self.plan()
        ops = self.mem.take_ops(self.resize_ops)  # in the order memory/ops.py explains
        self.resize_ops = []
        if not inputs and not ops:
            return None
        self.step_id += 1
        step = StepRequest(self.step_id, ops=ops, reqs=[])
        plan = Plan(step, [], decoding=batch)
        decoding = set(map(id, decodes))
        for req, n in inputs:
            if id(req) not in decoding:  # a prefill chunk: its tokens go into the tree on commit
                plan.prefills.append(req)
                plan.prefill_tokens += n
            ri = self._input(req, n, self._drafts.get(id(req), []))
            if (fork := self.mem.planned(req, req.computed)) is not None:
                plan.forks.append((req, fork))
            if ri.mask_follows:
                plan.late.append(req)
            if ri.prompt_logprobs:
                plan.scored.append((req, ri.start_pos))
            plan.step.reqs.append(ri)
            plan.reqs.append(req)
            if ri.sample:
                plan.sampled.append(req)
                plan.drafts.append(ri.num_draft)
        return plan

    def _schedule_decodes(self, inputs: list[tuple[Req, int]]) -> tuple[list[Req], int]:
        """One token for each decoding request (retracting the newest when memory is short);
        returns the requests scheduled to decode, and how many were decoding (those waiting for a
        token in flight before they draft included: speculation's batch size)."""
        decodes = [r for r in self.running if _decoding(r) and self._may_decode(r)]
        n = len(decodes)  # the batch size, for speculation's limits
        if self.spec is not None:  # a request that drafts waits for its token in flight first
            decodes = [r for r in decodes if not (r.inflight and self.spec.drafting(r, n))]
        i = 0
        while i < len(decodes):
            req = decodes[i]
            draft = self.spec.draft(req, n) if self.spec is not None else []
            if draft and self._grant(req, 1 + len(draft)):  # short of memory: an ordinary decode
                inputs.append((req, 1 + len(draft)))
                self._drafts[id(req)] = draft
                i += 1
                continue
            if self._grant(req, 1):
                inputs.append((req, 1))
                i += 1
                continue
            victim = self._retract_newest(exclude=req)
            if victim is None and self.mem.pending:
                # Host jobs hold pages (backups not yet acknowledged, loads on their way): they
                # come free with the step that carries them, always in flight or planned now (a
                # step acknowledges every job it carried). Decode this request after it; seen in
                # CI with the tree's pages held by backups under a wave that retracted the rest.
                decodes.pop(i)
                continue
            if victim is None:
                raise AssertionError("out of KV memory with a single running request; pool too small")
            if victim in decodes:
                j = decodes.index(victim)
                decodes.pop(j)
                if j < i:
                    i -= 1
                    inputs[:] = [(r, n) for r, n in inputs if r is not victim]
        return [r for r, _ in inputs], n  # only decodes were added so far

    def _may_decode(self, req: Req) -> bool:
        """Another token may be planned now (counting the ones still in flight)."""
        total = len(req.output) + req.inflight
        return total < req.gen.max_new_tokens and len(req.prompt) + total < self.context_length

    def _grant(self, req: Req, n: int) -> int:
        """Allocate ``n`` slots for the next ``n`` tokens of ``req``; 0 when memory is short."""
        return n if self.mem.extend(req, n) else 0

    def _admit(self, inputs: list[tuple[Req, int]], budget: int) -> int:
        if not self.limits.fcfs and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=self.mem.prefix_len, reverse=True))
        held: list[Req] = []
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_running:
            req = self.waiting[0]
            if req.inflight or self._sibling_in_flight(req) or self.mem.hold(req):
                held.append(self.waiting.popleft())
                continue
            matched = self.mem.admit(req)
            if matched is None:  # no free row
                break
            need = len(req.seq) - matched
            chunk = self.mem.chunk_limit(req, min(need, budget))
            # Keep room for the decodes of everyone running (one token each next step).
            if not self.mem.start(req, chunk, reserve=len(self.running)):
                self.mem.abandon(req)
                if not self.running and not inputs and not self.mem.pending:
                    raise AssertionError("a waiting request cannot fit an empty pool")
                break
            self.waiting.popleft()
            req.sent_history = False
            if req.first_admission:
                # A resumed request (output so far given at submission) may match into its output:
                # only prompt tokens count as cached.
                req.cached_tokens = min(matched, len(req.prompt))
                self.cached_tokens += req.cached_tokens
                self.prompt_tokens += len(req.prompt)
                if self.on_queue_wait is not None:
                    self.on_queue_wait(time.monotonic() - req.arrived)
                req.first_admission = False
            self.running.append(req)
            inputs.append((req, chunk))
            budget -= chunk
        self.waiting.extendleft(reversed(held))
        self.held_back += len(held)
        return budget

    def _sibling_in_flight(self, req: Req) -> bool:
        """A running request is still computing (part of) this request's prefix: wait for it to
        reach the tree (its chunks are inserted as they finish) instead of computing the same
        tokens twice."""
        seq = req.seq
        matched = -1
        for other in self.running:
            # No token sampled yet: its prompt is still being computed (this step or the next).
            if other.output or other.cache_salt != req.cache_salt:
                continue
            # How far the sibling's prompt covers ours, against what the tree already holds.
            reach = _common_prefix_len(seq, other.prompt, req.matchable)
            if reach < MIN_HOLD_TOKENS:
                continue
            if matched < 0:
                matched = self.mem.prefix_len(req)
            if reach >= matched + max(self.mem.page_size, MIN_HOLD_TOKENS):
                self.mem.branch_hint(other, reach)  # a state checkpoint where the prompts part pays
                return True
        return False

    def _input(self, req: Req, n: int, draft: list[int]) -> ReqInput:
        """The step's input for ``req``: its next ``n`` tokens, the last ``len(draft)`` of them
        drafts to verify (speculative decoding)."""
        start = req.computed - n
        known = req.seq_len
        assert req.mem.row is not None
        pending = start >= known  # the input is a sample still in flight (overlap)
        assert not pending or n == 1
        g = req.gen
        # Prompt scoring: positions [0, len(prompt) - 1) each predict the next prompt token.
        scores = req.scoring and start < len(req.prompt) - 1
        end = start + n
        ri = ReqInput(
            request_id=req.rid,
            row=req.mem.row,
            input_ids=[] if pending else req.tokens(start, n - len(draft)) + draft,
            use_last_sample=pending,
            start_pos=start,
            new_slots=req.mem.slots[start:],
            prefix_slots=req.mem.slots[:start] if not req.sent_history or req.mem.row_dirty else [],
            mamba_slot=req.mem.mamba_slot,
            sample=start + n - len(draft) == known + req.inflight and g.max_new_tokens > 0,
            sampling=g.sampling,
            seed=req.seed,
            output_index=len(req.output) + req.inflight,
            return_logprobs=g.return_logprobs,
            # One count for both: a sample that gets more alternatives than it asked is trimmed on commit.
            top_logprobs=max(g.top_logprobs, g.prompt_logprobs or 0) if scores else g.top_logprobs,
            trace_context=req.trace_context if not req.sent_history else {},
            num_draft=len(draft),
            worker_drafts=bool(draft) and self.spec is not None and self.spec.worker_drafts,
            prompt_logprobs=scores,
            next_prompt_id=req.prompt[end] if scores and end < len(req.prompt) else None,
        )
        if ri.sample:
            if req.grammar is not None:
                if req.inflight:  # the mask depends on a token still in flight: sent after commit
                    ri.mask_follows = True
                else:  # one mask per sampled position: after the input and after each draft
                    ri.token_bitmask = req.grammar.bitmasks(draft)
            req.inflight += 1
        if not req.sent_history and req.gen.sampling.has_penalties:
            # Every known token, this input's included (the worker adds only what it samples), so
            # the history is the same on a row's first step whatever was cached, chunked, retracted
            # or resumed: prompt + output so far.
            ri.history_ids = req.tokens(0, known)
        req.sent_history = True
        return ri

    def late_masks(self, plan: Plan, vocab_size: int) -> LateMasks:
        """The masks of ``plan``'s constrained samples, now that the previous step is committed.
        A request that finished meanwhile gets an all-allowing mask: its sample is discarded."""
        allow_all = b"\xff" * (4 * ((vocab_size + 31) // 32))
        masks = [r.grammar.bitmask() if r.grammar is not None else allow_all for r in plan.late]
        self.late_masks_sent += len(masks)
        return LateMasks(plan.step.step_id, masks)

    # -- commit ---------------------------------------------------------------------------------
    def commit(
        self, plan: Plan, sampled: list[tuple[int, object]], jobs: Sequence[JobResult] = (), rows: Sequence[int] = (),
        prompt: Sequence[PromptScores] = (),
    ) -> None:
        """Record the samples (token id, logprob or None) of ``plan.sampled``, in order, and the
        acknowledgements of the step's host and L3 jobs. A request that verified drafts has 1 to
        ``drafts + 1`` consecutive samples, told apart by ``rows`` (each sample's row; needed only
        when the plan carries drafts). ``prompt``: the scores of ``plan.scored``'s chunks, in order;
        a prompt whose every position is scored goes out (``PromptEvent``) before any token."""
        self.mem.on_results(list(jobs))
        if self.handoffs:
            self.settle_handoffs()
        if len(prompt) != len(plan.scored):
            raise ValueError(f"step {plan.step.step_id}: {len(prompt)} prompt scores for {len(plan.scored)} chunks")
        for (req, start), got in zip(plan.scored, prompt, strict=True):
            if req.scoring and start <= len(req.prompt_scores):  # a retracted chunk may come back twice
                del req.prompt_scores[start:], req.prompt_ranks[start:]
                req.prompt_scores += got.logprobs
                req.prompt_ranks += got.ranks
        for req in plan.prefills:
            if req.finished is None and not req.aborted and req.mem.row is not None:
                self.mem.commit_chunk(req)
            if req.scoring and req.finished is None and not req.aborted:
                self._prompt_scored(req)
        for req, fork in plan.forks:
            if req.finished is None and not req.aborted and req.mem.row is not None:
                self.mem.commit_fork(req, fork)
        if any(plan.drafts):
            self._commit_verified(plan, sampled, rows)
            return
        for req, (tok, lp) in zip(plan.sampled, sampled, strict=True):
            req.inflight -= 1
            if req.finished is not None or req.aborted:
                continue
            if req.grammar is not None and not req.grammar.accept(tok):
                # The worker applied the mask, so this is a bug somewhere: fail loudly.
                self.finish(req, Finish.ERROR, f"sampled token {tok} violates the request's grammar")
                continue
            req.output.append(tok)
            if isinstance(lp, TokenLogprob) and len(lp.top) > req.gen.top_logprobs:  # asked for the prompt's count
                lp = TokenLogprob(lp.token_id, lp.logprob, lp.top[: req.gen.top_logprobs])
            req.emit(TokenEvent((tok,), (lp,) if lp is not None else ()))  # type: ignore[arg-type]
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self.finish(req, reason)

    def _commit_verified(self, plan: Plan, sampled: list[tuple[int, object]], rows: Sequence[int]) -> None:
        """``commit`` for a plan with drafts: each request's kept samples (up to ``drafts + 1``, the
        same row) are appended up to a stop; the slots of rejected drafts are given back first, so
        only accepted tokens ever reach the cache."""
        if len(rows) != len(sampled):
            raise ValueError(f"{len(sampled)} samples with {len(rows)} rows for a plan with drafts")
        k = 0
        for req, d in zip(plan.sampled, plan.drafts, strict=True):
            if k >= len(sampled):
                raise ValueError(f"step {plan.step.step_id}: fewer samples than requests that sample")
            n = 1
            while n <= d and k + n < len(rows) and rows[k + n] == rows[k]:
                n += 1
            kept, k = sampled[k : k + n], k + n
            req.inflight -= 1
            if d:
                if self.spec is not None:
                    self.spec.record(req, d, n - 1)
                if req.mem.row is not None:  # still holds its slots: the rejected drafts' go back
                    self.mem.truncate(req, req.computed - (d + 1 - n))
            if req.finished is not None or req.aborted:
                continue
            for tok, lp in kept:
                if req.grammar is not None and not req.grammar.accept(tok):
                    self.finish(req, Finish.ERROR, f"sampled token {tok} violates the request's grammar")
                    break
                req.output.append(tok)
                req.emit(TokenEvent((tok,), (lp,) if lp is not None else ()))  # type: ignore[arg-type]
                reason = self._stop_reason(req, tok)
                if reason is not None:
                    self.finish(req, reason)
                    break
        if k != len(sampled):
            raise ValueError(f"step {plan.step.step_id}: {len(sampled) - k} samples left over")

    def _prompt_scored(self, req: Req) -> None:
        """Send ``req``'s prompt scores once every position has one (trimmed to the alternatives it
        asked); a request that generates nothing then ends."""
        if len(req.prompt_scores) < len(req.prompt) - 1:
            return
        k = req.gen.prompt_logprobs or 0
        lps = tuple(lp if len(lp.top) <= k else TokenLogprob(lp.token_id, lp.logprob, lp.top[:k])
                    for lp in req.prompt_scores)  # fmt: skip
        req.emit(PromptEvent(req.prompt[0], lps, tuple(req.prompt_ranks)))
        req.prompt_sent = True
        req.prompt_scores, req.prompt_ranks = [], []
        if req.gen.max_new_tokens == 0:
            self.finish(req, Finish.LENGTH)

    def _stop_reason(self, req: Req, tok: int) -> Finish | None:
        g = req.gen
        if (tok in self.eos and not g.ignore_eos) or tok in g.stop_token_ids:
            return Finish.STOP
        if req.grammar is not None and req.grammar.is_terminated():
            return Finish.STOP  # the grammar can only end here (checked apart from ignore_eos)
        if len(req.output) >= g.max_new_tokens or req.seq_len >= self.context_length:
            return Finish.LENGTH
        if req.handoff:
            return Finish.HANDOFF
        return None

    def finish(self, req: Req, reason: Finish, error: str = "") -> None:
        req.finished = reason
        req.grammar = None  # the matcher's buffers go with the request
        self.mem.release(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:  # retracted while its last sample was in flight
            self.waiting.remove(req)
        if reason == Finish.HANDOFF:  # ends once its prompt's pages are in the kvstore
            now = time.monotonic()
            self.handoffs.append((req, now, now + self.handoff_wait_s))
            self.settle_handoffs()
            return
        req.emit(FinishEvent(reason, len(req.prompt), len(req.output), req.cached_tokens, error))

    def settle_handoffs(self) -> None:
        """End the handed-over requests whose prompt is as far in the kvstore as it will get (or
        whose wait ran out: the decode replica then recomputes what is missing)."""
        now, left = time.monotonic(), []
        for req, since, deadline in self.handoffs:
            stored = self.mem.handed_over(req)
            if stored or now >= deadline:
                self._hand_over(req, now - since, stored)
            else:
                left.append((req, since, deadline))
        self.handoffs = left

    def _hand_over(self, req: Req, waited: float, stored: bool) -> None:
        self.handed_over.append((waited, stored))
        req.emit(FinishEvent(Finish.HANDOFF, len(req.prompt), len(req.output), req.cached_tokens))

    def _retract_newest(self, exclude: Req) -> Req | None:
        for victim in reversed(self.running):
            if victim is not exclude:
                break
        else:
            return None
        self.mem.release(victim)
        self.running.remove(victim)
        victim.retractions += 1
        self.retractions += 1
        self.waiting.appendleft(victim)
        log.info("retracted %s (%d tokens) to free KV memory", victim.rid, len(victim.seq))
        return victim

    def _drop_aborted(self) -> None:
        for req in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(req)
            self.mem.drop(req)
            req.emit_abort()
        for req in [r for r in self.running if r.aborted]:
            self.finish(req, Finish.ABORT)

    def fail_all(self, error: str) -> None:
        """The worker is gone: requeue running requests (their KV is lost) at the front; hand over
        the handed-over ones now (their puts died with the worker)."""
        self.handoffs, waiting = [], self.handoffs
        for req, since, _ in waiting:
            self._hand_over(req, time.monotonic() - since, False)
        for req in reversed(self.running):
            self.waiting.appendleft(req)
        for req in self.waiting:
            self.mem.forget(req)  # its memory died with the worker (the host pool's reservations too)
            req.inflight = 0  # those samples died with the steps in flight
        self.running = []
        self.resize_ops = []
        log.warning("worker lost (%s); %d requests requeued", error, len(self.waiting))
