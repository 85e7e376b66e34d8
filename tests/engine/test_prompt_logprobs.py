"""Prompt logprobs through the real scheduler loop and engine in one process, in small chunks: the
scores of each prefill chunk are gathered per request and sent once (before the first token),
equal to transformers' fp32 log-softmax on a dense and a hybrid model, with pages of several
tokens, cold and with the prompt (or a long prefix of it) already cached, and alone
(``max_new_tokens`` 0). The HTTP face is ``tests/services/test_openai_logprobs.py``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from services.common import validation
from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.request import FinishEvent, PromptEvent, Req, TokenEvent
from strata.v1 import strata_pb2 as pb
from tests import sched_harness as h
from tests.reference import hf_model

TOP = 3


async def _score(loop: SchedulerLoop, rid: str, prompt: list[int], max_new_tokens: int) -> list[object]:
    sp = pb.SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    gen = validation.generation(sp, len(prompt), loop.limits(), True, 1, prompt_logprobs=TOP)
    req = Req(rid, list(prompt), gen, seed=0)
    loop.submit(req)
    events: list[object] = []
    while not isinstance(events[-1] if events else None, FinishEvent):
        events.append(await req.events.get())
    loop.forget(rid)
    return events


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_chunked_scores_equal_transformers_cold_and_cached(
    hybrid: bool, tiny_qwen3: Path, tiny_qwen3_next: Path
) -> None:
    model = tiny_qwen3_next if hybrid else tiny_qwen3
    rng = random.Random(7)
    first = [rng.randrange(3, 700) for _ in range(45)]
    sibling = first[:33] + [rng.randrange(3, 700) for _ in range(12)]
    prompts = [first, first, sibling, first]  # cold, cached, a cached prefix, alone (0 tokens)
    engine = h.engine(model, page_size=4, mamba_slots=8 if hybrid else 0)

    async def body(loop: SchedulerLoop) -> list[list[object]]:
        runs = [await _score(loop, f"r{i}", p, 0 if i == 3 else 2) for i, p in enumerate(prompts)]
        plain = await h.one(loop, "plain", h.Spec(first, max_new_tokens=1))
        assert plain.cached_tokens >= 28  # the scored requests' KV did enter the cache
        return runs

    runs, _ = h.serve(engine, LoopConfig(max_prefill_tokens=7), body)  # 7 chunks of up to 7 tokens
    for ids, events in zip(prompts, runs, strict=True):
        kinds = [type(e) for e in events]
        alone = events is runs[3]
        assert kinds == ([PromptEvent, FinishEvent] if alone else [PromptEvent, TokenEvent, TokenEvent, FinishEvent])
        end = events[-1]
        assert isinstance(end, FinishEvent) and end.cached_tokens == 0 and end.completion_tokens == (0 if alone else 2)
        scored = events[0]
        assert isinstance(scored, PromptEvent) and scored.first_token_id == ids[0]
        assert [x.token_id for x in scored.logprobs] == ids[1:]
        with torch.inference_mode():
            ref = hf_model(str(model))(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)[:-1]
        got = torch.tensor([x.logprob for x in scored.logprobs])
        want = ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
        assert float((got - want).abs().max()) < 1e-4
        assert list(scored.ranks) == ((ref > want.unsqueeze(1)).sum(dim=1) + 1).tolist()
        assert [[t for t, _ in x.top] for x in scored.logprobs] == ref.topk(TOP).indices.tolist()
        if not alone:  # the sample's alternatives are trimmed back to what it asked (1)
            assert isinstance(events[1], TokenEvent) and len(events[1].logprobs[0].top) == 1
