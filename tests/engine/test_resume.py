"""Requests outlive their worker (issue #29), in one process: the worker dies after a step ran but
before its result came back (the samples in flight die with it), a new one attaches, and every
request resumes from its tokens so far — greedy, seeded sampling, penalties and grammars alike —
with the same tokens, each streamed once, as an uninterrupted run. And a request submitted with
its output so far (what a replica that takes over a dead scheduler's stream receives) continues
exactly where the other left off.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from services.common import validation
from services.common.errors import InvalidArgument
from services.common.step import LateMasks, StepRequest, StepResult, WorkerInfo
from services.scheduler.grammar import Constraint, GrammarService
from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.request import Req
from services.scheduler.server import SchedulerServicer
from services.scheduler.worker_link import InProcessWorkerLink, WorkerGone
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.v1 import strata_pb2 as pb
from tests import sched_harness as h

REGEX = r"[a-z]{2,8}@(cache|page)\.(com|org)"
GREEDY = pb.SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
SEEDED = pb.SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=24, ignore_eos=True)
PENALISED = pb.SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.5, max_new_tokens=24,
                              ignore_eos=True)  # fmt: skip
CONSTRAINED = pb.SamplingParams(temperature=1.0, max_new_tokens=40)


class DyingLink:
    """An in-process worker that dies once ``die_after`` results have come back: the next result
    (its step ran) and every later step are lost, as when the process is SIGKILLed."""

    def __init__(self, engine: h.Engine, die_after: int) -> None:
        self._inner = InProcessWorkerLink(engine)
        self.info: WorkerInfo = self._inner.info
        self._left = die_after

    async def send(self, step: StepRequest) -> None:
        await self._inner.send(step)

    async def send_masks(self, masks: LateMasks) -> None:
        await self._inner.send_masks(masks)

    async def recv(self) -> StepResult:
        result = await self._inner.recv()
        if self._left == 0:
            raise WorkerGone("the worker was SIGKILLed (test)")
        self._left -= 1
        return result

    async def close(self) -> None:
        # An engine thread waiting for a late mask would hold close() for its timeout: let it
        # have one (its result is never read), then stop it.
        await self._inner.send_masks(LateMasks(0, []))
        await self._inner.close()


@pytest.fixture(scope="module")
def grammar(tiny_qwen3: Path) -> Any:
    """The compiled regex (each constrained request takes a matcher of its own)."""
    info = h.engine(tiny_qwen3, kv_cache_bytes=1 << 20, max_rows=2).info
    svc = GrammarService(str(tiny_qwen3), info.vocab_size, stop_token_ids=list(info.eos_token_ids))
    return asyncio.run(svc.compile(Constraint("regex", REGEX)))


def _requests(vocab: int) -> list[tuple[list[int], pb.SamplingParams, int, bool]]:
    """(prompt, sampling, seed, constrained) of a mixed batch; two share a prefix."""
    rng = random.Random(29)
    shared = [rng.randrange(3, vocab) for _ in range(30)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(5 + i)] for i in range(2)]
    prompts += [[rng.randrange(3, vocab) for _ in range(8 + 3 * i)] for i in range(6)]
    kinds = [GREEDY, GREEDY, GREEDY, SEEDED, SEEDED, PENALISED, CONSTRAINED, CONSTRAINED]
    return [(p, s, 1000 + i, s is CONSTRAINED) for i, (p, s) in enumerate(zip(prompts, kinds, strict=True))]


async def _one(loop: SchedulerLoop, req: Req) -> tuple[list[int], str, int, int]:
    """(streamed ids, finish reason, completion tokens, cached tokens) of ``req``."""
    ids, ev = await h.stream(loop, req)
    return ids, ev.reason.value, ev.completion_tokens, ev.cached_tokens


def _make(loop: SchedulerLoop, grammar: Any, spec: tuple, rid: str, output: list[int]) -> Req:
    prompt, sampling, seed, constrained = spec
    gen = validation.generation(sampling, len(prompt), loop.limits(), False, 0)
    matcher = None
    if constrained:
        matcher = grammar.matcher()
        for tok in output:  # what the servicer does for a resumed request (``output_ids``)
            assert matcher.accept(tok)
    return Req(rid, list(prompt), gen, seed, grammar=matcher, output=list(output))


def _serve(
    tiny_qwen3: Path, grammar: Any, cfg: LoopConfig, die_after: int | None,
    outputs: list[list[int]] | None = None,
) -> list[tuple[list[int], str, int, int]]:
    """Run the mixed batch; with ``die_after`` the worker dies after that many results and a new
    one attaches 0.2 s later. ``outputs``: each request's output so far, given at submission."""

    async def main() -> list[tuple[list[int], str, int, int]]:
        loop = SchedulerLoop(cfg)
        first = h.engine(tiny_qwen3, kv_cache_bytes=1 << 22, max_rows=16)
        loop.attach(DyingLink(first, die_after) if die_after is not None else InProcessWorkerLink(first))
        specs = _requests(first.info.vocab_size)
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(stop))
        reqs = [_make(loop, grammar, s, f"r{i}", outputs[i] if outputs else []) for i, s in enumerate(specs)]
        runs = asyncio.gather(*(_one(loop, r) for r in reqs))
        if die_after is not None:
            while loop.link is not None:  # the worker dies under load
                await asyncio.sleep(0.005)
            assert any(r.output for r in reqs) and not all(r.finished for r in reqs)
            await asyncio.sleep(0.2)
            loop.attach(InProcessWorkerLink(h.engine(tiny_qwen3, kv_cache_bytes=1 << 22, max_rows=16)))
        try:
            return await asyncio.wait_for(runs, 120)  # a request that never resumes fails, not hangs
        finally:
            stop.set()
            await task
            if loop.link is not None:
                await loop.link.close()
            assert loop.batcher is not None
            loop.batcher.mem.check_idle()

    return asyncio.run(main())


