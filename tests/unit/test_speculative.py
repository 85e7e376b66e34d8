"""Speculative decoding's pieces on their own: the n-gram drafter against a brute-force search,
the acceptance rule, what the speculator drafts and withholds, giving back the slots of rejected
drafts, and the step's ``num_draft`` column on the wire and in ``check_step``."""

from __future__ import annotations

import random
import re

import pytest

from services.common import step_codec
from services.common.config import ConfigError
from services.common.step import ReqInput, StepError, StepRequest, WorkerInfo
from services.common.validation import Limits, generation
from services.scheduler.config import SchedulerConfig
from services.scheduler.memory import MemoryConfig, build_memory
from services.scheduler.request import Req
from services.scheduler.spec_pacer import Pacer, bucket_of
from services.scheduler.speculative import SpecConfig, Speculator, ngram_draft
from services.worker.engine import accepted_len
from services.worker.step_check import _check_each, _Limits
from strata.v1 import strata_pb2 as pb
from strata.worker.v1 import worker_pb2 as wpb


def _brute_force(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = tokens[total - n :]
        for at in range(total - n - 1, -1, -1):  # latest occurrence that leaves a token after it
            if tokens[at : at + n] == suffix:
                seq = list(tokens)
                for i in range(k):
                    seq.append(seq[at + n + i])
                return seq[total:]
    return []


def test_ngram_draft_matches_a_brute_force_search() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        # Small alphabets recur; huge ids make byte patterns that match across 4-byte cells.
        alphabet = rng.choice([[1, 2, 3], list(range(10)), [0x01000000, 0x00000001, 0x00010000, 256]])
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(0, 30))]
        k, n_min = rng.randint(1, 6), rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        assert ngram_draft(tokens, k, n_min, n_max) == _brute_force(tokens, k, n_min, n_max), (tokens, k, n_min, n_max)


