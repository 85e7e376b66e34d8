"""The tokenizer resumes a stream whose scheduler was lost (issue #29), against scripted schedulers:
what the continuation carries (prompt, the tokens streamed, the same seed and stop conditions,
max_new_tokens made explicit), what the client sees (one uninterrupted stream, usage of the whole
request), and the bounds (a lost scheduler that never answers, UNAVAILABLE with no other replica).
The real processes are exercised by tests/services/test_replicas.py and test_up.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from services.tokenizer.model_files import ModelCard
from services.tokenizer.router import Router
from services.tokenizer.server import Relay, StrataServicer
from services.tokenizer.session import Chunk, Inbox
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.v1 import strata_pb2 as pb

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
CARD = ModelCard("m", "Qwen3ForCausalLM", 1000, 4096, (2,), False)


class Words:
    """A tokenizer whose token ``i`` is the word ``wi``."""

    clean_up_tokenization_spaces = False

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" w{i}" for i in ids)


Script = Callable[[spb.GenerateRequest], list[Chunk]]


class Scheduler:
    """One scripted scheduler: each submission gets the chunks its script returns, at once."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.submitted: list[spb.GenerateRequest] = []

    def submit(self, sreq: spb.GenerateRequest, trace_context: dict[str, str], timeout_s: float | None) -> Inbox:
        self.submitted.append(sreq)
        inbox = Inbox(len(self.submitted), lambda handle: None)
        for chunk in self.script(sreq):
            inbox.put(chunk)
        return inbox


class Replicas(Router):
    """A router over scripted schedulers (round-robin from the first)."""

    def __init__(self, schedulers: dict[str, Scheduler], roles: dict[str, str] | None = None) -> None:
        super().__init__(fixed="-", policy="round_robin", wait_s=0.2)
        self.schedulers = schedulers
        self.roles = roles or {}

    def _addresses(self, role: str = "") -> list[str]:
        serving = [a for a in self.schedulers if self.roles.get(a, "both") in ("both", role)] if role else []
        return sorted(serving or self.schedulers)

    def session(self, address: str) -> Scheduler:  # type: ignore[override]
        return self.schedulers[address]


def lost(*tokens: int) -> list[Chunk]:
    """Tokens, then the session breaks (the scheduler died)."""
    end = spb.RequestEnd(status_code=UNAVAILABLE, error="Socket closed")
    return [Chunk(list(tokens)), Chunk(end=end, lost=True)]


def finished(*tokens: int, prompt: int = 3, cached: int = 0) -> list[Chunk]:
    usage = pb.Usage(prompt_tokens=prompt, completion_tokens=0, cached_tokens=cached)
    end = spb.RequestEnd(finish_reason=pb.FINISH_REASON_LENGTH, usage=usage)
    return [Chunk(list(tokens), end=end)]


def _generate(router: Router, request: pb.GenerateRequest, resume_wait_s: float = 1.0) -> list[pb.GenerateResponse]:
    async def run() -> list[pb.GenerateResponse]:
        servicer = StrataServicer(Words(), CARD, router, resume_wait_s=resume_wait_s)
        return [r async for r in servicer.generate(request)]

    return asyncio.run(run())


def _request(n: int = 6, **sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        input_ids=pb.TokenIds(ids=[5, 6, 7]), stream=True, sampling=pb.SamplingParams(max_new_tokens=n, **sampling)
    )  # type: ignore[arg-type]


