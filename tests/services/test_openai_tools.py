"""What agents and evaluators send, end to end with the official ``openai`` client: tool calls
(non-streamed, streamed, a whole agent loop), ``tool_choice`` required / named under a grammar
built from the tools' schemas, the reasoning split, ``/tokenize`` and ``/detokenize``, and every bad
tool parameter answered 400 naming it.

A random-weight model writes no tool call of its own accord, so where the answer's shape must be
guaranteed the tests use a grammar: ``tool_choice`` required (whose grammar is under test) or a
``regex``. The stack is shared with test_openai_api.py (``tests/openai_stack.py``: hermes calls,
qwen3 reasoning).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from services.supervisor import Stack
from services.tokenizer.tool_parsers import make_parser
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc
from tests.openai_stack import KEY, MODEL, http
from tests.reference import hf_tokenizer
from tests.tool_schemas import random_schema

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}}) for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _check_calls(calls: list[Any]) -> list[tuple[str, str]]:
    """Every call well formed, its arguments valid against its tool's schema; (name, arguments)."""
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_"), c
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        out.append((c.function.name, c.function.arguments))
    return out


def _join_stream(chunks: list[Any]) -> tuple[dict[int, dict[str, Any]], str | None, str]:
    """Streamed tool-call deltas joined by index (as the OpenAI SDK's helpers do), the finish
    reason and the content."""
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": "", "deltas": 0})
                call["deltas"] += 1
                if d.id is not None:
                    assert call["id"] is None and call["deltas"] == 1, "id and name come first, once"
                    assert d.function is not None and d.function.name and d.type == "function"
                    call["id"], call["name"] = d.id, d.function.name
                elif d.function is not None:
                    assert d.function.name is None
                call["arguments"] += (d.function.arguments or "") if d.function is not None else ""
    return calls, finish, content


def test_required_tool_calls_streamed_join_to_the_same_calls(openai_client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                          "max_tokens": 300, "temperature": 0, "extra_body": NO_THINKING}  # fmt: skip
    r = openai_client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    whole = _check_calls(list(choice.message.tool_calls))

    chunks = list(openai_client.chat.completions.create(**kw, stream=True))
    calls, finish, content = _join_stream(chunks)
    assert finish == "tool_calls" and content == ""
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == whole
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_named_tool_and_no_parallel_calls(openai_client: openai.OpenAI) -> None:
    for choice_, parallel, name in (
        ({"type": "function", "function": {"name": "get_time"}}, True, "get_time"),
        ({"type": "function", "function": {"name": "get_weather"}}, True, "get_weather"),
        ("required", False, None),
    ):
        r = openai_client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice_, parallel_tool_calls=parallel,  # type: ignore[arg-type]
            max_tokens=200, temperature=0, extra_body=NO_THINKING,
        )  # fmt: skip
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls is not None and len(calls) == 1, r
        got = _check_calls(list(calls))
        assert name is None or got[0][0] == name


