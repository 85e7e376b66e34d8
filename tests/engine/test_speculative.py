"""Speculative decoding through the real scheduler loop and engine: output with speculation equals
output without it, and transformers, on Qwen3 and Qwen3-Next — across prefix hits, chunked
prefill, retraction and overlap, greedy and seeded sampling — and the pools' books balance after."""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from services.scheduler.grammar import Constraint, GrammarService
from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.request import Req
from services.scheduler.speculative import SpecConfig, Speculator
from tests import sched_harness as h
from tests.reference import hf_greedy

NGRAM = SpecConfig("ngram", num_draft_tokens=4, max_batch=64, adaptive=False)  # exactness, not the policy: always draft
WORDS = r"[a-z]{1,3}( [a-z]{1,3}){5,9}"  # short words: the output repeats, so prompt lookup drafts


def _repetitive(vocab: int, seed: int) -> list[list[int]]:
    """Prompts whose text repeats (so prompt lookup finds drafts) and two that do not."""
    rng = random.Random(seed)
    phrase = [rng.randrange(3, vocab) for _ in range(9)]
    reps = [phrase * 4 + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 6))] for _ in range(3)]
    return reps + [[rng.randrange(3, vocab) for _ in range(rng.randrange(12, 30))] for _ in range(2)]


def _oracle(truth: list[list[int]], vocab: int, wrong_every: int) -> Speculator:
    """A drafter that knows the answer (a run without speculation) but gets every
    ``wrong_every``-th output position wrong: each verify step keeps some drafts and rejects the
    rest, whatever the model does."""

    def draft(req: Req, k: int) -> list[int]:
        want = truth[int(req.rid.rsplit("-r", 1)[1])]
        n = len(req.output)
        return [t if (n + j) % wrong_every else (t + 1) % vocab for j, t in enumerate(want[n : n + k])]

    return Speculator(NGRAM, 1 << 20, drafter=draft)


def _check_books(loop: SchedulerLoop) -> None:
    assert loop.batcher is not None and loop.batcher.idle
    loop.batcher.mem.check_idle()
    loop.batcher.mem.tree.sanity_check()


@pytest.fixture(scope="module")
def dense(tiny_qwen3: Path) -> h.Engine:
    return h.engine(tiny_qwen3, kv_cache_bytes=1 << 22, max_rows=32)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("chunk", [7, 1024])
def test_ngram_greedy_equals_transformers(tiny_qwen3: Path, dense: h.Engine, overlap: bool, chunk: int) -> None:
    prompts = _repetitive(dense.info.vocab_size, seed=1)
    want = [hf_greedy(tiny_qwen3, p, 24, stop_at_eos=False) for p in prompts]
    specs = [h.Spec(p, 24) for p in prompts]
    cfg = LoopConfig(overlap=overlap, max_prefill_tokens=chunk, spec=NGRAM)
    outs, loop = h.run(dense, specs, cfg, waves=2)  # the second wave starts from cached prefixes
    assert [o.ids for o in outs] == want + want
    assert sum(o.cached_tokens for o in outs[len(specs) :]) == sum(len(p) - 1 for p in prompts)
    assert loop.batcher is not None and loop.batcher.spec is not None
    c = loop.batcher.spec.counters
    assert c.verify_steps > 0 and c.accepted_tokens > 0, c
    _check_books(loop)


@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_partly_accepted_drafts_leave_no_trace(tiny_qwen3: Path, tiny_qwen3_next: Path, arch: str) -> None:
    """Drafts that are right up to a point: the worker keeps the right ones, the rejected ones'
    KV slots go back and (hybrid) the recurrent states end at the last kept token; the cache only
    ever holds accepted tokens, so the second wave, starting from it, is exact too. A pool small
    enough to retract."""
    model = tiny_qwen3 if arch == "dense" else tiny_qwen3_next
    probe = h.engine(model, kv_cache_bytes=1 << 16, max_rows=8)
    eng = h.engine(model, kv_cache_bytes=150 * probe.info.bytes_per_slot, max_rows=8)
    vocab = eng.info.vocab_size
    rng = random.Random(4)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(20, 40))] for _ in range(5)]
    specs = [h.Spec(p, 20) for p in prompts]
    cfg = LoopConfig(max_prefill_tokens=16)
    off, _ = h.run(eng, specs, cfg, waves=2)
    truth = [o.ids for o in off[: len(specs)]]
    assert [o.ids for o in off] == truth + truth
    if arch == "hybrid":  # the reference for the hybrid path (dense: covered above)
        assert truth[0] == hf_greedy(model, prompts[0], 20, stop_at_eos=False)
    oracle = _oracle(truth, vocab, wrong_every=3)

    def attach(loop: SchedulerLoop) -> None:
        assert loop.batcher is not None
        loop.batcher.spec = oracle

    on, loop = h.run(eng, specs, cfg, waves=2, setup=attach)
    assert [o.ids for o in on] == truth + truth
    c = oracle.counters
    assert 0 < c.accepted_tokens < c.draft_tokens, c
    assert loop.batcher is not None and loop.batcher.retractions > 0
    _check_books(loop)


def test_seeded_sampling_is_the_same_with_and_without(dense: h.Engine) -> None:
    """A sampled token depends on (seed, output index) only, so verifying drafts by sampling at
    every position changes nothing: identical to no speculation, run after run."""
    prompts = _repetitive(dense.info.vocab_size, seed=2)
    specs = [h.Spec(p, 24, temperature=0.7, seed=50 + i) for i, p in enumerate(prompts)]
    runs = []
    for spec in (SpecConfig(), NGRAM, NGRAM):
        outs, loop = h.run(dense, specs, LoopConfig(spec=spec))
        runs.append([o.ids for o in outs])
        _check_books(loop)
    assert runs[0] == runs[1] == runs[2]


