"""Behaviour of the worker's sampler: greedy, masks, penalties, reproducible draws, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.step import GREEDY, SamplingParams
from services.worker.sampler import (
    SamplerInput,
    draw_uniform,
    process_logits,
    sample,
)

SAMPLE = SamplingParams(temperature=1.0)


def inp(
    params: SamplingParams = GREEDY,
    *,
    seed: int = 0,
    output_index: int = 0,
    history: list[int] | None = None,
    bitmask: torch.Tensor | None = None,
    return_logprobs: bool = False,
    top_logprobs: int = 0,
) -> SamplerInput:
    return SamplerInput(params, seed, output_index, history, bitmask, return_logprobs, top_logprobs)


def pack(allowed: list[int], vocab: int) -> torch.Tensor:
    """The int32 bitmask allowing exactly the token ids in ``allowed``."""
    words = [0] * (-(-vocab // 32))
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    return torch.tensor(signed, dtype=torch.int32)


def tokens(logits: torch.Tensor, inputs: list[SamplerInput]) -> list[int]:
    return [r.token_id for r in sample(logits.clone(), inputs)]


def draws(logits_row: list[float], params: SamplingParams, n: int, seed: int = 7) -> Counter[int]:
    """``n`` draws of one distribution, one per output_index, done as a single batch."""
    logits = torch.tensor([logits_row] * n)
    return Counter(tokens(logits, [inp(params, seed=seed, output_index=i) for i in range(n)]))


# --- greedy ---------------------------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    assert tokens(logits, [inp() for _ in range(16)]) == logits.argmax(dim=1).tolist()


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.5, top_k=1)
    got = tokens(logits, [inp(params, seed=s, output_index=s) for s in range(8)])
    assert got == logits.argmax(dim=1).tolist()


def test_masked_greedy_picks_best_allowed_token() -> None:
    logits = torch.tensor([[5.0, 1.0, 3.0, 4.0] + [0.0] * 36])
    assert tokens(logits, [inp(bitmask=pack([1, 2, 39], 40))]) == [2]


def test_tiny_temperature_is_finite_and_argmax() -> None:
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1e-30)
    out = sample(logits.clone(), [inp(params, output_index=i, return_logprobs=True) for i in range(4)])
    assert [r.token_id for r in out] == logits.argmax(dim=1).tolist()
    assert all(math.isfinite(r.logprob) for r in out)


# --- masks ----------------------------------------------------------------------------------


def test_sampling_never_draws_a_disallowed_token() -> None:
    vocab = 70
    logits = torch.zeros(500, vocab)
    logits[:, 0] = 20.0  # the favourite is disallowed
    mask = pack([3, 33, 69], vocab)  # crosses word boundaries, including the partial last word
    got = tokens(logits, [inp(SAMPLE, output_index=i, bitmask=mask) for i in range(500)])
    assert set(got) == {3, 33, 69}


def test_all_zero_mask_raises_and_leaves_logits_unchanged() -> None:
    logits = torch.randn(2, 64)
    before = logits.clone()
    empty = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="row 1: grammar bitmask allows no token"):
        sample(logits, [inp(), inp(SAMPLE, bitmask=empty)])
    assert torch.equal(logits, before)


def test_mask_of_wrong_size_raises() -> None:
    with pytest.raises(ValueError, match="bitmask must be \\[2\\] int32"):
        sample(torch.zeros(1, 64), [inp(bitmask=torch.zeros(3, dtype=torch.int32))])


# --- reproducibility ------------------------------------------------------------------------


def test_draw_depends_only_on_seed_and_index_not_on_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(1, 500, generator=gen)
    others = torch.randn(7, 500, generator=gen)
    mates = [
        inp(SamplingParams(temperature=0.3 + 0.2 * k, top_k=10 * k, top_p=0.9), seed=k, output_index=k)
        for k in range(6)
    ] + [inp()]
    for seed, index in [(0, 0), (42, 3), (2**63 + 5, 1000)]:
        me = inp(SamplingParams(temperature=1.3, top_p=0.95), seed=seed, output_index=index)
        alone = tokens(target, [me])
        for pos in range(8):
            batch = torch.cat([others[:pos], target, others[pos:]])
            assert tokens(batch, [*mates[:pos], me, *mates[pos:]])[pos] == alone[0]


def test_different_output_index_gives_different_draws() -> None:
    got = draws([0.0] * 1000, SAMPLE, n=200)
    assert len(got) > 150  # ~181 distinct expected from 200 uniform draws over 1000


def test_different_seed_gives_different_draws() -> None:
    logits = torch.zeros(200, 1000)
    got = tokens(logits, [inp(SAMPLE, seed=s, output_index=0) for s in range(200)])
    assert len(set(got)) > 150


def test_uniform_mix_is_not_seed_plus_index() -> None:
    assert draw_uniform(1, 0) != draw_uniform(0, 1)
    assert draw_uniform(5, 9) == draw_uniform(5, 9)
    assert all(0.0 <= draw_uniform(s, i) < 1.0 for s in range(20) for i in range(20))


# --- distribution and truncation ------------------------------------------------------------

LOGITS = [1.0, 0.5, 0.0, -0.5, -1.0, 2.0]


def assert_frequencies(got: Counter[int], probs: list[float], n: int, tol: float = 0.03) -> None:
    for t, p in enumerate(probs):
        assert abs(got[t] / n - p) < tol, (t, got[t] / n, p)


def test_frequencies_match_softmax() -> None:
    n = 2000
    probs = torch.tensor(LOGITS).div(0.8).softmax(0).tolist()
    assert_frequencies(draws(LOGITS, SamplingParams(temperature=0.8), n), probs, n)


def test_top_k_renormalises_over_the_k_best() -> None:
    n = 2000
    top3 = torch.tensor([LOGITS[0], LOGITS[1], LOGITS[5]]).softmax(0).tolist()
    probs = [top3[0], top3[1], 0.0, 0.0, 0.0, top3[2]]
    assert_frequencies(draws(LOGITS, SamplingParams(temperature=1.0, top_k=3), n), probs, n)


def test_top_p_keeps_smallest_prefix_reaching_the_mass() -> None:
    n = 2000
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    got = draws(logits, SamplingParams(temperature=1.0, top_p=0.7), n)
    assert set(got) == {0, 1}  # 0.5 < 0.7, then 0.5 + 0.3 reaches it: token 2 is cut
    assert_frequencies(got, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0], n)


def test_tiny_top_p_is_argmax() -> None:
    got = draws(LOGITS, SamplingParams(temperature=1.0, top_p=1e-6), 200)
    assert set(got) == {5}


def test_min_p_filters_relative_to_the_best() -> None:
    logits = torch.tensor([0.4, 0.3, 0.19, 0.11]).log().tolist()
    got = draws(logits, SamplingParams(temperature=1.0, min_p=0.5), 500)
    assert set(got) == {0, 1}  # 0.19 < 0.5 * 0.4


def test_default_filters_are_no_ops_even_for_a_long_tail() -> None:
    n = 2000
    logits = [5.0] + [0.0] * 9  # each tail token has p ~ 0.0064: all must still be drawn
    got = draws(logits, SAMPLE, n)
    assert set(got) == set(range(10))
    assert_frequencies(got, torch.tensor(logits).softmax(0).tolist(), n)


# --- penalties ------------------------------------------------------------------------------

BASE = [2.0, -2.0, 1.0, -1.0, 0.5]
HISTORY = [0, 1, 1]


def processed(params: SamplingParams, history: list[int] = HISTORY) -> list[float]:
    out: list[float] = process_logits(torch.tensor([BASE]), [inp(params, history=history)])[0].tolist()
    return out


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    assert processed(SamplingParams(repetition_penalty=2.0)) == [1.0, -4.0, 1.0, -1.0, 0.5]


def test_frequency_penalty_scales_with_count() -> None:
    assert processed(SamplingParams(frequency_penalty=0.5)) == [1.5, -3.0, 1.0, -1.0, 0.5]


def test_presence_penalty_is_flat_per_seen_token() -> None:
    assert processed(SamplingParams(presence_penalty=0.5)) == [1.5, -2.5, 1.0, -1.0, 0.5]


def test_penalties_compose_repetition_first() -> None:
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=-1.0)
    assert processed(params) == [1.0 - 0.5 + 1.0, -4.0 - 1.0 + 1.0, 1.0, -1.0, 0.5]


def test_penalties_only_touch_their_own_row() -> None:
    logits = torch.tensor([BASE, BASE])
    out = process_logits(logits, [inp(), inp(SamplingParams(presence_penalty=1.0), history=[2])])
    assert out[0].tolist() == BASE
    assert out[1].tolist() == [2.0, -2.0, 0.0, -1.0, 0.5]


def test_penalty_changes_the_greedy_choice() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert tokens(torch.tensor([[3.0, 2.9]]), [inp(params, history=[0])]) == [1]


def test_penalties_without_history_raise() -> None:
    with pytest.raises(ValueError, match="row 0: penalties are on but no history"):
        sample(torch.zeros(1, 5), [inp(SamplingParams(presence_penalty=1.0))])


# --- logprobs -------------------------------------------------------------------------------


def test_greedy_logprobs_are_log_softmax_with_sorted_alternatives() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(4))
    (r,) = sample(logits.clone(), [inp(return_logprobs=True, top_logprobs=5)])
    ref = logits[0].log_softmax(0)
    assert r.token_id == int(ref.argmax())
    assert r.logprob == pytest.approx(float(ref[r.token_id]), abs=1e-6)
    assert [t for t, _ in r.top] == ref.topk(5).indices.tolist()
    assert [v for _, v in r.top] == pytest.approx(ref.topk(5).values.tolist(), abs=1e-6)
    assert [v for _, v in r.top] == sorted((v for _, v in r.top), reverse=True)


def test_sampled_logprobs_include_temperature() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0.5)
    out = sample(logits.clone(), [inp(params, output_index=i, return_logprobs=True) for i in range(3)])
    for row, r in zip(logits, out, strict=True):
        assert r.logprob == pytest.approx(float((row / 0.5).log_softmax(0)[r.token_id]), abs=1e-5)
        assert r.top == ()


def test_logprobs_off_gives_zero_and_no_alternatives() -> None:
    (r,) = sample(torch.randn(1, 10), [inp(SAMPLE, top_logprobs=3)])
    assert (r.logprob, r.top) == (0.0, ())


def test_masked_tokens_are_not_offered_as_alternatives() -> None:
    (r,) = sample(torch.randn(1, 40), [inp(bitmask=pack([4, 9], 40), return_logprobs=True, top_logprobs=5)])
    assert {t for t, _ in r.top} == {4, 9}
    assert math.isclose(sum(math.exp(v) for _, v in r.top), 1.0, rel_tol=1e-5)


def test_top_logprobs_out_of_range_raises() -> None:
    with pytest.raises(ValueError, match="top_logprobs=21"):
        sample(torch.zeros(1, 5), [inp(return_logprobs=True, top_logprobs=21)])


# --- properties -----------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    index=st.integers(0, 10**6),
    temperature=st.sampled_from([0.0, 1e-4, 0.7, 1.0, 3.0]),
    top_k=st.integers(0, 8),
    top_p=st.sampled_from([1e-3, 0.5, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.1, 1.0]),
    allowed=st.sets(st.integers(0, 99), min_size=1, max_size=30),
)
def test_drawn_token_is_allowed_and_within_top_k(
    seed: int, index: int, temperature: float, top_k: int, top_p: float, min_p: float, allowed: set[int]
) -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(seed % 1000))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    (tok,) = tokens(logits, [inp(params, seed=seed, output_index=index, bitmask=pack(sorted(allowed), 100))])
    assert tok in allowed
    if top_k:
        ranked = sorted(allowed, key=lambda t: -float(logits[0, t]))
        assert tok in ranked[:top_k]