def test_ngram_draft_examples() -> None:
    assert ngram_draft([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # the suffix [1, 2] recurred
    assert ngram_draft([5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]  # a loop drafted whole cycles ahead
    assert ngram_draft([1, 2, 3], 2) == []  # nothing recurs
    assert ngram_draft([9, 1, 2, 8, 3, 1, 2, 7, 1, 2], 1) == [7]  # the latest occurrence wins
    assert ngram_draft([1, 2, 3, 5, 2, 3, 9, 2, 3], 2, n_max=1) == [9, 2]  # only the last token matched
    assert ngram_draft([4, 1, 2, 3, 6, 2, 3, 1, 2, 3], 1) == [6]  # the longest suffix [1, 2, 3] wins over [2, 3]


def test_accepted_len() -> None:
    assert accepted_len([7], []) == 1
    assert accepted_len([1, 2, 3], [5, 2]) == 1  # the first draft rejected: the plain decode's token
    assert accepted_len([1, 2, 3], [1, 5]) == 2
    assert accepted_len([1, 2, 3], [1, 2]) == 3  # every draft right: the bonus token too


def _limits() -> Limits:
    return Limits(vocab_size=100, context_length=64)


def _req(prompt: list[int], max_new: int = 16, output: list[int] | None = None) -> Req:
    gen = generation(pb.SamplingParams(max_new_tokens=max_new, temperature=0), len(prompt), _limits(), False, 0)
    req = Req("r", list(prompt), gen, seed=0)
    req.output = list(output or [])
    return req


class _NoFours:
    """A grammar that takes any token but 4 (the part of ``Matcher`` the speculator uses)."""

    def accepted_prefix(self, tokens: list[int]) -> int:
        return tokens.index(4) if 4 in tokens else len(tokens)


def test_speculator_limits_and_pauses() -> None:
    spec = Speculator(SpecConfig("ngram", num_draft_tokens=4, max_batch=8), context_length=64)
    assert SpecConfig().max_batch == 4 and SpecConfig().min_accepted == 1.0
    loop = [3, 4] * 5
    assert spec.draft(_req(loop), decoding=1) == [3, 4, 3, 4]
    assert spec.draft(_req(loop, max_new=3, output=[3]), decoding=1) == [4]  # room for 2 more tokens: 1 draft
    assert spec.draft(_req(loop), decoding=9) == []  # over max_batch
    busy = _req(loop)
    busy.inflight = 1
    assert spec.draft(busy, decoding=1) == []  # its last token is not known yet
    constrained = _req(loop)
    constrained.grammar = _NoFours()
    assert spec.draft(constrained, 1) == [3] and spec.drafting(constrained, 1)  # cut where the grammar rejects
    fours = _req([3, 4] * 5 + [3])  # looks up 4 next, which the grammar rejects: no draft, keeps its overlap
    fours.grammar = _NoFours()
    assert spec.draft(fours, 1) == [] and not spec.drafting(fours, 1)
    worker_drafts = Speculator(SpecConfig("draft"), context_length=64)
    assert worker_drafts.draft(constrained, 1) == [] and not worker_drafts.drafting(constrained, 1)
    assert worker_drafts.draft(_req(loop), 1) == [0] * 4  # placeholders the worker fills
    tight = Speculator(SpecConfig("ngram"), context_length=len(loop) + 1)
    assert tight.draft(_req(loop), 1) == []  # the context leaves room for the next token only

    unlucky = _req(loop)
    spec.record(unlucky, drafted=4, accepted=1)  # the running mean of kept drafts: 1 -> 1
    assert spec.drafting(unlucky, 1)
    spec.record(unlucky, drafted=4, accepted=0)  # 1 -> 0.5: below min_accepted
    assert not spec.drafting(unlucky, 1) and spec.draft(unlucky, 1) == []  # backs off ...
    for _ in range(7):
        spec.draft(unlucky, 1)
    assert spec.drafting(unlucky, 1)  # ... for 8 decodes
    spec.record(unlucky, drafted=4, accepted=0)
    waits = 0
    while not spec.drafting(unlucky, 1):
        spec.draft(unlucky, 1)
        waits += 1
    assert waits == 16  # then twice as long
    spec.record(unlucky, drafted=4, accepted=4)  # mean (0.25 + 4) / 2 >= 1: no back-off
    assert spec.drafting(unlucky, 1) and unlucky.spec_backoff == 0
    assert spec.counters.verify_steps == 4 and spec.counters.accepted_tokens == 5

    lonely = _req(list(range(3, 20)))  # nothing recurs: no draft, and a back-off
    assert spec.draft(lonely, 1) == [] and not spec.drafting(lonely, 1)


def _info(page: int) -> WorkerInfo:
    return WorkerInfo(
        model="m", architecture="a", fingerprint="f", vocab_size=100, context_length=64, eos_token_ids=(0,),
        num_slots=64, bytes_per_slot=1, page_size=page, num_rows=4, num_mamba_slots=0, bytes_per_mamba_slot=1,
        dtype="float32", hybrid=False, device="cpu", max_slots=64, max_mamba_slots=0, slot_granularity=page,
        mamba_slot_granularity=1, pool_page_bytes=1, elastic=False, host_pages=0, host_page_tokens=0,
        kv_layout="", l3=False, host_states=0, state_layout="",
    )


@pytest.mark.parametrize("page", [1, 4])
def test_truncate_gives_back_the_rejected_drafts_slots(page: int) -> None:
    mem = build_memory(_info(page), MemoryConfig())
    req = _req(list(range(1, 11)))
    assert mem.admit(req) == 0 and mem.start(req, 10, reserve=0)
    req.mem.planned_len = 10
    free0 = mem.slots.available
    assert mem.extend(req, 1 + 6)  # a decode with 6 drafts: positions 10..16
    req.mem.planned_len = 17
    mem.truncate(req, 12)  # two kept
    assert req.computed == 12 and req.mem.planned_len == 12
    # Page 4: positions 10-11 sit in the prompt's last page; the two new pages go back whole.
    assert mem.slots.available == free0 - (0 if page == 4 else 2)
    before = list(req.mem.slots)
    assert mem.extend(req, 3)  # the next decode continues in the same pages
    assert req.mem.slots[:12] == before and len(set(req.mem.slots)) == 15
    with pytest.raises(ValueError, match="truncate r to 16 tokens"):
        mem.truncate(req, 16)
    req.output = [5] * 5
    mem.release(req)
    mem.check_idle()


def _lim() -> _Limits:
    return _Limits(4, 32, 0, False, 16, 10, max_top_logprobs=20)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"num_draft": 3}, "num_draft=3 must be in [0, 3)"),
        ({"num_draft": 1, "sample": False}, "num_draft needs sample"),
        ({"num_draft": 1, "token_bitmask": b"\xff" * 4}, "expected 8 (2 masks (1 + num_draft) of ceil(10/32)"),
        ({"num_draft": 2, "token_bitmask": b"\xff" * 8 + b"\x00\xfc\x00\x00"}, "allows no token (mask 2)"),
        ({"num_draft": 1, "worker_drafts": True, "token_bitmask": b"\xff" * 8}, "worker_drafts with a token_bitmask"),
    ],
)
def test_check_step_refuses_bad_drafts(change: dict, fragment: str) -> None:
    r = ReqInput("r", 0, [1, 2, 3], 0, [5, 6, 7])
    _check_each([r], _lim(), set(), {})
    for k, v in change.items():
        setattr(r, k, v)
    with pytest.raises(StepError, match=re.escape(fragment)):
        _check_each([r], _lim(), set(), {})


