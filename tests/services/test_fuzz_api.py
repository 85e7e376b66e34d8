"""Fuzzing the public API on the real stack: random ``GenerateRequest`` messages and random bytes.

Every answer is OK or a precise status (never UNKNOWN or INTERNAL), and afterwards the server
answers a normal greedy request exactly as before. ``make test`` runs a bounded number of cases;
``make fuzz`` (STRATA_FUZZ_EXAMPLES=2000) a longer run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.supervisor import Stack
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc

EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "60"))
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.5, 1.0, 2.0]))
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)
REFERENCE = pb.GenerateRequest(text="the reference", sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=12))


@st.composite
def requests(draw: st.DrawFn) -> pb.GenerateRequest:
    maybe_text = st.one_of(st.just(""), TEXT)
    req = pb.GenerateRequest(request_id=draw(maybe_text), cache_salt=draw(maybe_text))
    kind = draw(st.sampled_from(["text", "messages", "ids", "none"]))
    if kind == "text":
        req.text = draw(TEXT)
    elif kind == "messages":
        roles = st.sampled_from(["user", "system", "assistant", "x"])
        for role, content in draw(st.lists(st.tuples(roles, TEXT), max_size=3)):
            req.messages.messages.add(role=role, content=content)
    elif kind == "ids":
        req.input_ids.ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=20)))
    s = req.sampling
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if draw(st.booleans()):
            setattr(s, name, draw(FLOATS))
    s.top_k = draw(st.integers(-(2**31), 2**31 - 1))
    if draw(st.booleans()):
        s.max_new_tokens = draw(st.one_of(st.integers(0, 24), st.integers(0, 2**32 - 1)))
    s.stop.extend(draw(st.lists(TEXT, max_size=3)))
    s.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)))
    s.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    req.top_logprobs = draw(st.integers(0, 2**32 - 1))
    req.return_logprobs = draw(st.booleans())
    req.stream = draw(st.booleans())
    constraint = draw(st.sampled_from(["", "json_schema", "regex", "ebnf"]))
    if constraint:
        setattr(req, constraint, draw(st.one_of(TEXT, st.just('{"type": "integer"}'), st.just("[a-z]{1,3}"))))
    return req


@pytest.fixture(scope="module")
def stack(plain_stack: Stack) -> Stack:  # tests/shared_stacks.py
    return plain_stack


@pytest.fixture(scope="module")
def channel(stack: Stack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(stack.child("tokenizer").address) as ch:
        yield ch


def _answer(call: Iterator[object]) -> grpc.StatusCode:
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_fuzzed_requests_get_precise_statuses(channel: grpc.Channel) -> None:
    api = pgrpc.StrataStub(channel)
    before = [r.token_ids for r in api.Generate(REFERENCE, timeout=60)]
    seen: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(requests())
    def one(req: pb.GenerateRequest) -> None:
        code = _answer(api.Generate(req, timeout=60))
        seen[code.name] = seen.get(code.name, 0) + 1
        assert code not in BAD, (code, req)

    one()
    assert set(seen) - {"OK"}, seen  # the fuzzer did reach the error paths
    after = [r.token_ids for r in api.Generate(REFERENCE, timeout=60)]
    assert after == before


def test_fuzzed_bytes_get_precise_statuses(channel: grpc.Channel) -> None:
    raw = channel.unary_stream("/strata.v1.Strata/Generate", request_serializer=None, response_deserializer=None)
    tokenize = channel.unary_unary("/strata.v1.Strata/Tokenize", request_serializer=None, response_deserializer=None)

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.binary(max_size=300))
    def one(payload: bytes) -> None:
        assert _answer(raw(payload, timeout=60)) not in BAD, payload
        try:
            tokenize(payload, timeout=30)
        except grpc.RpcError as e:
            assert e.code() not in BAD, (e, payload)

    one()
    api = pgrpc.StrataStub(channel)
    assert [r.token_ids for r in api.Generate(REFERENCE, timeout=60)][-1]
