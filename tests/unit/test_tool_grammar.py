"""Tool-call grammars (``tool_choice`` required / named) over seeded random schemas, compiled as the
scheduler compiles them: every masked decode is calls whose arguments validate, valid calls are
accepted and parse back to their values, invalid ones are refused."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kernels.bitmask import apply_token_bitmask
from services.common.errors import InvalidArgument
from services.scheduler.grammar import Constraint, GrammarService
from services.scheduler.tool_grammar import ToolSpec, tool_call_grammar, tool_calls_ebnf, tool_calls_key
from services.tokenizer.tool_parsers import ToolFormat, make_parser
from strata.scheduler.v1 import scheduler_pb2 as spb
from tests.tool_schemas import random_schema, random_value

FORMATS: tuple[ToolFormat, ...] = ("hermes", "qwen3_coder")
SCHEMAS = 24


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_qwen3))


@pytest.fixture(scope="module")
def service(tokenizer: PreTrainedTokenizerBase) -> GrammarService:
    return GrammarService(tokenizer, len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])


def schemas() -> list[dict[str, Any]]:
    rng = random.Random(2028)
    return [random_schema(rng) for _ in range(SCHEMAS)]


def parse(fmt: ToolFormat, text: str, tools: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    parser = make_parser(fmt, tools)
    content, calls = "", {}
    for out in (parser.feed(text), parser.finish()):
        content += out.content
        for d in out.calls:
            calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
    return content, [(n, a) for n, a in calls.values()]


def call_text(fmt: ToolFormat, name: str, args: dict[str, Any]) -> str:
    """A call as a model following the format writes it."""
    if fmt == "hermes":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'
    params = "\n".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}\n</function>\n</tool_call>"


def accepts(service: GrammarService, grammar: str, text: str, tokenizer: PreTrainedTokenizerBase) -> bool:
    matcher = service.compile_blocking(Constraint("ebnf", grammar)).matcher()
    for tok in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept(tok):
            return False
    return matcher.is_completed()


def masked_decode(service: GrammarService, grammar: str, seed: int, max_steps: int = 800) -> list[int]:
    """Argmax over seeded random logits under the grammar's masks, up to the stop token."""
    matcher = service.compile_blocking(Constraint("ebnf", grammar)).matcher()
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, service.vocab_size, generator=gen)
        mask = torch.frombuffer(bytearray(matcher.bitmask()), dtype=torch.int32).view(1, -1)
        apply_token_bitmask(logits, mask)
        tok = int(logits.argmax())
        assert matcher.accept(tok)
        if matcher.is_terminated():
            return ids
        ids.append(tok)
    raise AssertionError(f"seed {seed}: no end after {max_steps} tokens")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_constrained_answer_is_calls_that_validate(
    fmt: ToolFormat, service: GrammarService, tokenizer: PreTrainedTokenizerBase
) -> None:
    for i, schema in enumerate(schemas()):
        tools = [ToolSpec(f"tool_{i}", json.dumps(schema)), ToolSpec("other", "")]
        grammar = tool_call_grammar(tools, fmt, only="" if i % 2 else f"tool_{i}", parallel=i % 3 == 0)
        text = tokenizer.decode(masked_decode(service, grammar, seed=i))
        content, calls = parse(fmt, text, {f"tool_{i}": schema, "other": {}})
        assert content == "" and calls, text
        for name, args in calls:
            jsonschema.validate(json.loads(args), schema if name == f"tool_{i}" else {"const": {}})
        if i % 3:
            assert len(calls) == 1, text


@pytest.mark.parametrize("fmt", FORMATS)
def test_valid_calls_are_accepted_and_parse_back_invalid_refused(
    fmt: ToolFormat, service: GrammarService, tokenizer: PreTrainedTokenizerBase
) -> None:
    rng = random.Random(7)
    for i, schema in enumerate(schemas()):
        grammar = tool_call_grammar([ToolSpec("f", json.dumps(schema))], fmt)
        value = random_value(schema, rng)
        text = call_text(fmt, "f", value)
        assert accepts(service, grammar, text, tokenizer), (schema, text)
        _, calls = parse(fmt, text, {"f": schema})
        assert [(n, json.loads(a)) for n, a in calls] == [("f", value)]
        extra = {**value, "unexpected": 1}  # no other properties are allowed
        assert not accepts(service, grammar, call_text(fmt, "f", extra), tokenizer), i
        if fmt == "hermes" and schema.get("required"):
            missing = {k: v for k, v in value.items() if k != schema["required"][0]}
            assert not accepts(service, grammar, call_text(fmt, "f", missing), tokenizer), i