def test_a_constrained_verify_carries_a_mask_per_position() -> None:
    """Under a grammar, 1 + num_draft masks back to back: the worker gets one row per position."""
    masks = bytes([1, 0, 0, 0, 2, 0, 0, 0, 4, 2, 0, 0])  # {0}, {1}, {2, 9}
    r = ReqInput("r", 0, [1, 2, 3], 0, [5, 6, 7], num_draft=2, token_bitmask=masks)
    (mask,) = _check_each([r], _lim(), set(), {})
    assert mask is not None and mask.shape == (3, 1) and mask[:, 0].tolist() == [1, 2, 516]
    msg = step_codec.step_to_pb(StepRequest(3, reqs=[r]))
    assert step_codec.step_from_pb(wpb.StepRequest.FromString(msg.SerializeToString())).reqs == [r]


def test_worker_drafts_travel_as_a_flag_and_need_drafts() -> None:
    r = ReqInput("a", 0, [1, 0, 0], 0, [9, 11, 12], num_draft=2, worker_drafts=True)
    msg = step_codec.step_to_pb(StepRequest(3, reqs=[r]))
    assert msg.batch.flags[0] & wpb.REQ_FLAG_WORKER_DRAFTS
    assert step_codec.step_from_pb(wpb.StepRequest.FromString(msg.SerializeToString())).reqs == [r]
    _check_each([r], _lim(), set(), {})
    r.num_draft = 0
    with pytest.raises(StepError, match="worker_drafts needs num_draft > 0"):
        _check_each([r], _lim(), set(), {})


def test_num_draft_travels_only_when_used() -> None:
    plain = [ReqInput("a", 0, [1], 4, [9]), ReqInput("b", 1, [2], 4, [10])]
    assert not step_codec.step_to_pb(StepRequest(1, reqs=plain)).batch.num_draft
    drafting = [ReqInput("a", 0, [1, 5, 6], 4, [9, 11, 12], num_draft=2), ReqInput("b", 1, [2], 4, [10])]
    msg = step_codec.step_to_pb(StepRequest(2, reqs=drafting))
    assert list(msg.batch.num_draft) == [2, 0]
    assert step_codec.step_from_pb(wpb.StepRequest.FromString(msg.SerializeToString())).reqs == drafting
    msg.batch.num_draft.pop()
    with pytest.raises(ValueError, match=r"batch\.num_draft has 1 entries for 2 requests"):
        step_codec.step_from_pb(msg)


def test_config_refuses_bad_settings() -> None:
    with pytest.raises(ConfigError, match="speculative_num_draft_tokens"):
        SchedulerConfig(worker="x:1", speculative_algorithm="ngram", speculative_num_draft_tokens=0).validate()
    with pytest.raises(ConfigError, match="speculative_min_accepted"):
        SchedulerConfig(worker="x:1", speculative_min_accepted=-1).validate()
    with pytest.raises(ConfigError, match="ngram sizes"):
        SchedulerConfig(worker="x:1", speculative_ngram_min=3, speculative_ngram_max=2).validate()
    assert SchedulerConfig(worker="x:1", speculative_algorithm="ngram").loop().spec.algorithm == "ngram"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _steps(pacer: Pacer, clock: _Clock, n: int, count: int, rate: dict[bool, float]) -> list[bool]:
    """``count`` pure decode steps of ``n`` requests, each 20 ms, producing the tokens that
    ``rate`` (tokens/s) gives the mode the pacer is in when the step is planned; the modes, in turn."""
    modes = []
    for _ in range(count):
        on = pacer.allows(n)
        modes.append(on)
        clock.now += 0.02
        pacer.observe(n, round(rate[on] * 0.02), counted=True)
    return modes


