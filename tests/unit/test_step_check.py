"""``check_step`` decides a batch with list operations over all its requests and words an error
with a loop over them; the two must agree on every batch, or a bad request would reach the pools
(or a good batch would pay for the loop)."""

from __future__ import annotations

import random
from collections.abc import Callable

from services.common.step import ReqInput, StepError
from services.worker.step_check import _batch_passes, _check_each, _Limits

ROWS, SLOTS, MAMBA, CONTEXT, VOCAB = 4, 32, 3, 8, 10
SAMPLED, LENGTHS = {0, 2}, {0: 3, 1: 1, 2: 7}  # rows with a last sample / positions each row holds


def _good_batch(rng: random.Random, hybrid: bool) -> list[ReqInput]:
    """Requests on distinct rows, slots and Mamba slots that pass every check."""
    slots = iter(rng.sample(range(SLOTS), SLOTS))
    reqs = []
    for i, row in enumerate(rng.sample(range(ROWS), rng.choice([1, 2, 3]))):
        use_last = row in SAMPLED and rng.random() < 0.5
        start = rng.randint(0, LENGTHS.get(row, 0))
        n = 1 if use_last else rng.randint(1, CONTEXT - start)  # start <= 7 < CONTEXT
        drafts = rng.randint(0, n - 1) if n > 1 and rng.random() < 0.3 else 0  # speculative decoding
        scoring = not use_last and not drafts and rng.random() < 0.3  # a prefill chunk scoring its prompt
        sample = not scoring or rng.random() < 0.5
        reqs.append(ReqInput(
            "r", row, [] if use_last else [rng.randrange(VOCAB) for _ in range(n)], start,
            [next(slots) for _ in range(n)], mamba_slot=i if hybrid else None, use_last_sample=use_last,
            top_logprobs=rng.choice([0, 20]), history_ids=rng.sample(range(VOCAB), rng.choice([0, 2])),
            num_draft=drafts, sample=sample, prompt_logprobs=scoring,
            next_prompt_id=rng.randrange(VOCAB) if scoring and not sample else None,
        ))  # fmt: skip
    return reqs


def _corruptions(rng: random.Random) -> list[Callable[[ReqInput], None]]:
    """Each moves one field to a value that may or may not break a limit."""

    def pick() -> int:
        return rng.randint(-1, SLOTS)

    def setter(name: str, value: Callable[[], object]) -> Callable[[ReqInput], None]:
        return lambda r: setattr(r, name, value())

    return [
        setter("row", lambda: rng.randint(-1, ROWS)),
        setter("start_pos", lambda: rng.randint(-1, CONTEXT)),
        setter("input_ids", lambda: [rng.randint(-1, VOCAB) for _ in range(rng.randint(0, 2))]),
        setter("new_slots", lambda: [pick() for _ in range(rng.randint(0, 2))]),
        setter("prefix_slots", lambda: [pick() for _ in range(rng.randint(1, 3))]),
        setter("mamba_slot", lambda: rng.choice([None, -1, 0, 1, MAMBA])),
        setter("use_last_sample", lambda: rng.random() < 0.5),
        setter("top_logprobs", lambda: rng.choice([-1, 0, 21])),
        setter("history_ids", lambda: [rng.randint(-1, VOCAB)]),
        setter("num_draft", lambda: rng.randint(-1, 3)),
        setter("sample", lambda: rng.random() < 0.5),
        setter("prompt_logprobs", lambda: rng.random() < 0.5),
        setter("next_prompt_id", lambda: rng.choice([None, -1, 0, VOCAB])),
    ]


def test_the_batch_check_agrees_with_the_loop() -> None:
    rng = random.Random(0)
    corruptions = _corruptions(rng)
    outcomes = {True: 0, False: 0}
    for _ in range(20000):
        hybrid = rng.random() < 0.5
        lim = _Limits(ROWS, SLOTS, MAMBA if hybrid else 0, hybrid, CONTEXT, VOCAB, max_top_logprobs=20)
        reqs = _good_batch(rng, hybrid)
        for _ in range(rng.choice([0, 1, 1, 2])):
            rng.choice(corruptions)(rng.choice(reqs))
        if any(r.use_last_sample and r.input_ids for r in reqs):
            continue  # ids the decode ignores: the batch check refuses them, the loop does not care
        try:
            _check_each(reqs, lim, SAMPLED, LENGTHS)
            accepted = True
        except StepError:
            accepted = False
        assert _batch_passes(reqs, lim, SAMPLED, LENGTHS) == accepted, reqs
        outcomes[accepted] += 1
    assert min(outcomes.values()) > 3000, outcomes  # both verdicts were really exercised


def test_prompt_scoring_is_refused_where_it_cannot_run() -> None:
    """A scoring chunk scores its own input ids, against ``next_prompt_id`` past its end; every
    misuse names the field."""
    lim = _Limits(ROWS, SLOTS, 0, False, CONTEXT, VOCAB, max_top_logprobs=20)
    chunk = dict(request_id="r", row=0, input_ids=[1, 2, 3], start_pos=0, new_slots=[4, 5, 6], prompt_logprobs=True)
    bad = {
        "next_prompt_id=10 outside [0, 10)": ReqInput(**chunk, sample=False, next_prompt_id=VOCAB),
        "next_prompt_id needs prompt_logprobs and no sample": ReqInput(**chunk, next_prompt_id=3),
        "prompt_logprobs scores a prefill chunk": ReqInput(**{**chunk, "input_ids": [], "new_slots": [4]},
                                                           use_last_sample=True),
        "prompt_logprobs scores a prefill chunk; not with use_last_sample or num_draft": ReqInput(**chunk, num_draft=1),
    }  # fmt: skip
    for fragment, req in bad.items():
        assert not _batch_passes([req], lim, SAMPLED, LENGTHS), fragment
        try:
            _check_each([req], lim, SAMPLED, LENGTHS)
        except StepError as e:
            assert fragment in str(e), (fragment, str(e))
        else:
            raise AssertionError(f"accepted: {fragment}")
    good = [ReqInput(**chunk, sample=False, next_prompt_id=7), ReqInput(**{**chunk, "row": 1, "new_slots": [7, 8, 9]})]
    assert _batch_passes(good, lim, SAMPLED, LENGTHS)
