"""The step on the wire: every kind of request and result survives the columnar encoding, and a
batch whose columns do not describe one batch is refused with a ``ValueError`` naming the field
(which the worker turns into INVALID_ARGUMENT)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.common import step_codec
from services.common.step import (
    GREEDY,
    JobResult,
    MambaCopy,
    PromptScores,
    ReleaseRow,
    ReqInput,
    ReqOutput,
    SamplingParams,
    StepRequest,
    StepResult,
    TokenLogprob,
)
from strata.worker.v1 import worker_pb2 as wpb

# Values exact in float32 (the public SamplingParams message), so they round-trip unchanged.
SAMPLED = SamplingParams(temperature=0.5, top_p=0.75, top_k=5, min_p=0.25)
PENALISED = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=-0.25)


def every_kind_of_request() -> list[ReqInput]:
    return [
        # A prefill over a cached prefix, with every first-step extra.
        ReqInput(
            "prefill", 3, [5, 6, 7], 2, [40, 41, 42], prefix_slots=[8, 9], sampling=PENALISED, seed=2**64 - 1,
            history_ids=[1, 2, 5, 6, 7], trace_context={"traceparent": "00-ab-cd-01", "tracestate": "x=1"},
        ),
        # Overlap decode: the input is the row's previous sample.
        ReqInput("decode", 0, [], 17, [50], sampling=SAMPLED, seed=7, output_index=9, use_last_sample=True),
        # A middle chunk of a chunked prefill: nothing sampled.
        ReqInput("chunk", 1, [9] * 4, 0, [60, 61, 62, 63], sample=False),
        # Grammar now and logprobs.
        ReqInput(
            "grammar", 2, [4], 30, [70], token_bitmask=b"\xff\x00\x00\x01" * 3, return_logprobs=True, top_logprobs=20,
        ),
        # Grammar later (overlap), greedy.
        ReqInput("late", 5, [], 12, [80], sampling=GREEDY, use_last_sample=True, mask_follows=True),
    ]


def hybrid_requests() -> list[ReqInput]:
    return [
        ReqInput("h0", 0, [1, 2], 0, [3, 4], mamba_slot=0),
        ReqInput("h1", 1, [], 8, [9], mamba_slot=11, use_last_sample=True, sampling=SAMPLED),
    ]


@pytest.mark.parametrize("reqs", [every_kind_of_request(), hybrid_requests(), []], ids=["dense", "hybrid", "ops-only"])
def test_a_step_round_trips(reqs: list[ReqInput]) -> None:
    step = StepRequest(41, [MambaCopy(1, 2), ReleaseRow(4)], reqs)
    msg = step_codec.step_to_pb(step)
    assert step_codec.step_from_pb(wpb.StepRequest.FromString(msg.SerializeToString())) == step
    assert msg.HasField("batch") == bool(reqs)


def test_sampling_parameters_are_interned() -> None:
    more = [ReqInput(f"more{i}", 10 + i, [1], 0, [100 + i], sampling=SAMPLED) for i in range(9)]
    reqs = every_kind_of_request() + more
    batch = step_codec.step_to_pb(StepRequest(1, reqs=reqs)).batch
    assert len(batch.sampling_table) == 3  # PENALISED, SAMPLED and GREEDY (ReqInput's default)
    assert len(batch.extras) == 2  # only the requests with history, trace context or a bitmask


def test_results_round_trip() -> None:
    lp = TokenLogprob(7, -0.5, ((7, -0.5), (3, -1.25)))
    result = StepResult(
        9, [ReqOutput(3, 7, lp), ReqOutput(0, 12), ReqOutput(2, 4, TokenLogprob(4, -2.0))], ops_done=2,
        forward_s=0.25, sample_s=0.125, idle_s=0.5, num_slots=1 << 20, kv_committed_bytes=1 << 30,
        jobs=[JobResult(5, True, 3)],
    )
    msg = step_codec.result_to_pb(result)
    assert list(msg.token_ids) == [7, 12, 4] and [e.index for e in msg.logprobs] == [0, 2]
    assert step_codec.result_from_pb(wpb.StepResult.FromString(msg.SerializeToString())) == result


def _good() -> wpb.StepRequest:
    return step_codec.step_to_pb(StepRequest(3, reqs=every_kind_of_request()))


PER_REQUEST = (
    "request_ids", "start_pos", "num_input_ids", "num_prefix_slots", "num_new_slots", "mamba_slots", "flags", "seeds",
    "output_index", "top_logprobs", "sampling_index",
)  # fmt: skip


def _drop_last(name: str) -> Callable[[wpb.ReqColumns], None]:
    return lambda b: getattr(b, name).pop()


# What each corruption of the good batch (5 requests, 8 input ids, 2 prefix slots, 10 new slots,
# 3 sampling entries, extras at 0 and 3) does, and what the error must say.
MALFORMED: dict[str, tuple[Callable[[wpb.ReqColumns], None], str]] = {
    **{f"short {name}": (_drop_last(name), f"batch.{name} has 4 entries for 5 requests") for name in PER_REQUEST},
    "extra input id": (lambda b: b.input_ids.append(1), "batch.input_ids has 9 entries but batch.num_input_ids adds"),
    "missing prefix slot": (lambda b: b.prefix_slots.pop(), "batch.prefix_slots has 1 entries"),
    "new slot counts": (lambda b: b.num_new_slots.__setitem__(0, 2), "batch.num_new_slots adds up to 9"),
    "unknown flag": (lambda b: b.flags.__setitem__(1, b.flags[1] | 64), "batch.flags[1]"),
    "sampling index": (lambda b: b.sampling_index.__setitem__(2, 3), "batch.sampling_index[2]=3"),
    "no sampling table": (lambda b: b.ClearField("sampling_table"), "batch.sampling_index[0]=0"),
    "extra index": (lambda b: b.extras.add(index=5), "batch.extras: index 5"),
    "extras out of order": (lambda b: b.extras.add(index=0), "batch.extras: index 0 after 3"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_batch_is_refused_naming_the_field(name: str) -> None:
    corrupt, fragment = MALFORMED[name]
    msg = _good()
    corrupt(msg.batch)
    with pytest.raises(ValueError) as err:
        step_codec.step_from_pb(msg)
    assert fragment in str(err.value), (name, str(err.value))


def test_malformed_results_are_refused_naming_the_field() -> None:
    msg = step_codec.result_to_pb(StepResult(1, [ReqOutput(0, 5), ReqOutput(1, 6, TokenLogprob(6, -1.0))]))
    short = wpb.StepResult()
    short.CopyFrom(msg)
    short.token_ids.pop()
    with pytest.raises(ValueError, match="token_ids has 1 entries for 2 sampled_rows"):
        step_codec.result_from_pb(short)
    msg.logprobs.add(index=2)
    with pytest.raises(ValueError, match="logprobs: index 2"):
        step_codec.result_from_pb(msg)


def scoring_requests() -> list[ReqInput]:
    """Chunks that score their prompt: a middle one (scored against the next prompt token) and the
    last one (its last position predicts the sample), beside an ordinary decode."""
    return [
        ReqInput(
            "mid", 0, [5, 6, 7], 0, [10, 11, 12], sample=False, top_logprobs=3, prompt_logprobs=True, next_prompt_id=0
        ),
        ReqInput("decode", 1, [], 9, [20], use_last_sample=True),
        ReqInput("last", 2, [8, 9], 3, [13, 14], return_logprobs=True, top_logprobs=2, prompt_logprobs=True),
    ]


def test_prompt_scoring_round_trips() -> None:
    step = StepRequest(7, reqs=scoring_requests())
    msg = step_codec.step_to_pb(step)
    assert [f & wpb.REQ_FLAG_PROMPT_LOGPROBS for f in msg.batch.flags] == [wpb.REQ_FLAG_PROMPT_LOGPROBS, 0, 32]
    assert [(e.index, e.HasField("next_prompt_id")) for e in msg.batch.extras] == [(0, True)]  # 0 is a value
    assert step_codec.step_from_pb(wpb.StepRequest.FromString(msg.SerializeToString())) == step


def test_prompt_scores_round_trip() -> None:
    mid = PromptScores(
        (
            TokenLogprob(6, -1.5, ((6, -1.5), (2, -2.0), (9, -2.5))),
            TokenLogprob(7, -3.0, ((1, -0.5), (7, -3.0), (4, -4.0))),
            TokenLogprob(0, -0.25, ((0, -0.25), (3, -2.0), (5, -3.5))),
        ),
        (1, 2, 1),
    )
    last = PromptScores((TokenLogprob(9, -2.0, ((4, -1.0), (9, -2.0))),), (2,))
    empty = PromptScores((), ())
    result = StepResult(3, [ReqOutput(2, 4)], prompt=[mid, empty, last])
    msg = step_codec.result_to_pb(result)
    assert list(msg.prompt_counts) == [3, 0, 1] and list(msg.prompt_num_top) == [3, 0, 2]
    assert step_codec.result_from_pb(wpb.StepResult.FromString(msg.SerializeToString())) == result
    assert not step_codec.result_to_pb(StepResult(4, [ReqOutput(0, 1)])).prompt_counts  # nothing when none scored


# Corruptions of a scoring batch (``scoring_requests``) and the field each error must name.
SCORING_MALFORMED: dict[str, tuple[Callable[[wpb.ReqColumns], None], str]] = {
    "scoring a decode": (lambda b: b.flags.__setitem__(1, b.flags[1] | wpb.REQ_FLAG_PROMPT_LOGPROBS), "batch.flags[1]"),
    "next id without scoring": (lambda b: b.flags.__setitem__(0, wpb.REQ_FLAG_NONE), "batch.extras[0].next_prompt_id"),
    "next id on a sampled chunk": (lambda b: b.flags.__setitem__(0, b.flags[0] | wpb.REQ_FLAG_SAMPLE),
                                   "batch.extras[0].next_prompt_id"),
}  # fmt: skip


@pytest.mark.parametrize("name", SCORING_MALFORMED)
def test_a_malformed_scoring_batch_is_refused_naming_the_field(name: str) -> None:
    corrupt, fragment = SCORING_MALFORMED[name]
    msg = step_codec.step_to_pb(StepRequest(3, reqs=scoring_requests()))
    corrupt(msg.batch)
    with pytest.raises(ValueError) as err:
        step_codec.step_from_pb(msg)
    assert fragment in str(err.value), (name, str(err.value))


@pytest.mark.parametrize(
    ("column", "fragment"),
    [("prompt_num_top", "prompt_num_top has 1 entries for 2 prompt_counts"), ("prompt_ranks", "prompt_ranks has 1"),
     ("prompt_top_ids", "prompt_top_ids has 3"), ("prompt_logprobs", "prompt_logprobs has 1")],
)  # fmt: skip
def test_malformed_prompt_scores_are_refused_naming_the_column(column: str, fragment: str) -> None:
    pair = (TokenLogprob(1, -1.0, ((1, -1.0), (2, -2.0))), TokenLogprob(2, -2.0, ((1, -0.5), (2, -2.0))))
    scores = PromptScores(pair, (1, 2))
    msg = step_codec.result_to_pb(StepResult(1, prompt=[scores, PromptScores((), ())]))
    getattr(msg, column).pop()
    with pytest.raises(ValueError) as err:
        step_codec.result_from_pb(msg)
    assert fragment in str(err.value), str(err.value)
