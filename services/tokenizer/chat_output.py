"""One chat answer split as OpenAI returns it: ``reasoning_content``, ``content``, ``tool_calls``.

The answer's text goes through the reasoning parser (``--reasoning-parser``), then what is content
through the tool-call parser (``--tool-call-parser``, when the request has tools and
``tool_choice`` is not ``none``). Streamed or whole, the same ``ChatOutput`` does the work, so the
deltas of a stream join to the whole message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.tokenizer.reasoning import ReasoningFormat, ReasoningParser
from services.tokenizer.tool_parsers import ToolCallDelta, ToolFormat, ToolParser, make_parser


@dataclass(slots=True)
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def openai(self) -> dict[str, Any]:
        """The delta as OpenAI streams it (``{"content": ""}`` when nothing became final)."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content or not (self.reasoning or self.calls):
            out["content"] = self.content
        if self.calls:
            out["tool_calls"] = [_call_delta(d) for d in self.calls]
        return out


class ChatOutput:
    """Splits one choice's answer; ``feed`` its text in order, then ``finish`` once."""

    __slots__ = ("_calls", "_max_calls", "_reasoning", "_tools")

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None) -> None:
        """``max_calls``: calls after this many are dropped (``parallel_tool_calls: false``)."""
        self._reasoning = reasoning
        self._tools = tools
        self._max_calls = max_calls
        self._calls = 0

    @classmethod
    def for_request(
        cls,
        reasoning: ReasoningFormat,
        reasoning_open: bool,
        tool_format: ToolFormat | None,
        schemas: Mapping[str, Mapping[str, Any]],
        parallel: bool,
    ) -> ChatOutput:
        """``tool_format`` None: the answer is not parsed for tool calls."""
        return cls(
            ReasoningParser(reasoning_open) if reasoning != "none" else None,
            make_parser(tool_format, schemas) if tool_format is not None else None,
            None if parallel else 1,
        )

    @property
    def passthrough(self) -> bool:
        """All further text is content as it comes (no tool parser, past any reasoning): the
        caller may pass text on without ``feed``."""
        return self._tools is None and (self._reasoning is None or self._reasoning.in_content)

    @property
    def calls(self) -> int:
        """Tool calls found so far."""
        return self._calls

    def feed(self, text: str) -> ChatDelta:
        if self._reasoning is None:
            return self._content(text, finish=False)
        split = self._reasoning.feed(text)
        out = self._content(split.content, finish=False)
        out.reasoning = split.reasoning
        return out

    def finish(self) -> ChatDelta:
        if self._reasoning is None:
            return self._content("", finish=True)
        split = self._reasoning.finish()
        out = self._content(split.content, finish=True)
        out.reasoning = split.reasoning
        return out

    def _content(self, text: str, finish: bool) -> ChatDelta:
        if self._tools is None:
            return ChatDelta(content=text)
        parsed = self._tools.feed(text) if text else None
        content = parsed.content if parsed is not None else ""
        calls = list(parsed.calls) if parsed is not None else []
        if finish:
            last = self._tools.finish()
            content += last.content
            calls += last.calls
        if self._max_calls is not None:
            calls = [d for d in calls if d.index < self._max_calls]
        if calls:
            self._calls = max(self._calls, max(d.index for d in calls) + 1)
        return ChatDelta(content=content, calls=calls)


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class ChatMessageBuilder:
    """Joins a choice's deltas into the whole ``message`` of a non-streamed answer."""

    __slots__ = ("_calls", "_content", "_reasoning")

    def __init__(self) -> None:
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: dict[int, _Call] = {}

    def add(self, delta: ChatDelta) -> None:
        self._reasoning.append(delta.reasoning)
        self._content.append(delta.content)
        for d in delta.calls:
            call = self._calls.get(d.index)
            if call is None:
                call = self._calls[d.index] = _Call(d.id or "", d.name or "")
            call.arguments.append(d.arguments)

    def message(self, reasoning_key: bool) -> dict[str, Any]:
        """``reasoning_key``: a reasoning parser runs, so ``reasoning_content`` is always present."""
        content = "".join(self._content)
        out: dict[str, Any] = {"role": "assistant", "content": content or (None if self._calls else "")}
        if reasoning_key:
            out["reasoning_content"] = "".join(self._reasoning) or None
        if self._calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": "".join(c.arguments)}}
                for _, c in sorted(self._calls.items())
            ]
        return out


def _call_delta(d: ToolCallDelta) -> dict[str, Any]:
    if d.name is not None:  # the call's first delta: id, type and name, as OpenAI sends them
        function = {"name": d.name, "arguments": d.arguments}
        return {"index": d.index, "id": d.id, "type": "function", "function": function}
    return {"index": d.index, "function": {"arguments": d.arguments}}
