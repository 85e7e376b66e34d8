"""The ``hermes`` tool-call format (Qwen3, Qwen3-Next)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call's arguments are the model's own JSON text for the value of ``"arguments"``, byte for byte,
released as it arrives (``_JsonValueScanner`` finds where the value ends). A block whose keys come
in another order is read when it closes, its arguments re-serialized.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.tokenizer.tool_blocks import CALL_CLOSE, CALL_OPEN, BlockParser, Parsed, ToolCallDelta, new_call_id

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_VALUE_END = frozenset(",}] \t\r\n")


class _JsonValueScanner:
    """Finds where one JSON value ends in text that arrives in pieces, and releases its text as
    soon as it is certainly part of the value (a bare number or literal only when it ends)."""

    __slots__ = ("_depth", "_done", "_escape", "_in_string", "_pending", "_started", "value")

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = self._escape = self._started = self._done = False
        self._pending = ""  # a scalar's text until it ends
        self.value = ""  # all of the value's text so far

    @property
    def done(self) -> bool:
        return self._done

    def scan(self, text: str) -> tuple[str, int]:
        """Consume ``text``; returns the value text released and how many characters were used."""
        out = []
        used = 0
        for ch in text:
            if self._done:
                break
            if not self._started:
                used += 1
                if ch.isspace():
                    continue
                self._started = True
                if ch in "{[":
                    self._depth = 1
                    out.append(ch)
                elif ch == '"':
                    self._in_string = True
                    out.append(ch)
                else:
                    self._pending = ch
                continue
            if self._pending:  # a number or literal: ends at a delimiter, which is not its own
                if ch in _VALUE_END:
                    out.append(self._pending)
                    self._done = True
                    break
                self._pending += ch
                used += 1
                continue
            used += 1
            out.append(ch)
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    self._done = self._depth == 0
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                self._done = self._depth == 0
        released = "".join(out)
        self.value += released
        return released, used

    def flush(self) -> str:
        """The text ended: a scalar still pending is released as it is."""
        pending, self._pending = self._pending, ""
        self.value += pending
        return pending


class HermesParser(BlockParser):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen3)."""

    def __init__(self) -> None:
        super().__init__()
        self._block = ""  # the text of a block whose head did not read as it streamed
        self._named = False
        self._args: _JsonValueScanner | None = None

    def _begin_call(self, tag: str) -> None:
        self._block, self._named, self._args = "", False, None

    def _step_call(self, out: Parsed) -> bool:
        buf = self._buf
        if not self._named:
            close = buf.find(CALL_CLOSE)
            head = _HEAD.match(buf)
            if head is not None and (close < 0 or head.end() <= close):
                name = _json_string(head.group(1))
                if name:
                    out.calls.append(ToolCallDelta(self._calls, new_call_id(), name))
                    self._named, self._args = True, _JsonValueScanner()
                    self._buf = buf = buf[head.end() :]
            if not self._named:
                if close < 0:
                    return False
                self._block += buf[:close]
                called = self._calls
                self._end_call(out, closed=True)
                self._close(buf[close + len(CALL_CLOSE) :], called=self._calls > called)
                return True
        assert self._args is not None
        if not self._args.done:
            released, used = self._args.scan(buf)
            if released:
                out.calls.append(ToolCallDelta(self._calls, arguments=released))
            self._buf = buf = buf[used:]
            if not self._args.done:
                return False
        close = buf.find(CALL_CLOSE)
        if close < 0:
            return False
        self._calls += 1
        self._close(buf[close + len(CALL_CLOSE) :])
        return True

    def _end_call(self, out: Parsed, closed: bool) -> None:
        if self._named:
            assert self._args is not None
            rest = self._args.flush()
            if rest:
                out.calls.append(ToolCallDelta(self._calls, arguments=rest))
            self._calls += 1
            return
        # Not readable as it streamed (keys in another order, say): parse the whole block.
        text = self._block + ("" if closed else self._buf)
        call = _json_object(text)
        name = call.get("name") if call is not None else None
        args = call.get("arguments", call.get("parameters", {})) if call is not None else None
        if isinstance(name, str) and name:
            out.calls.append(
                ToolCallDelta(self._calls, new_call_id(), name, json.dumps(args, ensure_ascii=False))
            )
            self._calls += 1
        else:
            out.content += CALL_OPEN + text + (CALL_CLOSE if closed else "")


def _json_string(body: str) -> str:
    try:
        value = json.loads(f'"{body}"')
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