@pytest.mark.parametrize("overlap", [True, False])
def test_requests_resume_on_a_new_worker_with_the_same_tokens(
    tiny_qwen3: Path, grammar: Any, overlap: bool
) -> None:
    cfg = LoopConfig(overlap=overlap, max_prefill_tokens=16)  # chunked prompts: some die mid-prefill
    want = _serve(tiny_qwen3, grammar, cfg, None)
    assert any(len(set(w[0])) > 4 for w in want)  # real sequences
    assert {w[1] for w in want[-2:]} == {"stop"}  # the grammar ended them
    for die_after in (3, 9):  # while prompts are still being prefilled, then in steady decoding
        got = _serve(tiny_qwen3, grammar, cfg, die_after)
        # Tokens streamed before the death + after the resume, each once; usage counts them all.
        assert [g[:3] for g in got] == [w[:3] for w in want], die_after
        assert all(g[2] == len(g[0]) for g in got)


def test_a_request_submitted_with_its_output_so_far_continues_it(tiny_qwen3: Path, grammar: Any) -> None:
    """What a replica taking over a dead scheduler's stream does (``output_ids``): the continuation
    equals the rest of the uninterrupted run, counted from the request's first output token."""
    cfg = LoopConfig()
    want = _serve(tiny_qwen3, grammar, cfg, None)
    cut = [len(w[0]) // 2 for w in want]
    got = _serve(tiny_qwen3, grammar, cfg, None, outputs=[w[0][:c] for w, c in zip(want, cut, strict=True)])
    for (ids, finish, completion, cached), w, c in zip(got, want, cut, strict=True):
        assert w[0][:c] + ids == w[0] and finish == w[1] and completion == len(w[0])
        assert cached == 0  # a fresh worker: nothing cached, and never more than the prompt


def test_penalties_see_the_whole_prompt_whatever_is_cached(tiny_qwen3: Path) -> None:
    """The penalty history is prompt + output on a row's first step however much of the prompt was
    cached (it used to be only the cached part): a warm run equals a cold one."""
    prompt = [7, 8, 9, 7, 8, 9, 10, 11] * 6
    spec = h.Spec(prompt, 24)
    eng = h.engine(tiny_qwen3, kv_cache_bytes=1 << 22, max_rows=8)

    async def body(loop: SchedulerLoop) -> list[list[int]]:
        outs = []
        for i in range(2):  # cold, then with the prompt cached
            gen = validation.generation(PENALISED, len(prompt), loop.limits(), False, 0)
            req = Req(f"p{i}", list(spec.prompt), gen, seed=0)
            ids, _, _, cached = await _one(loop, req)
            assert cached == (0 if i == 0 else len(prompt) - 1)
            outs.append(ids)
        return outs

    (cold, warm), _ = h.serve(eng, LoopConfig(), body)
    assert cold == warm


def test_the_servicer_admits_a_continuation_and_refuses_one_that_cannot_be(tiny_qwen3: Path) -> None:
    """``GenerateRequest.output_ids`` through the scheduler's servicer: a continuation streams the
    rest of the uninterrupted output with usage for the whole; one with nothing left to generate,
    or that its grammar rejects, is INVALID_ARGUMENT before it takes a slot."""
    eng = h.engine(tiny_qwen3, kv_cache_bytes=1 << 22, max_rows=8)
    servicer = SchedulerServicer(SchedulerLoop(LoopConfig()), tokenizer_dir=str(tiny_qwen3))

    def request(output: list[int], regex: str = "") -> spb.GenerateRequest:
        sampling = pb.SamplingParams(temperature=0.9, seed=5, max_new_tokens=12, ignore_eos=True)
        return spb.GenerateRequest(request_id=f"c{len(output)}{regex[:1]}", input_ids=[9, 8, 7, 6], sampling=sampling,
                                   output_ids=output, constraint=spb.Constraint(regex=regex) if regex else None)

    async def generate(req: spb.GenerateRequest) -> tuple[list[int], spb.GenerateResponse]:
        out = [r async for r in servicer.Generate(req, None)]  # type: ignore[arg-type]
        return [t for r in out for t in r.token_ids], out[-1]

    async def body(loop: SchedulerLoop) -> None:
        servicer.loop = loop
        whole, _ = await generate(request([]))
        rest, last = await generate(request(whole[:5]))
        assert whole[:5] + rest == whole
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 12)
        for bad, what in ((request(whole), "leave nothing to generate"), (request([0, 1], "[a-z]+"), "grammar")):
            with pytest.raises(InvalidArgument, match=what):
                await generate(bad)
        assert not loop.requests

    h.serve(eng, LoopConfig(), body)