def test_agent_loop_call_result_answer(openai_client: openai.OpenAI, openai_base: str) -> None:
    """Call a tool, send its result back, get an answer: the conversation renders through the
    template (the call and its result are in the next prompt, which reuses the first one's KV)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a weather bot."}, *ASK]
    first = openai_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=200,  # type: ignore[arg-type]
        temperature=0, extra_body=NO_THINKING,
    )  # fmt: skip
    message = first.choices[0].message
    assert message.tool_calls
    messages.append(message.model_dump(exclude_none=True))  # as agent frameworks send it back
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"Sunny, 21 degrees ({call.id[-4:]})"})
    second = openai_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=24, temperature=0,  # type: ignore[arg-type]
        extra_body=NO_THINKING,
    )  # fmt: skip
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage is not None and first.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) > 0  # type: ignore[union-attr]

    body = {"model": MODEL, "messages": messages, "tools": TOOLS, **NO_THINKING}
    status, tokens = http(f"{openai_base}/tokenize", body)
    assert status == 200, tokens
    status, prompt = http(f"{openai_base}/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    text = prompt["prompt"]
    call = message.tool_calls[0]
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": ' in text
    assert f"<tool_response>\nSunny, 21 degrees ({call.id[-4:]})\n</tool_response>" in text
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # the tools are in the system turn
    assert tokens["count"] == second.usage.prompt_tokens


def test_required_over_random_schemas_always_validates(openai_base: str) -> None:
    """Seeded random schemas, sampled answers: every answer is calls whose arguments validate."""
    rng = random.Random(28)
    schemas = [random_schema(rng) for _ in range(20)]
    client = openai.AsyncOpenAI(base_url=f"{openai_base}/v1", api_key=KEY, max_retries=0, timeout=120)

    async def one(i: int, schema: dict[str, Any]) -> Any:
        tool = {"type": "function", "function": {"name": f"tool_{i}", "parameters": schema}}
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Call tool_{i}."}], tools=[tool],  # type: ignore[list-item]
            tool_choice="required", max_tokens=400, temperature=1.0, seed=i, extra_body=NO_THINKING,
        )  # fmt: skip

    async def run() -> list[Any]:
        return await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))

    t0 = time.monotonic()
    replies = asyncio.run(run())
    for i, (schema, r) in enumerate(zip(schemas, replies, strict=True)):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (schema, choice)
        for call in choice.message.tool_calls:
            assert call.function.name == f"tool_{i}"
            jsonschema.validate(json.loads(call.function.arguments), schema)
    assert time.monotonic() - t0 < 60


def test_grpc_clients_send_tools_and_get_constrained_calls(openai_stack: Stack) -> None:
    """The same conversation and tool_choice on gRPC: the answer is the calls' text."""
    req = pb.GenerateRequest(
        sampling=pb.SamplingParams(temperature=0, max_new_tokens=200),
        tool_calls=pb.ToolCallConstraint(name="get_weather"),
    )
    req.messages.messages.add(role="user", content=ASK[0]["content"])
    req.messages.tools.add(name="get_weather", parameters=json.dumps(SCHEMAS["get_weather"]))
    req.messages.chat_template_kwargs = json.dumps(NO_THINKING["chat_template_kwargs"])
    with grpc.insecure_channel(openai_stack.child("tokenizer").address) as ch:
        api = pgrpc.StrataStub(ch)
        out = list(api.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),)))
        req.tool_calls.name = "nope"
        with pytest.raises(grpc.RpcError) as e:
            list(api.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint.tool_calls.name" in str(e.value.details())
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP
    parser = make_parser("hermes", SCHEMAS)
    parsed = [parser.feed(out[-1].text), parser.finish()]
    calls = [d for p in parsed for d in p.calls]
    assert "".join(p.content for p in parsed) == "" and calls[0].name == "get_weather"
    jsonschema.validate(json.loads("".join(d.arguments for d in calls)), SCHEMAS["get_weather"])


def test_reasoning_split_streamed_and_whole(openai_client: openai.OpenAI) -> None:
    """A regex makes the model think first; the answer splits at </think>, streamed or not."""
    regex = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){0,3}\n</think>\n\n[A-Z][a-z]{2,8}( [a-z]{2,8}){0,3}\."
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 80, "temperature": 0,
                          "extra_body": {"regex": regex}}  # fmt: skip
    r = openai_client.chat.completions.create(**kw)
    message: Any = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert message.reasoning_content and message.content
    assert "<think>" not in message.content and "</think>" not in message.content
    assert message.content[0].isupper() and message.content.endswith(".")
    assert message.reasoning_content.strip() == message.reasoning_content and " " not in message.reasoning_content[:1]

    chunks = list(openai_client.chat.completions.create(**kw, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == (message.reasoning_content, message.content)

    plain = openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    assert getattr(plain.choices[0].message, "reasoning_content", "missing") is None  # the key is always there


def test_the_tokenizer_process_runs_without_torch(openai_client: openai.OpenAI, openai_stack: Stack) -> None:
    """Its tool-call grammars are the scheduler's to build: after one, the tokenizer still has no
    torch loaded (services/tokenizer/torchless.py), the scheduler does."""
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[CLOCK], tool_choice="required", max_tokens=60, extra_body=NO_THINKING
    )
    assert reply.choices[0].message.tool_calls
    maps = {name: Path(f"/proc/{openai_stack.child(name).proc.pid}/maps").read_text()
            for name in ("tokenizer", "scheduler")}  # fmt: skip
    assert "libtorch" not in maps["tokenizer"] and "libtorch" in maps["scheduler"]


def test_tokenize_detokenize_and_models(openai_base: str, tiny_qwen3: Path) -> None:
    tok = hf_tokenizer(str(tiny_qwen3))
    text = "The quick river, said Alice: été <|im_end|> 42!"
    status, out = http(f"{openai_base}/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert status == 200, out
    assert out["tokens"] == tok.encode(text, add_special_tokens=True)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 2048
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    status, back = http(f"{openai_base}/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert (status, back) == (200, {"prompt": text})

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for kwargs in ({}, {"enable_thinking": False}):
        want = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs)
        body = {"messages": messages, "tools": TOOLS, "chat_template_kwargs": kwargs}
        status, out = http(f"{openai_base}/tokenize", body)
        assert status == 200 and out["tokens"] == tok.encode(want, add_special_tokens=False), out
        assert out["token_strs"] is None
    assert want.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    status, out = http(f"{openai_base}/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert tok.decode(out["tokens"]).endswith("Hi<|im_end|>\n")

    status, models = http(f"{openai_base}/v1/models")
    assert status == 200 and models["data"][0]["max_model_len"] == 2048
    assert http(f"{openai_base}/tokenize", {"prompt": "x"}, key=None)[0] == 401  # behind the API keys too


CHAT = {"model": MODEL, "messages": ASK, "max_tokens": 4}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("chat", {"tools": [{"type": "function"}]}, "tools"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ("chat", {"tools": [CLOCK, CLOCK]}, "tools"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
                  "tool_choice": "required"}, "tools"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ("chat", {"parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
        ("chat", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ("chat", {"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
        ("chat", {"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
        ("tokenize", {}, "prompt"),
        ("tokenize", {"prompt": "x", "messages": ASK}, "prompt"),
        ("tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
        ("detokenize", {"tokens": [10**6]}, "tokens"),
        ("detokenize", {"tokens": [-1]}, "tokens"),
        ("detokenize", {"tokens": "abc"}, "tokens"),
    ],
)  # fmt: skip
def test_bad_tool_parameters_are_400_naming_them(
    openai_base: str, path: str, change: dict[str, Any], param: str
) -> None:
    url = f"{openai_base}/v1/chat/completions" if path == "chat" else f"{openai_base}/{path}"
    body = {**CHAT, **change} if path == "chat" else change
    for stream in (False, True) if path == "chat" else (False,):
        status, reply = http(url, {**body, "stream": stream} if path == "chat" else body)
        err = reply["error"]
        if param == "model":
            assert status == 404 and err["param"] == "model", reply
            continue
        assert status == 400, reply
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param, err
        assert err["message"].startswith(param), err