def test_pacer_keeps_drafting_where_it_is_faster_and_retries_the_other_mode() -> None:
    clock = _Clock()
    pacer = Pacer(window=4, settle=1, clock=clock)
    faster = {True: 150.0, False: 50.0}  # drafting: 3 tokens per step; plain: 1
    modes = _steps(pacer, clock, 1, 11, faster)
    # drafting first: the first commit has no interval and the next settles (planned before the
    # mode was known), then a window of 4; then a window without drafts (settle + 4)
    assert modes == [True] * 6 + [False] * 5 and pacer.allows(1)
    assert pacer.counters.windows_on == 1 and pacer.counters.windows_off == 1
    # drafting stays on for 4 windows, then plain decode is tried for one window, found slower
    # again: drafting resumes and the next try waits 8 windows
    modes = _steps(pacer, clock, 1, 17 + 5 + 5, faster)
    assert modes == [True] * 17 + [False] * 5 + [True] * 5
    assert pacer._buckets[0].probe_every == 8 and pacer.counters.windows_off == 2


def test_pacer_stops_drafting_where_it_is_slower_and_per_batch_size() -> None:
    clock = _Clock()
    pacer = Pacer(window=4, settle=1, clock=clock)
    slower = {True: 50.0, False: 100.0}  # the GPU's case: a verify costs more than the decodes it saves
    assert _steps(pacer, clock, 1, 11, slower) == [True] * 6 + [False] * 5 and not pacer.allows(1)
    assert pacer.allows(2) and pacer.allows(8)  # other batch sizes are measured on their own
    # off for 4 windows (the measuring one counts), then drafting is tried once, found slower again
    assert _steps(pacer, clock, 1, 12, slower) == [False] * 12 and pacer.allows(1)
    assert _steps(pacer, clock, 1, 5, slower) == [True] * 5 and not pacer.allows(1)
    assert pacer._buckets[0].probe_every == 8
    # a tie goes to plain decode (it keeps overlap and costs no drafting time)
    tie = Pacer(window=4, settle=0, clock=clock)
    _steps(tie, clock, 3, 9, {True: 100.0, False: 100.0})
    assert not tie.allows(3) and not tie.allows(4) and tie.allows(5)


def test_pacer_counts_only_pure_decode_steps_that_follow_a_step() -> None:
    clock = _Clock()
    pacer = Pacer(window=2, settle=0, clock=clock)
    for counted in (True, False, True, True):  # the second step had a prefill
        clock.now += 1.0
        pacer.observe(1, 5, counted=counted)
    # the first commit has no interval and the prefill step is not counted: the window closes on
    # the last two, 5 tokens each in 1 s
    assert pacer.counters.windows_on == 1 and pacer._buckets[0].rate[True] == 5.0
    with pytest.raises(ValueError, match="window 0"):
        Pacer(window=0)
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]


def test_pacer_leaves_out_a_stall() -> None:
    """A step far over its window's median (a first-call compile) is no cost of the mode: the
    window's rate is the other steps'. A verify step a few times a decode's stays in."""
    clock = _Clock()
    pacer = Pacer(window=4, settle=0, clock=clock)
    pacer.observe(1, 1, counted=True)  # the first commit: no interval yet
    for seconds, tokens in ((0.02, 3), (1.5, 3), (0.02, 3), (0.1, 4)):
        clock.now += seconds
        pacer.observe(1, tokens, counted=True)
    assert pacer._buckets[0].rate[True] == pytest.approx(10 / 0.14)
    with pytest.raises(ValueError, match=r"stall 1\.0"):
        Pacer(stall=1.0)


def test_speculator_drafts_only_where_the_pacer_allows() -> None:
    spec = Speculator(SpecConfig("ngram", num_draft_tokens=2, max_batch=8), context_length=64)
    assert spec.pacer is not None and SpecConfig().adaptive
    loop = _req([3, 4] * 5)
    assert spec.draft(loop, 1) == [3, 4]
    spec.pacer._buckets[0].on = False  # measured slower at batch 1
    assert spec.draft(loop, 1) == [] and not spec.drafting(loop, 1) and spec.draft(loop, 2) == [3, 4]
    assert Speculator(SpecConfig("ngram", adaptive=False), context_length=64).pacer is None
