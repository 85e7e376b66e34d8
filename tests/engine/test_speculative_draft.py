"""Speculative decoding with a draft model (``--speculative-algorithm draft``): the worker's draft
checkpoint proposes, the target verifies; output equals transformers, the draft's KV (in its own
pool at the target's slots) follows prefix hits, and a hybrid target rolls its states back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.common.config import ConfigError
from services.common.step import ReqInput, StepError, StepRequest
from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.speculative import SpecConfig
from services.worker.config import WorkerConfig
from services.worker.draft import DraftModel
from tests import sched_harness as h
from tests.reference import hf_greedy

DRAFT = SpecConfig("draft", num_draft_tokens=4, max_batch=64, adaptive=False)


def _engine(model: Path, draft: Path | None, kv_bytes: int = 1 << 22) -> h.Engine:
    return h.Engine(model, h.EngineConfig(kv_cache_bytes=kv_bytes, max_rows=8, draft_model=str(draft or "")))


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(12, 40))] for _ in range(4)]


def _books(loop: SchedulerLoop) -> None:
    assert loop.batcher is not None and loop.batcher.idle
    loop.batcher.mem.check_idle()


@pytest.mark.parametrize("overlap", [True, False])
def test_the_model_as_its_own_draft_keeps_nearly_every_draft(tiny_qwen3: Path, overlap: bool) -> None:
    """The target drafting for itself: its drafts are its own greedy tokens, so almost all are
    kept (the draft decodes token by token, the verify runs them as one extend: a near-tie may
    differ). The second wave starts from cached prefixes, whose draft KV the mirror computed."""
    eng = _engine(tiny_qwen3, tiny_qwen3)
    assert eng.info.draft_model == tiny_qwen3.name
    prompts = _prompts(eng.info.vocab_size, seed=1)
    want = [hf_greedy(tiny_qwen3, p, 16, stop_at_eos=False) for p in prompts]
    outs, loop = h.run(eng, [h.Spec(p, 16) for p in prompts], LoopConfig(overlap=overlap, spec=DRAFT), waves=2)
    assert [o.ids for o in outs] == want + want
    assert sum(o.cached_tokens for o in outs[len(prompts) :]) > 0
    assert loop.batcher is not None and loop.batcher.spec is not None
    c = loop.batcher.spec.counters
    assert c.verify_steps > 0 and c.accepted_tokens >= 0.9 * c.draft_tokens, c
    _books(loop)


def test_a_step_without_drafts_keeps_the_draft_kv_without_its_logits(tiny_qwen3: Path) -> None:
    """Where no request drafts (prefill, or drafting paused for the batch size), the mirror asks the
    draft model for no logits: its last layer stops at K and V, and its LM head does not run. The
    next step's drafts still read that KV (the model as its own draft keeps them)."""
    eng = _engine(tiny_qwen3, tiny_qwen3)
    assert isinstance(eng.draft, DraftModel)
    rows: list[int] = []
    forward = eng.draft.model.forward

    def counted(batch, ctx):  # type: ignore[no-untyped-def]
        rows.append(int(batch.logit_index.numel()))
        return forward(batch, ctx)

    eng.draft.model.forward = counted  # type: ignore[method-assign]
    prompt = [5, 9, 13, 17, 21, 25, 29, 33]
    out = eng.step(StepRequest(1, reqs=[ReqInput("r", 0, prompt, 0, list(range(8)))]))
    assert rows == [0]  # the prefill's mirror: KV only
    first = out.outputs[0].token_id
    eng.step(StepRequest(2, reqs=[ReqInput("r", 0, [first, 0, 0], 8, [8, 9, 10], num_draft=2, worker_drafts=True)]))
    assert rows[1] == 1  # the drafting step's mirror: the input token's logits (the first draft)
    want = hf_greedy(tiny_qwen3, prompt, 4, stop_at_eos=False)
    assert first == want[0]


def test_a_dense_draft_for_a_hybrid_target(tiny_qwen3: Path, tiny_qwen3_next: Path) -> None:
    """Another model's drafts are mostly rejected: the hybrid target's states are rolled back at
    every verify, chunked prefill and overlap on, and its greedy output is still transformers'."""
    eng = _engine(tiny_qwen3_next, tiny_qwen3)
    prompts = _prompts(eng.info.vocab_size, seed=2)
    want = [hf_greedy(tiny_qwen3_next, p, 12, stop_at_eos=False) for p in prompts]
    spec = SpecConfig("draft", num_draft_tokens=3, max_batch=64, min_accepted=0, adaptive=False)
    cfg = LoopConfig(max_prefill_tokens=16, spec=spec)
    outs, loop = h.run(eng, [h.Spec(p, 12) for p in prompts], cfg)
    assert [o.ids for o in outs] == want
    assert loop.batcher is not None and loop.batcher.spec is not None
    assert loop.batcher.spec.counters.verify_steps > 0
    _books(loop)


def test_worker_drafts_need_a_draft_model(tiny_qwen3: Path, tmp_path: Path) -> None:
    eng = _engine(tiny_qwen3, None)
    assert eng.info.draft_model == ""
    eng.step(StepRequest(1, reqs=[ReqInput("r", 0, [5, 6, 7], 0, [0, 1, 2])]))
    with pytest.raises(StepError, match="worker_drafts is set but this worker has no draft model"):
        eng.step(StepRequest(2, reqs=[ReqInput("r", 0, [7, 0, 0], 3, [3, 4, 5], num_draft=2, worker_drafts=True)]))
    with pytest.raises(ConfigError, match="speculative_draft_model"):
        WorkerConfig(model=str(tiny_qwen3), speculative_draft_model=str(tmp_path / "nothing")).validate()


def test_the_kv_budget_covers_the_draft_pool(tiny_qwen3: Path) -> None:
    """kv_cache_bytes holds the target's pool and the draft model's (every one of its layers per
    slot, read from its config before its weights load): the bytes per slot the scheduler plans
    with count both, and so do the committed bytes."""
    budget = 1 << 20
    plain, eng = _engine(tiny_qwen3, None, budget), _engine(tiny_qwen3, tiny_qwen3, budget)
    assert eng.draft is not None
    target, draft = plain.info.bytes_per_slot, eng.draft.pool.kv.bytes_per_slot
    assert draft == target and eng.info.bytes_per_slot == target + draft  # the model as its own draft
    assert eng.kv.num_slots == eng.draft.pool.kv.num_slots <= budget // (target + draft) < plain.kv.num_slots
    result = eng.step(StepRequest(1))
    assert result.kv_committed_bytes == eng.kv.committed_bytes + eng.draft.pool.kv.committed_bytes
