"""The ``qwen3_coder`` tool-call format (Qwen3-Coder)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A call's arguments are a JSON object built from its parameters, each value converted by the type
its tool's schema gives, released a parameter at a time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from services.tokenizer.tool_blocks import CALL_CLOSE, CALL_OPEN, BlockParser, Parsed, ToolCallDelta, new_call_id

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"


class Qwen3CoderParser(BlockParser):
    """``<tool_call><function=NAME><parameter=P>VALUE</parameter>…</function></tool_call>``
    (Qwen3-Coder; the ``<tool_call>`` wrapper may be missing). Arguments stream one parameter at a
    time: ``{"p": v`` then ``, "q": w`` … then ``}``."""

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]]) -> None:
        super().__init__(opens=(CALL_OPEN, FUNCTION_OPEN))
        self._schemas = schemas
        self._tag = CALL_OPEN
        self._name: str | None = None
        self._params = 0
        self._function_closed = False

    def _begin_call(self, tag: str) -> None:
        self._tag, self._name, self._params, self._function_closed = tag, None, 0, False
        if tag == FUNCTION_OPEN:  # no wrapper: the function tag itself opened the call
            self._buf = FUNCTION_OPEN + self._buf

    def _step_call(self, out: Parsed) -> bool:
        while True:
            buf = self._buf.lstrip()
            if self._name is None:
                if not buf.startswith(FUNCTION_OPEN):
                    if FUNCTION_OPEN.startswith(buf):
                        return False  # the tag is still arriving
                    return self._not_a_call(out, self._tag)
                end = buf.find(">")
                if end < 0:
                    return False
                self._name = buf[len(FUNCTION_OPEN) : end].strip()
                out.calls.append(ToolCallDelta(self._calls, new_call_id(), self._name))
                self._buf = buf[end + 1 :]
            elif not self._function_closed:
                if buf.startswith(PARAM_OPEN):
                    gt, end = buf.find(">"), buf.find(PARAM_CLOSE)
                    if gt < 0 or end < 0:
                        return False
                    key = buf[len(PARAM_OPEN) : gt].strip()
                    value = json.dumps(_param_value(buf[gt + 1 : end], self._param_schema(key)), ensure_ascii=False)
                    sep = ", " if self._params else "{"
                    out.calls.append(ToolCallDelta(self._calls, arguments=f"{sep}{json.dumps(key)}: {value}"))
                    self._params += 1
                    self._buf = buf[end + len(PARAM_CLOSE) :]
                elif buf.startswith(FUNCTION_CLOSE):
                    self._end_call(out, closed=True)
                    self._buf = buf[len(FUNCTION_CLOSE) :]
                elif PARAM_OPEN.startswith(buf) or FUNCTION_CLOSE.startswith(buf):
                    return False
                else:  # stray text inside the function: skip to the next tag
                    nxt = buf.find("<", 1)
                    self._buf = buf[nxt:] if nxt >= 0 else ""
                    if nxt < 0:
                        return False
            elif buf.startswith(CALL_CLOSE):  # after </function>: the wrapper's close tag
                self._close(buf[len(CALL_CLOSE) :])
                return True
            elif CALL_CLOSE.startswith(buf) and self._tag == CALL_OPEN:
                return False
            else:
                self._close(buf)
                return True

    def _end_call(self, out: Parsed, closed: bool) -> None:
        if self._name is None:
            out.content += self._tag + self._buf if self._tag == CALL_OPEN else self._buf
            return
        if not self._function_closed:
            out.calls.append(ToolCallDelta(self._calls, arguments="}" if self._params else "{}"))
            self._function_closed = True
            self._calls += 1

    def _param_schema(self, key: str) -> Mapping[str, Any]:
        tool = self._schemas.get(self._name or "", {})
        props = tool.get("properties", {}) if isinstance(tool, Mapping) else {}
        schema = props.get(key, {}) if isinstance(props, Mapping) else {}
        return schema if isinstance(schema, Mapping) else {}


_JSON_KINDS: tuple[tuple[type, str], ...] = (
    (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (dict, "object"), (list, "array")
)


def _kind_of(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    for tp, name in _JSON_KINDS:
        if isinstance(value, tp):
            return {name, "number"} if name == "integer" else {name}
    return set()


_CONSTRAINED_STRING = frozenset({"minLength", "maxLength", "pattern", "format"})


def _param_value(raw: str, schema: Mapping[str, Any]) -> Any:
    """A parameter's text as its schema's type: a string as written (less the newline after the
    open tag and the one before the close tag), another type as JSON; text that does not read as
    a type the schema allows stays a string."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    choices = [schema["const"]] if "const" in schema else schema.get("enum", [])
    if isinstance(choices, list) and text.strip() in [c for c in choices if isinstance(c, str)]:
        return text.strip()  # a fixed string: the whitespace around it is the format's, not the value's
    types = schema.get("type")
    kinds = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else set()
    if kinds == {"string"}:
        # A string with constraints is written between whitespace that is not part of it (as the
        # tool-call grammar has it); a free one (code, say) keeps all but the newlines around it.
        return text.strip() if _CONSTRAINED_STRING & schema.keys() else text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if kinds and not kinds & _kind_of(value):
        return text
    return value
