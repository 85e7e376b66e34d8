"""The grammar that makes an answer tool calls (``tool_choice`` ``required`` or a named function).

The tokenizer sends the conversation's tools in a ``ToolCalls`` constraint; here they become EBNF
text, built with xgrammar's structural tags from the tools' parameter schemas in the format of the
tokenizer's ``--tool-call-parser``, which the grammar service compiles and caches as it does an
``ebnf`` constraint. So a constrained answer is nothing but calls whose arguments parse and
validate against their tool's schema:

    hermes:       <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>
    qwen3_coder:  <tool_call>\\n<function=NAME>\\nPARAMS\\n</function>\\n</tool_call>

``required`` with parallel calls: one or more calls separated by a newline; without: exactly one;
a named function: one call of it. With a reasoning parser the answer may first think
(``<think>…</think>`` then a blank line), unless the prompt already closed the think block;
a prompt that opened it makes the answer start inside it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal, get_args

from services.common.errors import InvalidArgument
from services.common.json_grammar import JSON_MAX_WHITESPACE, valid_json_strings
from services.tokenizer.reasoning import THINK_CLOSE, THINK_OPEN
from services.tokenizer.tool_parsers import ToolFormat
from strata.scheduler.v1 import scheduler_pb2 as spb

if TYPE_CHECKING:  # xgrammar imports torch: loaded with the grammar backend (services/scheduler/grammar.py)
    from xgrammar import structural_tag as st

ReasoningPrefix = Literal["none", "optional", "open"]
FORMATS: tuple[ToolFormat, ...] = get_args(ToolFormat)
PREFIXES: tuple[ReasoningPrefix, ...] = get_args(ReasoningPrefix)
NO_PARAMETERS = '{"type": "object", "properties": {}}'  # a tool without parameters takes {}
GRAMMAR_CACHE = 64  # agents send the same tools on every call: their grammar text is built once


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool as the grammar needs it: its name and its parameters' schema as JSON text."""

    name: str
    parameters: str  # an object schema; "" = no parameters


def tool_call_grammar(
    tools: Sequence[ToolSpec],
    fmt: ToolFormat,
    only: str = "",
    parallel: bool = True,
    reasoning: ReasoningPrefix = "none",
    field: str = "input.messages.tools",
) -> str:
    """EBNF text whose language is the calls described above.

    Raises:
        InvalidArgument: ``<field>[i].parameters: <reason>`` for a schema xgrammar cannot use,
            ``constraint.tool_calls.name`` for ``only`` naming no tool, or no tools at all.
    """
    if not tools:
        raise InvalidArgument(f"{field}: at least one tool is required for a tool-call constraint")
    if only and only not in {t.name for t in tools}:
        raise InvalidArgument(f"constraint.tool_calls.name: {only!r} is not one of the tools")
    chosen = tuple(t for t in tools if not only or t.name == only)
    try:
        return _grammar(chosen, fmt, bool(only), parallel, reasoning)
    except (RuntimeError, ValueError) as e:
        for i, tool in enumerate(tools):  # which tool's schema is at fault
            try:
                _grammar((tool,), fmt, True, False, "none")
            except (RuntimeError, ValueError) as one:
                raise InvalidArgument(f"{field}[{i}].parameters: {_reason(one)}") from None
        raise InvalidArgument(f"{field}: {_reason(e)}") from None


def tool_calls_key(calls: spb.ToolCalls) -> str:
    """``calls`` as one canonical text (the grammar cache's key, ``tool_calls_ebnf``'s input).

    Raises:
        InvalidArgument: ``constraint.tool_calls.format`` / ``.reasoning`` not one of the known.
    """
    reasoning = calls.reasoning or "none"
    if calls.format not in FORMATS:
        raise InvalidArgument(f"constraint.tool_calls.format: {calls.format!r}; expected one of {', '.join(FORMATS)}")
    if reasoning not in PREFIXES:
        raise InvalidArgument(f"constraint.tool_calls.reasoning: {reasoning!r}; expected one of {', '.join(PREFIXES)}")
    return json.dumps(
        {"tools": [[t.name, t.parameters] for t in calls.tools], "format": calls.format, "name": calls.name,
         "parallel": calls.parallel, "reasoning": reasoning}, separators=(",", ":"),
    )  # fmt: skip


def tool_calls_ebnf(key: str) -> str:
    """The EBNF of the calls that ``key`` (from ``tool_calls_key``) describes; raises as
    ``tool_call_grammar``."""
    d = json.loads(key)
    tools = tuple(ToolSpec(name, parameters) for name, parameters in d["tools"])
    return tool_call_grammar(tools, d["format"], d["name"], d["parallel"], d["reasoning"])


@lru_cache(maxsize=GRAMMAR_CACHE)
def _grammar(tools: tuple[ToolSpec, ...], fmt: ToolFormat, single: bool, parallel: bool,
             reasoning: ReasoningPrefix) -> str:  # fmt: skip
    import xgrammar as xgr
    from xgrammar import structural_tag as st

    tags: list[Any] = [_call_tag(t, fmt) for t in tools]
    calls: Any
    if single or (len(tags) == 1 and not parallel):
        calls = tags[0]
    elif parallel:
        calls = st.TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True)
    else:
        calls = st.OrFormat(elements=tags)
    if reasoning != "none":
        think = st.TagFormat(
            begin="" if reasoning == "open" else THINK_OPEN,
            content=st.AnyTextFormat(excludes=[THINK_OPEN, THINK_CLOSE]),
            end=THINK_CLOSE,
        )
        block: Any = st.SequenceFormat(elements=[think, st.ConstStringFormat(value="\n\n")])
        calls = st.SequenceFormat(elements=[block if reasoning == "open" else st.OptionalFormat(content=block), calls])
    grammar = xgr.Grammar.from_structural_tag(st.StructuralTag(format=calls))
    return valid_json_strings(str(grammar))


def _call_tag(tool: ToolSpec, fmt: ToolFormat) -> st.TagFormat:
    from xgrammar import structural_tag as st

    schema: dict[str, Any] = json.loads(tool.parameters or NO_PARAMETERS)
    if fmt == "hermes":
        return st.TagFormat(
            begin=f'<tool_call>\n{{"name": {json.dumps(tool.name)}, "arguments": ',
            content=st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=JSON_MAX_WHITESPACE),
            end="}\n</tool_call>",
        )
    return st.TagFormat(
        begin=f"<tool_call>\n<function={tool.name}>\n",
        content=st.JSONSchemaFormat(json_schema=schema, style="qwen_xml", max_whitespace_cnt=JSON_MAX_WHITESPACE),
        end="\n</function>\n</tool_call>",
    )


_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its log prefix, on one line."""
    text = " ".join(_LOG_PREFIX.sub("", str(exc).strip()).split())
    return text[:397] + "..." if len(text) > 400 else text or type(exc).__name__