def test_retraction_with_speculation(tiny_qwen3: Path) -> None:
    probe = h.engine(tiny_qwen3, kv_cache_bytes=1 << 16, max_rows=8)
    small = h.engine(tiny_qwen3, kv_cache_bytes=130 * probe.info.bytes_per_slot, max_rows=8)
    prompts = _repetitive(small.info.vocab_size, seed=3)
    want = [hf_greedy(tiny_qwen3, p, 24, stop_at_eos=False) for p in prompts]
    outs, loop = h.run(small, [h.Spec(p, 24) for p in prompts], LoopConfig(max_prefill_tokens=64, spec=NGRAM))
    assert [o.ids for o in outs] == want
    assert loop.batcher is not None and loop.batcher.retractions > 0
    assert loop.batcher.spec is not None and loop.batcher.spec.counters.accepted_tokens > 0
    _check_books(loop)


@pytest.fixture(scope="module")
def words(tiny_qwen3: Path, dense: h.Engine) -> Any:
    svc = GrammarService(str(tiny_qwen3), dense.info.vocab_size, stop_token_ids=list(dense.info.eos_token_ids))
    return asyncio.run(svc.compile(Constraint("regex", WORDS)))


@pytest.mark.parametrize("sampled", [False, True])
def test_constrained_drafts_are_masked_and_rolled_back(tiny_qwen3: Path, dense: h.Engine, words: Any,
                                                       sampled: bool) -> None:  # fmt: skip
    """Under a grammar, drafts end before the first token the matcher rejects, and the worker
    samples each verify position under the matcher's mask after the drafts before it: output
    equal to no speculation, greedy or seeded, and every answer a match. Prompt lookup, and a
    drafter that knows the answer but gets every third token wrong (often a token the grammar
    rejects)."""
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    rng = random.Random(6)
    prompts = [tok.encode(" ".join(rng.choice(["ab", "cd", "e", "fgh"]) for _ in range(8)), add_special_tokens=False)
               + [rng.randrange(3, dense.info.vocab_size) for _ in range(i)] for i in range(5)]  # fmt: skip

    def specs() -> list[h.Spec]:  # a matcher per request and run
        return [h.Spec(p, 40, ignore_eos=False, temperature=0.8 if sampled else 0.0, seed=70 + i,
                       grammar=words.matcher()) for i, p in enumerate(prompts)]  # fmt: skip

    off, _ = h.run(dense, specs(), LoopConfig())
    truth = [o.ids for o in off]
    for ids in truth:
        assert re.fullmatch(WORDS, tok.decode([t for t in ids if t not in dense.info.eos_token_ids])), ids
    for overlap in (False, True):  # with overlap, the requests that do not draft get late masks
        on, loop = h.run(dense, specs(), LoopConfig(spec=NGRAM, overlap=overlap))
        assert [o.ids for o in on] == truth
        assert loop.batcher is not None and loop.batcher.spec is not None
        assert loop.batcher.spec.counters.accepted_tokens > 0, loop.batcher.spec.counters
        _check_books(loop)
    oracle = _oracle(truth, dense.info.vocab_size, wrong_every=3)

    def attach(loop: SchedulerLoop) -> None:
        assert loop.batcher is not None
        loop.batcher.spec = oracle

    told, loop = h.run(dense, specs(), LoopConfig(), setup=attach)
    assert [o.ids for o in told] == truth
    assert 0 < oracle.counters.accepted_tokens < oracle.counters.draft_tokens, oracle.counters
    _check_books(loop)


def test_the_pacer_measures_both_modes_and_output_is_unchanged(tiny_qwen3: Path, dense: h.Engine) -> None:
    """The default (``adaptive``): a long looping answer at batch 1; the pacer measures windows
    with drafting on and off (whichever it then keeps on this machine), and the answer equals
    transformers. Verify steps count at the batch size they were planned at (with overlap the
    next plan, made before they commit, leaves out the request waiting to verify)."""
    prompt = _repetitive(dense.info.vocab_size, seed=5)[0][:30]
    want = hf_greedy(tiny_qwen3, prompt, 160, stop_at_eos=False)
    seen: list[tuple[int, int, bool]] = []  # what the pacer was told: (batch, tokens, counted)

    def attach(loop: SchedulerLoop) -> None:
        assert loop.batcher is not None and loop.batcher.spec is not None and loop.batcher.spec.pacer is not None
        pacer = loop.batcher.spec.pacer
        told = pacer.observe
        pacer.observe = lambda n, tokens, counted: (seen.append((n, tokens, counted)), told(n, tokens, counted))[1]

    outs, loop = h.run(dense, [h.Spec(prompt, 160)], LoopConfig(spec=SpecConfig("ngram", num_draft_tokens=4)),
                       setup=attach)  # fmt: skip
    assert outs[0].ids == want
    assert loop.batcher is not None and loop.batcher.spec is not None and loop.batcher.spec.pacer is not None
    pc = loop.batcher.spec.pacer.counters
    assert pc.windows_on >= 1 and pc.windows_off >= 1, pc
    assert any(counted and n == 1 and tokens > 1 for n, tokens, counted in seen), "no verify step was measured"
    assert all(n == 1 for n, _, counted in seen if counted), seen
    assert loop.batcher.spec.counters.verify_steps > 0
    _check_books(loop)