def test_shapes_of_required_named_and_reasoning(service: GrammarService, tokenizer: PreTrainedTokenizerBase) -> None:
    tools = [ToolSpec("a", ""), ToolSpec("b", json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}}))]
    a, b = call_text("hermes", "a", {}), call_text("hermes", "b", {"x": 1})
    required, single = tool_call_grammar(tools, "hermes"), tool_call_grammar(tools, "hermes", parallel=False)
    named = tool_call_grammar(tools, "hermes", only="b")
    thinking = tool_call_grammar(tools, "hermes", reasoning="optional")
    opened = tool_call_grammar(tools, "hermes", reasoning="open")
    cases = [
        (required, a, True), (required, f"{a}\n{b}", True), (required, "hello", False), (required, "", False),
        (single, b, True), (single, f"{a}\n{b}", False),
        (named, b, True), (named, a, False),
        (thinking, b, True), (thinking, f"<think>\nhm\n</think>\n\n{b}", True), (thinking, "<think>\nhm", False),
        (opened, f"hm\n</think>\n\n{b}", True), (opened, b, False),
    ]  # fmt: skip
    for grammar, text, ok in cases:
        assert accepts(service, grammar, text, tokenizer) == ok, text


def test_bad_tools_name_the_field() -> None:
    good = ToolSpec("good", json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))
    bad = ToolSpec("bad", json.dumps({"type": "object", "properties": {"a": {"type": "no-such-type"}}}))
    with pytest.raises(InvalidArgument, match=r"^input\.messages\.tools\[1\]\.parameters: .*no-such-type"):
        tool_call_grammar([good, bad], "hermes")
    with pytest.raises(InvalidArgument, match=r"^constraint\.tool_calls\.name: 'nope'"):
        tool_call_grammar([good], "hermes", only="nope")
    with pytest.raises(InvalidArgument, match="at least one tool"):
        tool_call_grammar([], "qwen3_coder")


def test_the_tokenizers_tool_calls_constraint_builds_the_same_grammar(
    service: GrammarService, tokenizer: PreTrainedTokenizerBase
) -> None:
    """What the tokenizer sends (``ToolCalls``) compiles to the grammar of the same tools, and its
    bad fields are refused naming them."""
    params = json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}})
    tools = [ToolSpec("a", ""), ToolSpec("b", params)]
    calls = spb.ToolCalls(tools=[spb.ToolCalls.Tool(name=t.name, parameters=t.parameters) for t in tools],
                          format="qwen3_coder", name="b", parallel=False, reasoning="optional")  # fmt: skip
    key = tool_calls_key(calls)
    assert tool_calls_ebnf(key) == tool_call_grammar(tools, "qwen3_coder", "b", False, "optional")
    assert tool_calls_key(spb.ToolCalls(tools=calls.tools, format="hermes")) != key
    for name, args, ok in (("b", {"x": 3}, True), ("a", {}, False)):  # compiled as a kind of its own
        matcher = service.compile_blocking(Constraint("tool_calls", key)).matcher()
        ids = tokenizer.encode(call_text("qwen3_coder", name, args), add_special_tokens=False)
        assert (all(matcher.accept(t) for t in ids) and matcher.is_completed()) == ok, name
    with pytest.raises(InvalidArgument, match=r"^constraint\.tool_calls\.format: 'json'"):
        tool_calls_key(spb.ToolCalls(tools=calls.tools, format="json"))
    with pytest.raises(InvalidArgument, match=r"^constraint\.tool_calls\.reasoning: 'maybe'"):
        tool_calls_key(spb.ToolCalls(tools=calls.tools, format="hermes", reasoning="maybe"))
    with pytest.raises(InvalidArgument, match="at least one tool"):
        tool_calls_ebnf(tool_calls_key(spb.ToolCalls(format="hermes")))
