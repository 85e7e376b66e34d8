"""The worker samples a step as a batch: plain greedy rows (no penalties, mask or logprobs) are
one argmax over the batch and only the other rows go through the sampler. Every row must get what
the sampler gives it when it samples the whole batch row by row (draws depend only on a row's seed
and output index)."""

from __future__ import annotations

from pathlib import Path

import torch

from services.common.step import GREEDY, ReqInput, SamplingParams, StepRequest
from services.worker.engine import Engine, EngineConfig
from services.worker.sampler import SamplerInput, sample

PARAMS = [
    GREEDY,
    SamplingParams(temperature=0.8, top_p=0.9),
    GREEDY,
    SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(temperature=1.2, top_k=20, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=1),
    GREEDY,
    SamplingParams(temperature=0.7, frequency_penalty=0.4),
]


def _step(prompts: list[list[int]], step_id: int) -> StepRequest:
    reqs, slot = [], 0
    for row, (ids, params) in enumerate(zip(prompts, PARAMS, strict=True)):
        reqs.append(ReqInput(
            f"r{row}", row, ids, 0, list(range(slot, slot + len(ids))), sampling=params, seed=1000 + row,
            output_index=3, history_ids=list(ids) if params.has_penalties else [],
            return_logprobs=row == 2, top_logprobs=2 if row == 2 else 0,
        ))  # fmt: skip
        slot += len(ids)
    return StepRequest(step_id, reqs=reqs)


def test_a_mixed_batch_samples_as_the_sampler_does_row_by_row(tiny_qwen3: Path) -> None:
    cfg = EngineConfig(kv_cache_bytes=2 << 20, max_rows=len(PARAMS), max_context=256)
    prompts = [[5 + (7 * r + j) % 700 for j in range(9 + r)] for r in range(len(PARAMS))]
    logits = Engine(tiny_qwen3, cfg).forward_logits(_step(prompts, 1)).float()
    last = torch.tensor([sum(len(p) for p in prompts[: r + 1]) - 1 for r in range(len(prompts))])
    rows = logits.index_select(0, last)
    want = sample(rows, [
        SamplerInput(p, 1000 + r, 3, list(prompts[r]) if p.has_penalties else None, None, r == 2, 2 if r == 2 else 0)
        for r, p in enumerate(PARAMS)
    ])  # fmt: skip
    got = Engine(tiny_qwen3, cfg).step(_step(prompts, 1)).outputs
    assert [o.token_id for o in got] == [w.token_id for w in want]
    assert [o.row for o in got] == list(range(len(PARAMS)))
    # ``step`` runs its last layer on the sampled rows alone, ``forward_logits`` on every row: the
    # same values up to the rounding of GEMMs of other shapes.
    assert got[2].logprob is not None and want[2].top
    assert [t for t, _ in got[2].logprob.top] == [t for t, _ in want[2].top]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got[2].logprob.top, want[2].top, strict=True)) < 1e-5
    assert all(o.logprob is None for i, o in enumerate(got) if i != 2)
