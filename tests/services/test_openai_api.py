"""The OpenAI-compatible HTTP API, end to end: real etcd and the four services as processes, the
official ``openai`` client (and raw HTTP for what the client hides).

Greedy output through ``/v1/chat/completions`` and ``/v1/completions`` must equal transformers'
``generate`` on the same checkpoint; ``cached_tokens`` is the honest count (above 0 on a repeated
long prompt, 0 across salts); a JSON schema constrains the output; every bad parameter is a 400
naming it; a client that goes away frees its request; API keys guard HTTP and gRPC alike; a
scheduler that sheds load answers 429 and a stack without a worker 503.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from services.common.etcd_proc import free_port
from services.supervisor import Stack, start_stack
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc
from tests.engine.test_structured import SCHEMA
from tests.openai_stack import KEY, MODEL
from tests.openai_stack import http as _http
from tests.reference import hf_greedy, hf_tokenizer

LONG = " ".join(f"page {i} of the shared system prompt keeps its cache warm." for i in range(40))


# The stack is tests/openai_stack.py's, shared with test_openai_tools.py.
@pytest.fixture(scope="module")
def stack(openai_stack: Stack) -> Stack:
    return openai_stack


@pytest.fixture(scope="module")
def base(openai_base: str) -> str:
    return openai_base


@pytest.fixture(scope="module")
def client(openai_client: openai.OpenAI) -> openai.OpenAI:
    return openai_client


def _load(stack: Stack) -> spb.Load:
    with grpc.insecure_channel(stack.child("scheduler").address) as ch:
        return sgrpc.SchedulerStub(ch).GetLoad(spb.GetLoadRequest(), timeout=10)


def test_chat_greedy_matches_transformers(client: openai.OpenAI, tiny_qwen3: Path) -> None:
    tok = hf_tokenizer(str(tiny_qwen3))
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a cache."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = hf_greedy(tiny_qwen3, ids, 20)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)  # type: ignore[arg-type]
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    assert r.usage.total_tokens == len(ids) + len(want)

    streamed = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(want)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_completions_greedy_text_and_ids(client: openai.OpenAI, tiny_qwen3: Path, stream: bool) -> None:
    tok = hf_tokenizer(str(tiny_qwen3))
    prompts = ["The cache keeps", "Once upon a time the server"]
    wants = [hf_greedy(tiny_qwen3, tok.encode(p, add_special_tokens=False), 16) for p in prompts]
    if stream:
        got = ["", ""]
        # A request id with "%" in it: the streamed chunks are formatted from a prefix holding it.
        for c in client.completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0, stream=True,
                                           extra_headers={"x-request-id": "pct-%s-%d"}):  # fmt: skip
            got[c.choices[0].index] += c.choices[0].text
            assert c.id == "cmpl-pct-%s-%d"
    else:
        r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0)
        assert [c.index for c in r.choices] == [0, 1]
        got = [c.text for c in r.choices]
        assert r.usage is not None and r.usage.completion_tokens == sum(len(w) for w in wants)
    assert got == [tok.decode(w, skip_special_tokens=True) for w in wants]
    # token ids as the prompt
    ids = tok.encode(prompts[0], add_special_tokens=False)
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
    assert r2.choices[0].text == got[0]


def test_logprobs_n_and_seed(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy: the top token
    c = client.completions.create(model=MODEL, prompt="tokens and", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and len(lp.tokens) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # keyed by text, as OpenAI's legacy format is: two ids that decode alike share a key
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(logprob, abs=1e-5)
    kw: dict[str, Any] = {"model": MODEL, "prompt": "The page", "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 7}
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]  # seeded: reproducible
    assert len({x.text for x in a.choices}) > 1  # seed + j per choice: not three copies


def test_cached_tokens_are_honest_and_salted(client: openai.OpenAI) -> None:
    def cached(salt: str) -> tuple[int, int]:
        r = client.completions.create(
            model=MODEL, prompt=LONG, max_tokens=2, temperature=0, extra_body={"cache_salt": salt}
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0

    n, first = cached("tenant-a")
    assert first == 0 and n > 256
    _, again = cached("tenant-a")
    assert n - 64 <= again < n  # all whole pages of the prompt (the last token is always computed)
    _, other = cached("tenant-b")
    assert other == 0  # another salt never sees tenant-a's pages


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    for fmt in (
        {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}},
        {"type": "json_object"},
    ):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "describe a cache"}],
            max_tokens=600,
            temperature=0,
            response_format=fmt,  # type: ignore[arg-type]
        )
        text = r.choices[0].message.content or ""
        if fmt["type"] == "json_schema":
            assert r.choices[0].finish_reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMA)
        else:  # any object: a random model may not close an open-ended one within the budget
            assert text.lstrip().startswith("{"), text
            if r.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(text), dict)
    r = client.completions.create(
        model=MODEL, prompt="A number:", max_tokens=8, temperature=0, extra_body={"regex": "[0-9]{3}"}
    )
    assert len(r.choices[0].text) == 3 and r.choices[0].text.isdigit()


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize(
    ("endpoint", "change", "param"),
    [
        ("chat", {"temperature": -1}, "temperature"),
        ("chat", {"top_p": 1.5}, "top_p"),
        ("chat", {"max_tokens": 0}, "max_tokens"),
        ("chat", {"max_tokens": 10**6}, "max_tokens"),
        ("chat", {"n": 0}, "n"),
        ("chat", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"presence_penalty": 3}, "presence_penalty"),
        ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
        ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
        ("chat", {"min_p": 2}, "min_p"),
        ("chat", {"top_k": -5}, "top_k"),
        ("chat", {"seed": -1}, "seed"),
        ("chat", {"stop": ["x"] * 20}, "stop"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ("chat", {"response_format": {"type": "yaml"}}, "response_format"),
        ("chat", {"regex": "("}, "regex"),
        ("chat", {"ebnf": "root ::= missing"}, "ebnf"),
        ("chat", {"logit_bias": {"1": 5}}, "logit_bias"),
        ("chat", {"tools": [{"type": "retrieval"}]}, "tools"),
        ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("chat", {"cache_salt": "s" * 300}, "cache_salt"),
        ("chat", {"model": None}, "model"),
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"prompt": [10**7]}, "prompt"),
        ("completions", {"prompt": "x" * 20000}, "prompt"),
        ("completions", {"logprobs": 50}, "logprobs"),
        ("completions", {"echo": True, "logprobs": 21}, "logprobs"),
        ("completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo or prompt_logprobs
        ("chat", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("completions", {"max_tokens": -2}, "max_tokens"),
    ],
)
def test_bad_parameter_is_400_naming_it(base: str, endpoint: str, change: dict[str, Any], param: str) -> None:
    body = dict(CHAT if endpoint == "chat" else COMPLETION)
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    for stream in (False, True):
        status, reply = _http(
            f"{base}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}",
            {**body, "stream": stream} if "stream_options" not in change else body,
        )
        assert status == 400, reply
        err = reply["error"]
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param, err
        assert err["message"].startswith(param), err


def test_malformed_bodies_and_unknown_model(base: str, client: openai.OpenAI) -> None:
    status, reply = _http(f"{base}/v1/chat/completions", b"{not json")
    assert status == 400 and "JSON" in reply["error"]["message"]
    status, reply = _http(f"{base}/v1/chat/completions", b"[1, 2]")
    assert status == 400
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found" and "gpt-4" in str(e.value)
    # the server keeps serving
    r = client.completions.create(model=MODEL, prompt="still", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_api_keys_on_http_and_grpc(base: str, stack: Stack) -> None:
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for key in (None, "wrong"):  # the client refuses to send no key: raw HTTP for that
        status, reply = _http(f"{base}/v1/completions", COMPLETION, key=key)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    assert _http(f"{base}/v1/models", key="other-key")[0] == 200  # every configured key works
    models = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert _http(f"{base}/health", key=None) == (200, {"status": "ok"})  # probes carry no key
    status, text = _http(f"{base}/metrics", key=None)
    assert status == 200 and "tokenizer_requests_total" in text
    req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=2))
    with grpc.insecure_channel(stack.child("tokenizer").address) as ch:
        api = pgrpc.StrataStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(api.Generate(req))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(api.Generate(req, metadata=(("authorization", "Bearer nope"),)))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        out = list(api.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),)))
        assert out[-1].usage.completion_tokens == 2


def _wait_idle(stack: Stack, within_s: float) -> spb.Load:
    deadline = time.monotonic() + within_s
    while True:
        load = _load(stack)
        if (load.running, load.waiting, load.used_slots) == (0, 0, 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.1)


def test_client_disconnect_frees_the_request(client: openai.OpenAI, base: str, stack: Stack) -> None:
    body = {
        "model": MODEL,
        "prompt": "a long story",
        "max_tokens": 1500,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    stream = client.completions.create(**body, stream=True)
    for got, _ in enumerate(stream, 1):
        if got == 3:
            break
    assert _load(stack).running == 1
    stream.close()
    load = _wait_idle(stack, 5.0)
    assert (load.running, load.used_slots) == (0, 0), load

    # A non-streaming request whose client times out is cancelled too.
    impatient = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(**body)
    load = _wait_idle(stack, 5.0)
    assert (load.running, load.used_slots) == (0, 0), load


def test_shedding_is_429_and_no_worker_is_503(tiny_qwen3: Path, tmp_path: Path) -> None:
    s = start_stack(
        tiny_qwen3,
        free_port(),
        tmp_path,
        http_port=free_port(),
        say=lambda _: None,
        scheduler_args=("--max-waiting", "1", "--max-running", "1", "--worker-wait-s", "1"), grammar_preload=False,
    )
    try:
        c = openai.AsyncOpenAI(base_url=f"http://{s.child('tokenizer').extra['http']}/v1", api_key="x", max_retries=0)

        async def burst() -> list[BaseException | Any]:
            calls = [
                c.completions.create(model=MODEL, prompt=f"burst {i}", max_tokens=64, extra_body={"ignore_eos": True})
                for i in range(8)
            ]
            return await asyncio.gather(*(asyncio.wait_for(x, 60) for x in calls), return_exceptions=True)

        results = asyncio.run(burst())
        shed = [r for r in results if isinstance(r, openai.RateLimitError)]
        served = [r for r in results if not isinstance(r, BaseException)]
        assert shed and served, results
        assert len(shed) + len(served) == 8, results
        assert "max_waiting" in str(shed[0])
        s.child("worker").stop()
        base = f"http://{s.child('tokenizer').extra['http']}"
        deadline = time.monotonic() + 15
        while _http(f"{base}/health", key=None)[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _http(f"{base}/health", key=None)[0] == 503
        status, reply = _http(f"{base}/v1/completions", COMPLETION, key=None)
        assert status == 503 and reply["error"]["type"] == "service_unavailable_error", reply
    finally:
        s.stop()
