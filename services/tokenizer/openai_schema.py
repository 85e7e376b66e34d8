"""OpenAI-compatible request bodies and their translation to ``strata.v1.GenerateRequest``.

The bodies follow OpenAI's Chat Completions and Completions APIs, with the extras vLLM and SGLang
accept (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``regex``, ``ebnf``, ``cache_salt``). Fields OpenAI defines but Strata cannot honour are refused
with a message naming them rather than silently ignored; fields nobody defines are ignored, as
OpenAI's clients send vendor extras freely.

One body becomes one internal request per choice: a prompt list of P entries with ``n`` = N is
P x N requests, choice index ``p * N + j``. Choices after the first get ``seed + j`` so that a
seeded request with ``n > 1`` is reproducible without giving every choice the same sample.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.errors import InvalidArgument
from services.common.step import MAX_TOP_LOGPROBS
from strata.v1 import strata_pb2 as pb

MAX_CHOICES = 64  # n x prompts per body: each is a full request on the scheduler

# The legacy Completions API caps `logprobs` at 5; we allow what the sampler can return.
_Role = Literal["system", "user", "assistant", "tool", "developer"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = ""
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ContentPart(_Body):
    type: str
    text: str = ""


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = ""  # a JSON object as text (OpenAI); an object is accepted too

    def text(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments, ensure_ascii=False)


class MessageToolCall(_Body):
    """A call an assistant message made, sent back in the conversation."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object
    strict: bool | None = None  # arguments always follow the schema under a tool-call grammar


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(_Body):
    role: _Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant (as this server returns it)
    reasoning: str | None = None  # the same, as newer peers name it

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for k, part in enumerate(self.content):
            if part.type != "text":
                raise InvalidArgument(
                    f"messages[{index}].content[{k}].type: {part.type!r} is not supported; "
                    "this model takes text parts only"
                )
        return "".join(part.text for part in self.content)


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM / SGLang extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    regex: str | None = None
    ebnf: str | None = None
    cache_salt: str = ""
    request_id: str | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Sampling:
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def sampling(self, max_tokens: int | None, zero_ok: bool | None = None) -> pb.SamplingParams:
        """``zero_ok``: whether ``max_tokens`` 0 (a prompt scored alone) is allowed; None: the
        endpoint has no such mode."""
        s = pb.SamplingParams(
            top_k=self.top_k,
            min_p=self.min_p,
            ignore_eos=self.ignore_eos,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            stop_token_ids=self.stop_token_ids,
            stop=[self.stop] if isinstance(self.stop, str) else (self.stop or []),
        )
        if self.temperature is not None:
            s.temperature = self.temperature
        if self.top_p is not None:
            s.top_p = self.top_p
        if self.seed is not None:
            s.seed = self.seed
        if self.repetition_penalty is not None:
            s.repetition_penalty = self.repetition_penalty
        if max_tokens is not None:
            if max_tokens < 1 and not (max_tokens == 0 and zero_ok):
                why = " (0 only with echo or prompt_logprobs: the prompt scored alone)" if zero_ok is not None else ""
                raise InvalidArgument(f"sampling.max_new_tokens: must be >= 1{why}, got {max_tokens}")
            s.max_new_tokens = max_tokens
        return s

    def constrain(self, req: pb.GenerateRequest, response_format: ResponseFormat | None) -> None:
        kinds = []
        if response_format is not None and response_format.type == "json_object":
            kinds.append(("json_schema", '{"type": "object"}'))
        if response_format is not None and response_format.type == "json_schema":
            js = response_format.json_schema
            if js is None or js.schema_ is None:
                raise InvalidArgument("response_format.json_schema.schema: required for type json_schema")
            kinds.append(("json_schema", json.dumps(js.schema_)))
        if self.regex is not None:
            kinds.append(("regex", self.regex))
        if self.ebnf is not None:
            kinds.append(("ebnf", self.ebnf))
        if len(kinds) > 1:
            raise InvalidArgument("response_format, regex, ebnf: at most one constraint per request")
        for kind, value in kinds:
            setattr(req, kind, value)

    def fan_out(self, base: list[pb.GenerateRequest], request_id: str) -> list[pb.GenerateRequest]:
        """One internal request per choice, ids ``<request_id>-<choice>``."""
        out = []
        for p, req in enumerate(base):
            for j in range(self.n):
                r = pb.GenerateRequest()
                r.CopyFrom(req)
                r.request_id = f"{request_id}-{p * self.n + j}"
                if j and self.seed is not None:
                    r.sampling.seed = (self.seed + j) % 2**64
                out.append(r)
        if len(out) > MAX_CHOICES:
            raise InvalidArgument(f"n: prompts x n is {len(out)}, at most {MAX_CHOICES} choices per request")
        return out


