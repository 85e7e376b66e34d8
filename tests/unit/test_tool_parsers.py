"""Tool-call and reasoning parsers on crafted answers: what they find, and that any split of the
text into streamed pieces joins to exactly the whole answer's result."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from services.tokenizer.chat_output import ChatMessageBuilder, ChatOutput
from services.tokenizer.reasoning import ReasoningParser, prompt_closes_reasoning, prompt_opens_reasoning
from services.tokenizer.tool_parsers import ToolFormat, make_parser

SCHEMAS: dict[str, Any] = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"},
        "hot": {"type": "boolean"}, "tags": {"type": "array"}, "at": {"type": ["number", "null"]},
    }},
}  # fmt: skip

HERMES = {
    # text, then a call with nested braces and a brace inside a string, then one with no arguments
    'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "n": [1, {"a": 2}]}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n</tool_call>': (
        "Let me check.",
        [("get_weather", '{"city": "Pa}ris", "n": [1, {"a": 2}]}'), ("get_time", "{}")],
    ),
    # keys in the other order: read when the block closes, arguments re-serialized
    '<tool_call>\n{"arguments": {"x": 1}, "name": "rev"}\n</tool_call>': ("", [("rev", '{"x": 1}')]),
    '<tool_call>{"name": "esc\\"q", "arguments": {"s": "a\\"}b"}}</tool_call>': ("", [('esc"q', '{"s": "a\\"}b"}')]),
    '<tool_call>\n{"name": "num", "arguments": 42}\n</tool_call>': ("", [("num", "42")]),
    # not calls: left in the content as written
    "no calls here <tool_ but text\n": ("no calls here <tool_ but text\n", []),
    "<tool_call>\nnot json\n</tool_call> after": ("<tool_call>\nnot json\n</tool_call> after", []),
    "plain text only\n\n": ("plain text only\n\n", []),
    # cut by max_tokens inside the arguments: what arrived
    '<tool_call>\n{"name": "cut", "arguments": {"city": "Par': ("", [("cut", '{"city": "Par')]),
}

# fmt: off
CODER = {
    "I will call.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n<parameter=hot>\ntrue\n</parameter>\n"
    '<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=at>\nnull\n</parameter>\n'
    "<parameter=extra>\n{not json\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call>": (
        "I will call.",
        [
            ("get_weather", '{"city": "Paris", "days": 3, "zip": "75001", "hot": true, "tags": ["a", "b"], '
                            '"at": null, "extra": "{not json"}'),
            ("get_time", "{}"),
        ],
    ),
    "<function=bare>\n<parameter=x>\n12\n</parameter>\n</function>": ("", [("bare", '{"x": 12}')]),
    "<tool_call>\nnot a call\n</tool_call>": ("<tool_call>\nnot a call\n</tool_call>", []),
    "<tool_call>\n<function=cut>\n<parameter=city>\nPar": ("", [("cut", "{}")]),
}
# fmt: on


def run(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Content, calls (name, arguments) and call ids of ``pieces`` fed in order."""
    parser = make_parser(fmt, SCHEMAS)
    content, calls = "", {}
    for out in [*(parser.feed(p) for p in pieces), parser.finish()]:
        content += out.content
        for d in out.calls:
            if d.name is not None:
                assert d.index not in calls and d.id is not None and d.id.startswith("call_")
                calls[d.index] = [d.name, "", d.id]
            else:
                assert d.id is None and d.index in calls
            calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [(calls[i][0], calls[i][1]) for i in sorted(calls)], [calls[i][2] for i in sorted(calls)]


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def test_hermes_and_coder_answers_parse_as_written() -> None:
    for fmt, cases in (("hermes", HERMES), ("qwen3_coder", CODER)):
        for text, (content, calls) in cases.items():
            got = run(fmt, [text])  # type: ignore[arg-type]
            assert got[:2] == (content, calls), (fmt, text)
            for _, args in calls:
                if "cut" not in text and "not" not in text:
                    json.loads(args)


@settings(max_examples=150, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=40), which=st.integers(0, 1_000))
def test_any_streamed_split_joins_to_the_whole_answer(cuts: list[int], which: int) -> None:
    cases = [("hermes", t) for t in HERMES] + [("qwen3_coder", t) for t in CODER]
    fmt, text = cases[which % len(cases)]
    assert run(fmt, split(text, cuts))[:2] == run(fmt, [text])[:2]  # type: ignore[arg-type]


REASONING = {
    "<think>\nI reason.\n</think>\n\nAnswer here.": ("I reason.", "Answer here."),
    "  <think>x</think>y": ("x", "y"),
    "plain <think> text": ("", "plain <think> text"),
    "<thi": ("", "<thi"),
    "<think>\n cut while thinking  ": ("cut while thinking", ""),
    "\n\nhello": ("", "\n\nhello"),
    "": ("", ""),
}


def run_reasoning(pieces: list[str], opened: bool = False) -> tuple[str, str]:
    parser = ReasoningParser(opened)
    outs = [*(parser.feed(p) for p in pieces), parser.finish()]
    return "".join(o.reasoning for o in outs), "".join(o.content for o in outs)


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=1_000), max_size=20))
def test_reasoning_split_whole_and_streamed(cuts: list[int]) -> None:
    for text, want in REASONING.items():
        assert run_reasoning([text]) == want, text
        assert run_reasoning(split(text, cuts)) == want, text
    # a prompt that opened the block: the answer starts inside it
    assert run_reasoning(split("still thinking\n</think>\n\nDone.", cuts), opened=True) == ("still thinking", "Done.")


def test_prompt_reasoning_state() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<think>\nx\n</think>\n\nok<|im_start|>assistant\n")
    assert prompt_closes_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_closes_reasoning("<|im_start|>assistant\n")


def test_chat_output_reasoning_then_calls_and_parallel_off() -> None:
    text = (
        "<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    for parallel, calls in ((True, 2), (False, 1)):
        whole = ChatMessageBuilder()
        out = ChatOutput.for_request("qwen3", False, "hermes", SCHEMAS, parallel)
        whole.add(out.feed(text))
        whole.add(out.finish())
        message = whole.message(reasoning_key=True)
        assert message["reasoning_content"] == "The user wants weather."
        assert message["content"] == "Checking."
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"][:calls]
        assert out.calls == calls
        streamed = ChatMessageBuilder()
        out = ChatOutput.for_request("qwen3", False, "hermes", SCHEMAS, parallel)
        for ch in text:
            streamed.add(out.feed(ch))
        streamed.add(out.finish())
        got = streamed.message(reasoning_key=True)
        assert [c["function"] for c in got["tool_calls"]] == [c["function"] for c in message["tool_calls"]]
        assert (got["content"], got["reasoning_content"]) == (message["content"], message["reasoning_content"])
    # no parsers: the text is the content, as generated
    plain = ChatOutput.for_request("none", False, None, {}, True)
    assert plain.feed(text).content == text and plain.finish().content == ""
    assert ChatMessageBuilder().message(reasoning_key=False) == {"role": "assistant", "content": ""}
