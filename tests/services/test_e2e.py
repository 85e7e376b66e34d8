"""End to end: real etcd and the four services as separate processes, talking real gRPC.

Greedy output through ``strata.v1.Strata/Generate`` must equal transformers' ``generate`` on the
same tiny checkpoint, token for token; bad input gets INVALID_ARGUMENT naming the field, and the
server keeps serving; one request leaves spans from every service under one trace id. The stack
runs with everything on at once: the hierarchical cache (host pool + L3), overlap scheduling and
speculative decoding (``--speculative-algorithm ngram``, without the pacer, so that drafts are
sent wherever they can be rather than where they are measured to pay), so every test here also
checks that speculation changes nothing a client sees.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.discovery import Discovery
from services.common.etcd_proc import free_port
from services.supervisor import Stack, start_stack
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc
from tests.reference import hf_greedy, hf_tokenizer

PROMPTS = ["The cache keeps", "Once upon a time the server", "tokens and pages"]


@pytest.fixture(scope="module")
def stack(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("stack")
    common = ("--trace-exporter", "file", "--trace-target", str(run_dir / "spans-{service}.jsonl"))
    # As `make run` starts it: the hierarchical cache on (host pool + kvstore L3); and speculation.
    worker = ("--host-cache-bytes", str(64 << 20), "--l3", "true")
    scheduler = ("--speculative-algorithm", "ngram", "--speculative-adaptive", "false", "--metrics-port", "0")
    s = start_stack(
        tiny_qwen3, free_port(), run_dir, common_args=common, worker_args=worker, scheduler_args=scheduler,
        say=lambda _: None, grammar_preload=False,
    )  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api(stack: Stack) -> Iterator[pgrpc.StrataStub]:
    with grpc.insecure_channel(stack.child("tokenizer").address) as ch:
        yield pgrpc.StrataStub(ch)


def _greedy(n: int, **kw: object) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_new_tokens=n, **kw)  # type: ignore[arg-type]


def _collect(responses: Iterator[pb.GenerateResponse]) -> tuple[list[int], str, pb.GenerateResponse]:
    ids: list[int] = []
    text = ""
    last = pb.GenerateResponse()
    for r in responses:
        ids += r.token_ids
        text += r.text
        last = r
    return ids, text, last


@pytest.mark.parametrize("stream", [True, False])
def test_greedy_text_matches_transformers(api: pgrpc.StrataStub, tiny_qwen3: Path, stream: bool) -> None:
    tok = hf_tokenizer(str(tiny_qwen3))
    for prompt in PROMPTS:
        ids = tok.encode(prompt, add_special_tokens=False)
        want = hf_greedy(tiny_qwen3, ids, 24)
        got, text, last = _collect(api.Generate(pb.GenerateRequest(text=prompt, sampling=_greedy(24), stream=stream)))
        assert got == want, prompt
        assert text == tok.decode(want, skip_special_tokens=True)
        assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert last.usage.prompt_tokens == len(ids)
        assert last.usage.completion_tokens == len(want)


def test_greedy_chat_and_token_ids(api: pgrpc.StrataStub, tiny_qwen3: Path) -> None:
    tok = hf_tokenizer(str(tiny_qwen3))
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a cache."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = hf_greedy(tiny_qwen3, ids, 20)
    req = pb.GenerateRequest(sampling=_greedy(20), stream=True)
    for m in msgs:
        req.messages.messages.add(role=m["role"], content=m["content"])
    assert _collect(api.Generate(req))[0] == want
    by_ids = pb.GenerateRequest(input_ids=pb.TokenIds(ids=ids), sampling=_greedy(20))
    assert _collect(api.Generate(by_ids))[0] == want


def test_ignore_eos_and_length(api: pgrpc.StrataStub, tiny_qwen3: Path) -> None:
    tok = hf_tokenizer(str(tiny_qwen3))
    ids = tok.encode(PROMPTS[0], add_special_tokens=False)
    want = hf_greedy(tiny_qwen3, ids, 40, stop_at_eos=False)
    req = pb.GenerateRequest(text=PROMPTS[0], sampling=_greedy(40, ignore_eos=True))
    got, _, last = _collect(api.Generate(req))
    assert got == want and last.finish_reason == pb.FINISH_REASON_LENGTH


def test_stop_string_ends_with_stop(api: pgrpc.StrataStub, tiny_qwen3: Path) -> None:
    tok = hf_tokenizer(str(tiny_qwen3))
    ids = tok.encode(PROMPTS[1], add_special_tokens=False)
    full = tok.decode(hf_greedy(tiny_qwen3, ids, 30, stop_at_eos=False), skip_special_tokens=True)
    stop = full[8:11] if len(full.strip()) > 12 else full[-2:]
    req = pb.GenerateRequest(text=PROMPTS[1], sampling=_greedy(30, ignore_eos=True, stop=[stop]), stream=True)
    _, text, last = _collect(api.Generate(req))
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert text == full[: full.find(stop)]


def test_seeded_sampling_is_reproducible(api: pgrpc.StrataStub) -> None:
    sp = pb.SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=1234, ignore_eos=True)
    a = _collect(api.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=sp)))[0]
    b = _collect(api.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=sp)))[0]
    assert a == b and len(a) == 16


BAD = [
    ("empty text", pb.GenerateRequest(text=""), "input.text"),
    ("no input", pb.GenerateRequest(), "input"),
    ("empty ids", pb.GenerateRequest(input_ids=pb.TokenIds(ids=[])), "input.input_ids"),
    ("id >= vocab", pb.GenerateRequest(input_ids=pb.TokenIds(ids=[1, 10_000_000])), "vocabulary size"),
    (
        "max_new_tokens > context",
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=10**7)),
        "sampling.max_new_tokens",
    ),
    (
        "negative temperature",
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1)),
        "sampling.temperature",
    ),
    (
        "NaN temperature",
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=math.nan)),
        "sampling.temperature",
    ),
    ("top_p 0", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0.0)), "sampling.top_p"),
    ("top_p > 1", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=1.5)), "sampling.top_p"),
    (
        "unknown role",
        pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="x")])),
        "input.messages[0].role",
    ),
]


@pytest.mark.parametrize(("name", "req", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_invalid_argument(api: pgrpc.StrataStub, name: str, req: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(api.Generate(req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert field in err.value.details()
    # The server keeps serving.
    ok = _collect(api.Generate(pb.GenerateRequest(text="hi", sampling=_greedy(2, ignore_eos=True))))[0]
    assert len(ok) == 2


def test_detokenize_bad_id_and_model_info(api: pgrpc.StrataStub, tiny_qwen3: Path) -> None:
    info = api.GetModelInfo(pb.GetModelInfoRequest())
    assert info.architecture == "Qwen3ForCausalLM" and info.vocab_size > 0 and info.fingerprint
    with pytest.raises(grpc.RpcError) as err:
        api.Detokenize(pb.DetokenizeRequest(ids=[info.vocab_size]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ids = api.Tokenize(pb.TokenizeRequest(text="the cache")).ids
    assert api.Detokenize(pb.DetokenizeRequest(ids=ids)).text == "the cache"


def _load(stack: Stack) -> spb.Load:
    with grpc.insecure_channel(stack.child("scheduler").address) as ch:
        return sgrpc.SchedulerStub(ch).GetLoad(spb.GetLoadRequest())


def _wait_idle(stack: Stack, timeout_s: float = 10.0) -> spb.Load:
    deadline = time.monotonic() + timeout_s
    while True:
        load = _load(stack)
        if (load.running == 0 and load.waiting == 0 and load.used_slots == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def test_client_cancel_and_abort_free_slots(api: pgrpc.StrataStub, stack: Stack) -> None:
    long = pb.SamplingParams(temperature=0.0, max_new_tokens=1500, ignore_eos=True)
    call = api.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=long, stream=True))
    next(call)
    call.cancel()
    load = _wait_idle(stack)
    assert (load.running, load.waiting, load.used_slots) == (0, 0, 0)

    call = api.Generate(pb.GenerateRequest(request_id="abort-me", text=PROMPTS[1], sampling=long, stream=True))
    next(call)
    assert api.Abort(pb.AbortRequest(request_id="abort-me")).aborted
    last = list(call)[-1]
    assert last.finish_reason == pb.FINISH_REASON_ABORT
    load = _wait_idle(stack)
    assert (load.running, load.waiting, load.used_slots) == (0, 0, 0)


def test_one_trace_id_across_services(api: pgrpc.StrataStub, stack: Stack) -> None:
    # Long enough for whole L3 pages, so the scheduler's L3 lookup has keys to ask for.
    list(api.Generate(pb.GenerateRequest(request_id="traced", text=" ".join(PROMPTS * 12), sampling=_greedy(4))))
    deadline = time.monotonic() + 10
    services: set[str] = set()
    while time.monotonic() < deadline:
        spans = []
        for f in stack.run_dir.glob("spans-*.jsonl"):
            spans += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        roots = [s for s in spans if s["name"].endswith("strata.v1.Strata/Generate") and s["service"] == "tokenizer"]
        traced = [r for r in roots if r["trace_id"]]
        if traced:
            tid = traced[-1]["trace_id"]
            services = {s["service"] for s in spans if s["trace_id"] == tid}
            if {"tokenizer", "scheduler", "worker", "kvstore"} <= services:
                break
        time.sleep(0.2)
    # The scheduler asks the kvstore shards (L3) for the prompt's pages at admission.
    assert {"tokenizer", "scheduler", "worker", "kvstore"} <= services, services
    # Every scheduler Generate span hangs under an exported tokenizer span, also for requests that
    # ended early (a stop string cancels the scheduler's stream; earlier tests sent some).
    ids = {s["span_id"] for s in spans}
    generates = [s for s in spans if s["name"] == "/strata.scheduler.v1.Scheduler/Generate" and s["kind"] == "SERVER"]
    orphans = [s for s in generates if s["parent_id"] not in ids]
    assert len(generates) > 5 and not orphans, orphans[:2]


def test_a_session_serves_many_requests_and_refuses_a_reused_handle(stack: Stack) -> None:
    """Scheduler/Session over real gRPC: two requests on one stream both finish (their tokens come
    back under their handles); a submission reusing a running handle ends the session with
    INVALID_ARGUMENT (its events could not be told apart)."""
    sampling = _greedy(6, ignore_eos=True)

    def submit(handle: int, rid: str) -> spb.SessionRequest:
        req = spb.GenerateRequest(request_id=rid, input_ids=[5, 6, 7, handle], sampling=sampling)
        return spb.SessionRequest(submit=spb.SessionSubmit(handle=handle, request=req))

    with grpc.insecure_channel(stack.child("scheduler").address) as ch:
        session = sgrpc.SchedulerStub(ch)
        tokens: dict[int, int] = {}
        ends: dict[int, int] = {}
        call = session.Session(iter([submit(1, "sess-a"), submit(2, "sess-b")]))
        for msg in call:
            for h, n in zip(msg.handles, msg.counts, strict=True):
                tokens[h] = tokens.get(h, 0) + n
            ends.update((e.handle, e.finish_reason) for e in msg.ends)
        assert tokens == {1: 6, 2: 6} and ends == {1: pb.FINISH_REASON_LENGTH, 2: pb.FINISH_REASON_LENGTH}
        long = spb.GenerateRequest(request_id="sess-c", input_ids=[5, 6, 7], sampling=_greedy(200, ignore_eos=True))
        dup = [spb.SessionRequest(submit=spb.SessionSubmit(handle=3, request=long)), submit(3, "sess-d")]
        with pytest.raises(grpc.RpcError) as e:
            list(session.Session(iter(dup)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "handle" in (e.value.details() or "")
    load = _wait_idle(stack)  # the refused session's running request was aborted with it
    assert (load.running, load.waiting, load.used_slots) == (0, 0, 0)


def test_worker_killed_leaves_discovery_and_restart_is_used(stack: Stack, api: pgrpc.StrataStub) -> None:
    worker = stack.child("worker")
    assert worker.proc is not None

    async def members() -> set[str]:
        d = Discovery(stack.etcd_endpoint, "worker")
        await d.start()
        try:
            return {r.address for r in d.members().values()}
        finally:
            await d.stop()

    assert worker.address in asyncio.run(members())
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait()
    t0 = time.monotonic()
    while worker.address in asyncio.run(members()):
        assert time.monotonic() - t0 < 5.0 + 3.0, "worker still registered after its lease TTL"
        time.sleep(0.25)
    worker.log_path.write_text("")  # forget the old READY line
    worker.start(dict(os.environ, PYTHONUNBUFFERED="1"))
    worker.wait_ready(120)
    got = _collect(api.Generate(pb.GenerateRequest(text="hi", sampling=_greedy(3, ignore_eos=True))))[0]
    assert len(got) == 3


def test_constrained_generation_through_the_api(api: pgrpc.StrataStub, stack: Stack) -> None:
    words = r"[a-z]{1,3}( [a-z]{1,3}){5,9}"  # a repetitive prompt and short words: drafted under the grammar
    before = _spec_events(stack).get("verify_steps", 0.0)
    got = _collect(api.Generate(pb.GenerateRequest(text="ab cd ab cd e ab cd e", sampling=_greedy(48), regex=words)))
    assert re.fullmatch(words, got[1]), got[1]
    assert _spec_events(stack).get("verify_steps", 0.0) > before
    regex = r"(yes|no), [a-z]{2,5}\."
    sp = pb.SamplingParams(temperature=1.0, max_new_tokens=64, seed=5)
    for i in range(3):
        sp.seed = i
        _, text, last = _collect(api.Generate(pb.GenerateRequest(text="Answer:", sampling=sp, regex=regex)))
        assert last.finish_reason == pb.FINISH_REASON_STOP
        assert re.fullmatch(regex, text), text
    with pytest.raises(grpc.RpcError) as err:
        list(api.Generate(pb.GenerateRequest(text="x", sampling=sp, json_schema="{not json")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "constraint.json_schema" in err.value.details()


def _spec_events(stack: Stack) -> dict[str, float]:
    url = f"http://{stack.child('scheduler').extra['metrics']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        s.labels["event"]: s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == "strata_scheduler_spec_events"
        for s in fam.samples
        if s.name.endswith("_total")
    }


def test_looping_answers_are_drafted_and_still_equal_transformers(
    api: pgrpc.StrataStub, stack: Stack, tiny_qwen3: Path
) -> None:
    """Prompts that repeat a short phrase: the answers loop, prompt lookup drafts them, the worker
    keeps part of the drafts (the scheduler's metrics say so), and every answer equals transformers."""
    rng = random.Random(2)
    before = _spec_events(stack)
    for period in (1, 2, 4, 8):
        phrase = [rng.randrange(3, 700) for _ in range(period)]
        prompt = (phrase * 64)[:64]
        req = pb.GenerateRequest(input_ids=pb.TokenIds(ids=prompt), sampling=_greedy(32, ignore_eos=True))
        assert _collect(api.Generate(req))[0] == hf_greedy(tiny_qwen3, prompt, 32, stop_at_eos=False), period
    after = _spec_events(stack)
    grew = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("verify_steps", "draft_tokens", "accepted_tokens")}
    assert grew["verify_steps"] > 0 and 0 < grew["accepted_tokens"] < grew["draft_tokens"], grew
