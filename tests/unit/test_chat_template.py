"""The tiny checkpoints' Qwen3-shaped chat template, and the conversation the tokenizer service gives
it (``services/tokenizer/chat.py``): tools, calls, tool results, reasoning, template variables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.common.errors import InvalidArgument
from services.tokenizer.chat import chat_inputs, render
from strata.v1 import strata_pb2 as pb

WEATHER = pb.Tool(name="get_weather", description="Weather.",
                  parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_qwen3))


def conversation() -> pb.ChatMessages:
    chat = pb.ChatMessages(tools=[WEATHER])
    chat.messages.add(role="system", content="Be brief.")
    chat.messages.add(role="user", content="Weather in Paris and Lyon?")
    call = chat.messages.add(role="assistant", content="", reasoning_content="\nTwo cities.\n")
    call.tool_calls.add(id="c1", name="get_weather", arguments='{"city": "Paris"}')
    call.tool_calls.add(id="c2", name="get_weather", arguments="not json")
    chat.messages.add(role="tool", tool_call_id="c1", content="sunny")
    chat.messages.add(role="tool", tool_call_id="c2", content="rain")
    return chat


def test_plain_chat_is_chatml(tokenizer: PreTrainedTokenizerBase) -> None:
    chat = pb.ChatMessages()
    chat.messages.add(role="system", content="Be brief.")
    chat.messages.add(role="user", content="Hi")
    assert render(tokenizer, chat_inputs(chat)) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_calls_results_and_reasoning(tokenizer: PreTrainedTokenizerBase) -> None:
    text = render(tokenizer, chat_inputs(conversation()))
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    tool = '{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": '
    assert tool in system
    assert rest.endswith(
        "<|im_start|>assistant\n<think>\nTwo cities.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": not json}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_thinking_off_and_old_reasoning_dropped(tokenizer: PreTrainedTokenizerBase) -> None:
    chat = conversation()
    chat.messages.add(role="user", content="Thanks. And tomorrow?")
    chat.chat_template_kwargs = '{"enable_thinking": false}'
    text = render(tokenizer, chat_inputs(chat))
    assert "Two cities" not in text  # reasoning of turns before the last user message is not kept
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda c: c.tools.add(name="get_weather"), "input.messages.tools[1].name"),
        (lambda c: c.tools.add(name="has space"), "input.messages.tools[1].name"),
        (lambda c: c.tools.add(name="t", parameters="{"), "input.messages.tools[1].parameters"),
        (lambda c: c.tools.add(name="t", parameters='{"type": "array"}'), "input.messages.tools[1].parameters"),
        (lambda c: setattr(c, "chat_template_kwargs", "[1]"), "input.messages.chat_template_kwargs"),
        (lambda c: setattr(c, "chat_template_kwargs", '{"tools": []}'), "input.messages.chat_template_kwargs"),
        (lambda c: c.messages[1].tool_calls.add(name="f"), "input.messages[1].tool_calls"),
        (lambda c: c.messages[2].tool_calls.add(name="f f"), "input.messages[2].tool_calls[2].name"),
        (lambda c: setattr(c.messages[0], "role", "robot"), "input.messages[0].role"),
    ],
)
def test_bad_conversations_name_the_field(change: object, field: str) -> None:
    chat = conversation()
    change(chat)  # type: ignore[operator]
    with pytest.raises(InvalidArgument) as e:
        chat_inputs(chat)
    assert str(e.value).startswith(field + ":"), e.value


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
JSON_TEXT = st.one_of(TEXT, st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3), max_leaves=6,
).map(json.dumps))  # fmt: skip


@st.composite
def conversations(draw: st.DrawFn) -> pb.ChatMessages:
    chat = pb.ChatMessages(chat_template_kwargs=draw(st.one_of(st.just(""), JSON_TEXT)))
    for _ in range(draw(st.integers(0, 4))):
        role = draw(st.sampled_from(["system", "user", "assistant", "tool", "x"]))
        m = chat.messages.add(role=role, content=draw(TEXT))
        m.reasoning_content, m.tool_call_id = draw(TEXT), draw(TEXT)
        for _ in range(draw(st.integers(0, 2))):
            m.tool_calls.add(id=draw(TEXT), name=draw(st.sampled_from(["f", "g h", ""])), arguments=draw(JSON_TEXT))
    for _ in range(draw(st.integers(0, 2))):
        chat.tools.add(name=draw(st.sampled_from(["f", "g", "-"])), description=draw(TEXT), parameters=draw(JSON_TEXT))
    return chat


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=conversations())
def test_any_conversation_renders_or_is_invalid_argument(
    tokenizer: PreTrainedTokenizerBase, chat: pb.ChatMessages
) -> None:
    try:
        inputs = chat_inputs(chat)
    except InvalidArgument as e:
        assert str(e).startswith("input.messages"), e
        return
    try:
        text = render(tokenizer, inputs)
    except InvalidArgument as e:
        assert str(e).startswith("input.messages: the chat template refused"), e
        return
    assert text.endswith("<|im_start|>assistant\n") or "enable_thinking" in chat.chat_template_kwargs
