"""A conversation as the chat template gets it: messages (with the assistant's tool calls and
reasoning, and tool results), the tools offered, and the template's extra variables.

``chat_inputs`` validates a ``strata.v1.ChatMessages`` and converts it (``InvalidArgument`` naming
the field); ``render`` runs the template. Both faces of the tokenizer service reach them through
``StrataServicer.prepare``.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from services.common.errors import InvalidArgument
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.v1 import strata_pb2 as pb

ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_TOOLS = 128
MAX_CALL_ID_CHARS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # as OpenAI allows
# Arguments of apply_chat_template itself, and the variable it passes the conversation in: a
# template variable may not replace them.
RESERVED_KWARGS = frozenset(
    {"messages", *inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters} - {"self", "kwargs"}
)


@dataclass(frozen=True, slots=True)
class ChatInputs:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # OpenAI's tool objects, as templates expect them
    kwargs: dict[str, Any]  # extra template variables
    specs: tuple[spb.ToolCalls.Tool, ...]  # the tools, for a tool-call constraint
    chars: int  # characters of text in all of it (for the length check before rendering)

    @property
    def schemas(self) -> dict[str, Any]:
        """Each tool's parameters schema by name."""
        return {t["function"]["name"]: t["function"].get("parameters", {}) for t in self.tools or ()}


def chat_inputs(chat: pb.ChatMessages) -> ChatInputs:
    if not chat.messages:
        raise InvalidArgument("input.messages: at least one message is required")
    messages = [_message(i, m) for i, m in enumerate(chat.messages)]
    specs, tools = _tools(chat.tools)
    kwargs = _kwargs(chat.chat_template_kwargs)
    chars = sum(len(m.content) + len(m.reasoning_content) + sum(len(c.arguments) for c in m.tool_calls)
                for m in chat.messages)  # fmt: skip
    chars += sum(len(t.parameters) + len(t.description) for t in chat.tools) + len(chat.chat_template_kwargs)
    return ChatInputs(messages, tools, kwargs, specs, chars)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A generation request's input, ready for a scheduler (``StrataServicer.prepare``); the
    choices of one HTTP body share it."""

    ids: list[int]
    constraint: spb.Constraint | None  # as the scheduler compiles it
    reasoning_open: bool  # the prompt ends inside an open think block: the answer starts as reasoning
    tool_schemas: dict[str, Any]  # each tool's parameters schema by name (for parsing calls)


def render(tokenizer: Any, inputs: ChatInputs, add_generation_prompt: bool = True, continue_final: bool = False) -> str:
    """The prompt text; a template that refuses the conversation (``raise_exception``, a value of
    the wrong type for it, a final message to continue that is not there) is ``InvalidArgument``."""
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            inputs.messages, tools=inputs.tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final, **inputs.kwargs,
        )  # fmt: skip
    except (TemplateError, TypeError, ValueError) as e:
        raise InvalidArgument(f"input.messages: the chat template refused the conversation: {e}") from None
    return str(text)


def _message(i: int, m: pb.ChatMessage) -> dict[str, Any]:
    if m.role not in ROLES:
        raise InvalidArgument(
            f"input.messages[{i}].role: unknown role {m.role!r}; use one of {', '.join(sorted(ROLES))}"
        )
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        if m.role != "assistant":
            raise InvalidArgument(f"input.messages[{i}].tool_calls: only assistant messages make tool calls")
        calls = []
        for j, c in enumerate(m.tool_calls):
            where = f"input.messages[{i}].tool_calls[{j}]"
            if not TOOL_NAME.match(c.name):
                raise InvalidArgument(f"{where}.name: must be 1..64 characters of a-z, A-Z, 0-9, _ and -")
            if len(c.id) > MAX_CALL_ID_CHARS:
                raise InvalidArgument(f"{where}.id: at most {MAX_CALL_ID_CHARS} characters")
            function = {"name": c.name, "arguments": _args(c.arguments)}
            calls.append({"id": c.id, "type": "function", "function": function})
        out["tool_calls"] = calls
    if m.tool_call_id:
        if len(m.tool_call_id) > MAX_CALL_ID_CHARS:
            raise InvalidArgument(f"input.messages[{i}].tool_call_id: at most {MAX_CALL_ID_CHARS} characters")
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out


def _args(text: str) -> Any:
    """Arguments as templates expect them: the object itself (Qwen3-Coder's iterates its items);
    text that is not a JSON object (a model's malformed call sent back) stays text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _tools(tools: Any) -> tuple[tuple[spb.ToolCalls.Tool, ...], list[dict[str, Any]] | None]:
    if not tools:
        return (), None
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"input.messages.tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    seen: set[str] = set()
    specs, out = [], []
    for i, t in enumerate(tools):
        where = f"input.messages.tools[{i}]"
        if not TOOL_NAME.match(t.name):
            raise InvalidArgument(f"{where}.name: must be 1..64 characters of a-z, A-Z, 0-9, _ and -, got {t.name!r}")
        if t.name in seen:
            raise InvalidArgument(f"{where}.name: {t.name!r} is given twice; tool names must be unique")
        seen.add(t.name)
        function: dict[str, Any] = {"name": t.name}
        if t.description:
            function["description"] = t.description
        if t.parameters:
            try:
                schema = json.loads(t.parameters)
            except ValueError as e:
                raise InvalidArgument(f"{where}.parameters: not valid JSON: {e}") from None
            if not isinstance(schema, dict) or schema.get("type", "object") != "object":
                raise InvalidArgument(f"{where}.parameters: must be a JSON schema of an object (type \"object\")")
            function["parameters"] = schema
        specs.append(spb.ToolCalls.Tool(name=t.name, parameters=t.parameters))
        out.append({"type": "function", "function": function})
    return tuple(specs), out


def _kwargs(text: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"input.messages.chat_template_kwargs: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidArgument("input.messages.chat_template_kwargs: must be a JSON object")
    reserved = sorted(RESERVED_KWARGS & value.keys())
    if reserved:
        raise InvalidArgument(
            f"input.messages.chat_template_kwargs: {reserved[0]!r} is set by the server, not a template variable"
        )
    return value