def chat_messages(
    messages: list[ChatMessage], tools: list[ToolDef] | None, template_kwargs: dict[str, Any] | None
) -> pb.ChatMessages:
    """A conversation as ``strata.v1.ChatMessages`` (the tokenizer service validates the rest)."""
    out = pb.ChatMessages()
    for i, m in enumerate(messages):
        msg = out.messages.add(role="system" if m.role == "developer" else m.role, content=m.text(i))
        for c in m.tool_calls or ():
            msg.tool_calls.add(id=c.id, name=c.function.name, arguments=c.function.text())
        msg.tool_call_id = m.tool_call_id or ""
        msg.name = m.name or ""
        msg.reasoning_content = m.reasoning_content or m.reasoning or ""
    for t in tools or ():
        f = t.function
        params = json.dumps(f.parameters, ensure_ascii=False) if f.parameters is not None else ""
        out.tools.add(name=f.name, description=f.description or "", parameters=params)
    if template_kwargs:
        out.chat_template_kwargs = json.dumps(template_kwargs, ensure_ascii=False)
    return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's extra: score the prompt, this many alternatives per token (response: prompt_logprobs)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        if forced and not self.tools:
            raise ValueError("tool_choice: 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools or ()}:
                raise ValueError(f"tool_choice: function {name!r} is not one of the tools")
        fmt = self.response_format
        if forced and (self.regex is not None or self.ebnf is not None or (fmt is not None and fmt.type != "text")):
            raise ValueError("tool_choice: 'required' or a named function cannot be combined with "
                             "response_format, regex or ebnf (one grammar per request)")  # fmt: skip
        return self

    @property
    def tool_calls_expected(self) -> bool:
        """Whether the answer is parsed for tool calls (tools given and tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def requests(self, request_id: str) -> list[pb.GenerateRequest]:
        req = pb.GenerateRequest(
            sampling=self.sampling(self.max_completion_tokens or self.max_tokens),
            cache_salt=self.cache_salt,
            return_logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            stream=True,
            prompt_logprobs=self.prompt_logprobs,
        )
        req.messages.CopyFrom(chat_messages(self.messages, self.tools, self.chat_template_kwargs))
        if isinstance(self.tool_choice, NamedToolChoice):
            req.tool_calls.CopyFrom(pb.ToolCallConstraint(name=self.tool_choice.function.name))
        elif self.tool_choice == "required" and self.tools:
            req.tool_calls.CopyFrom(pb.ToolCallConstraint(parallel=self.parallel_tool_calls))
        else:
            self.constrain(req, self.response_format)
        return self.fan_out([req], request_id)


class CompletionRequest(_Sampling):
    """``echo`` puts the prompt before each choice's text, and with ``logprobs`` its tokens before
    the completion's (the first with a null logprob, as it has no context); ``max_tokens`` 0 with
    ``echo`` (or ``prompt_logprobs``) scores the prompt alone. ``prompt_logprobs`` (vLLM's extra)
    adds each choice's ``prompt_logprobs``: null, then per prompt token a dict token id ->
    ``{logprob, rank, decoded_token}`` of the token and its ``prompt_logprobs`` best alternatives."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for this endpoint
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _completion_rules(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidArgument("prompt: must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def scored(self) -> int | None:
        """Alternatives per prompt token to ask of the server, or None when the prompt is not scored:
        ``prompt_logprobs``, the echoed prompt's ``logprobs``, or 0 for a prompt scored alone with
        nothing to return (``max_tokens`` 0 generates nothing, and only scoring runs a request so)."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        if asked:
            return max(asked)
        return 0 if self.max_tokens == 0 and self.echo else None

    def requests(self, request_id: str) -> list[pb.GenerateRequest]:
        base = []
        scored = self.scored()
        for prompt in self.prompts():
            req = pb.GenerateRequest(
                sampling=self.sampling(self.max_tokens, zero_ok=scored is not None),
                cache_salt=self.cache_salt,
                return_logprobs=self.logprobs is not None,
                top_logprobs=self.logprobs or 0,
                stream=True,
                prompt_logprobs=scored,
            )
            if isinstance(prompt, str):
                req.text = prompt
            else:
                if any(i < 0 for i in prompt):
                    raise InvalidArgument("prompt: token ids must be >= 0")
                req.input_ids.ids.extend(prompt)
            self.constrain(req, self.response_format)
            base.append(req)
        return self.fan_out(base, request_id)


class TokenizeRequest(_Body):
    """vLLM's ``/tokenize``: a ``prompt`` (text) or ``messages`` (rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        explicit = "add_generation_prompt" in self.model_fields_set
        if self.continue_final_message and self.add_generation_prompt and explicit:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt")
        return self


class DetokenizeRequest(_Body):
    """vLLM's ``/detokenize``."""

    model: str | None = None
    tokens: list[int]


# Internal field paths (as validation names them) -> the parameter a client of this API sent.
PARAM_NAMES: dict[str, str] = {
    "input.messages.tools": "tools",
    "input.messages.chat_template_kwargs": "chat_template_kwargs",
    "constraint.tool_calls": "tool_choice",
    "sampling.max_new_tokens": "max_tokens",
    "sampling.stop_token_ids": "stop_token_ids",
    "sampling.stop": "stop",
    "input.input_ids.ids": "prompt",
    "input.text": "prompt",
    "input.messages": "messages",
    "constraint.json_schema": "response_format",
    "constraint.regex": "regex",
    "constraint.ebnf": "ebnf",
    "sampling.": "",
}


def public_message(message: str, prompt_field: str) -> tuple[str, str | None]:
    """Rewrite an internal ``field: reason`` message to name the API's parameter; returns the
    message and the parameter (None when the message names none)."""
    head, sep, rest = message.partition(": ")
    if not sep or " " in head:
        return message, None
    name = head
    if head == "input":
        name = prompt_field
    else:
        for internal, public in PARAM_NAMES.items():
            if head.startswith(internal):
                tail = head[len(internal) :]
                if public in ("prompt", "messages"):
                    public = prompt_field
                name = public + tail
                break
    return f"{name}: {rest}", name.split("[")[0].split(".")[0]