def test_a_lost_scheduler_s_stream_goes_on_on_another_from_its_tokens() -> None:
    def first(sreq: spb.GenerateRequest) -> list[Chunk]:
        return [Chunk([10]), *lost(11)]

    def second(sreq: spb.GenerateRequest) -> list[Chunk]:
        end = finished(12, 13, 14, 15, cached=2)
        end[0].end.usage.completion_tokens = 6  # type: ignore[union-attr]  # the output given counts
        return end

    a, b = Scheduler(first), Scheduler(second)
    out = _generate(Replicas({"a": a, "b": b}), _request(6, temperature=0.8, stop=["w99"]))
    ids = [t for r in out for t in r.token_ids]
    assert ids == [10, 11, 12, 13, 14, 15] and "".join(r.text for r in out) == "".join(f" w{i}" for i in ids)
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(r.token_ids or r.finish_reason for r in out)  # no empty message where it broke
    usage = out[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (3, 6, 0)  # cached: where it began
    (orig,), (cont,) = a.submitted, b.submitted
    assert orig.sampling.HasField("seed")  # the tokenizer's, so the continuation draws the same
    assert list(cont.input_ids) == [5, 6, 7] and list(cont.output_ids) == [10, 11]
    assert cont.sampling.seed == orig.sampling.seed and list(cont.sampling.stop) == ["w99"]
    assert cont.sampling.max_new_tokens == 6 and cont.request_id == orig.request_id


def test_a_handed_over_request_goes_on_on_a_decode_replica() -> None:
    """Prefill/decode disaggregation (issue #31): the prefill replica ends the request after its
    first token with ``handoff``; the tokenizer continues it on the decode replica (prompt, the
    token so far as output_ids, the same seed); the client sees one stream, usage of the whole."""

    def prefill(sreq: spb.GenerateRequest) -> list[Chunk]:
        usage = pb.Usage(prompt_tokens=3, completion_tokens=1, cached_tokens=2)
        return [Chunk([10]), Chunk(end=spb.RequestEnd(usage=usage, handoff=True))]

    def decode(sreq: spb.GenerateRequest) -> list[Chunk]:
        end = finished(11, 12, 13, cached=3)
        end[0].end.usage.completion_tokens = 4  # type: ignore[union-attr]
        return end

    # "a" would come first by name (round-robin): the roles, not the order, put the prefill on "p".
    p, d = Scheduler(prefill), Scheduler(decode)
    out = _generate(Replicas({"a": d, "p": p}, roles={"a": "decode", "p": "prefill"}), _request(4, temperature=0.7))
    assert [t for r in out for t in r.token_ids] == [10, 11, 12, 13]
    assert all(r.token_ids or r.finish_reason for r in out)  # the hand-over sends no empty message
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    # cached: where it began (the prefill side's started message; none in this script), not the decode side's 3
    assert (out[-1].usage.completion_tokens, out[-1].usage.cached_tokens) == (4, 0)
    (orig,), (cont,) = p.submitted, d.submitted
    assert list(cont.input_ids) == [5, 6, 7] and list(cont.output_ids) == [10]
    assert cont.sampling.seed == orig.sampling.seed and cont.request_id == orig.request_id


def test_a_lost_scheduler_is_submitted_again_until_it_is_back() -> None:
    """One replica, restarting: its first submissions fail (connection refused), then it serves."""
    tries = iter([lost(), lost(), finished(10, 11)])
    a = Scheduler(lambda sreq: next(tries))
    out = _generate(Replicas({"a": a}), _request(2))
    assert [t for r in out for t in r.token_ids] == [10, 11] and len(a.submitted) == 3


def test_a_lost_scheduler_that_never_comes_back_ends_unavailable_within_the_wait() -> None:
    a = Scheduler(lambda sreq: lost())
    with pytest.raises(Relay) as e:
        _generate(Replicas({"a": a}), _request(), resume_wait_s=0.5)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and 2 <= len(a.submitted) <= 5


def test_a_stream_cut_and_never_resumed_streams_its_tokens_then_fails() -> None:
    calls = iter([lost(10, 11)])
    a = Scheduler(lambda sreq: next(calls, lost()))
    got: list[int] = []

    async def run() -> None:
        servicer = StrataServicer(Words(), CARD, Replicas({"a": a}), resume_wait_s=0.3)
        async for r in servicer.generate(_request()):
            got.extend(r.token_ids)

    with pytest.raises(Relay) as e:
        asyncio.run(run())
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and got == [10, 11]
    assert list(a.submitted[-1].output_ids) == [10, 11]


def test_a_scheduler_without_worker_moves_the_stream_only_while_another_replica_exists() -> None:
    no_worker = [Chunk([10]), Chunk(end=spb.RequestEnd(status_code=UNAVAILABLE, error="the worker was lost"))]
    a, b = Scheduler(lambda sreq: list(no_worker)), Scheduler(lambda sreq: finished(11))
    out = _generate(Replicas({"a": a, "b": b}), _request(2))
    assert [t for r in out for t in r.token_ids] == [10, 11] and list(b.submitted[0].output_ids) == [10]
    alone = Scheduler(lambda sreq: list(no_worker))
    with pytest.raises(Relay) as e:  # nowhere to go: the scheduler's status, as before
        _generate(Replicas({"a": alone}), _request(2))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "worker was lost" in str(e.value)
    assert len(alone.submitted) == 1


def test_other_failures_are_not_resumed() -> None:
    bad = spb.RequestEnd(status_code=grpc.StatusCode.INVALID_ARGUMENT.value[0], error="bad grammar")
    a, b = Scheduler(lambda sreq: [Chunk(end=bad)]), Scheduler(lambda sreq: finished(1))
    with pytest.raises(Relay) as e:
        _generate(Replicas({"a": a, "b": b}), _request())
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and not b.submitted
