"""The responses of the OpenAI-compatible API: one body's choices merged into one JSON response
or one stream of Server-Sent Events.

A chat answer is split into ``reasoning_content``, ``content`` and ``tool_calls`` when the server
runs a reasoning parser or the request has tools (``chat_output.py``); otherwise its text is
passed on as it comes, through a fast path that formats a streamed token's chunk from a prefix.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.common.step import MAX_TOP_LOGPROBS
from services.tokenizer.chat_output import ChatDelta, ChatMessageBuilder, ChatOutput
from services.tokenizer.openai_schema import ChatCompletionRequest, CompletionRequest
from strata.v1 import strata_pb2 as pb

FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}


class GenerationFailed(Exception):
    """A choice ended with ``FINISH_REASON_ERROR``; the HTTP layer answers 500 with the reason."""


class ChoiceStream(Protocol):
    def __aiter__(self) -> AsyncIterator[tuple[int, pb.GenerateResponse]]: ...


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    last: pb.GenerateResponse | None = None
    prompt: pb.PromptLogprobs | None = None


def _first_per_key(pairs: Iterable[tuple[str, float]]) -> dict[str, float]:
    """The legacy format keys top logprobs by text; two ids that decode alike keep the likelier."""
    out: dict[str, float] = {}
    for k, v in pairs:
        out.setdefault(k, v)
    return out


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class Reply:
    """Builds one body's response objects (whole or as SSE chunks).

    ``chat_output``: makes each choice's ``ChatOutput`` when chat answers are split (None: the
    text is the content, as generated); ``reasoning_key``: ``reasoning_content`` is part of every
    message (a reasoning parser runs)."""

    def __init__(
        self,
        model: str,
        token_text: Callable[[int], str],
        body: ChatCompletionRequest | CompletionRequest,
        id_: str,
        chat_output: Callable[[], ChatOutput] | None = None,
        reasoning_key: bool = False,
        echo: list[str] | None = None,
    ) -> None:
        """``echo``: the text of each prompt, put before its choices' text (completions with
        ``echo``; with ``logprobs`` the scored prompt's tokens come before the completion's too)."""
        self.model, self.token_text, self.body, self.id = model, token_text, body, id_
        self.chat = isinstance(body, ChatCompletionRequest)
        self.chat_output, self.reasoning_key = chat_output, reasoning_key
        self.echo = echo
        # Alternatives per echoed prompt token (the completion's logprobs), or None: no echoed logprobs.
        self.echo_top = body.logprobs if isinstance(body, CompletionRequest) and echo is not None else None
        self.prompt_top = body.prompt_logprobs  # vLLM's prompt_logprobs: None = not asked
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, lasts: dict[int, pb.GenerateResponse]) -> dict[str, Any]:
        n = self.body.n
        prompt = sum(r.usage.prompt_tokens for i, r in lasts.items() if i % n == 0)
        cached = sum(r.usage.cached_tokens for i, r in lasts.items() if i % n == 0)
        completion = sum(r.usage.completion_tokens for r in lasts.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def logprobs(
        self, lps: list[pb.TokenLogprob], offset: int = 0, prompt: pb.PromptLogprobs | None = None
    ) -> dict[str, Any] | None:
        """The ``logprobs`` object of ``lps``; ``prompt``: the echoed prompt's scores, which come
        first (completions only: the first token's logprob and alternatives null)."""
        echoed = prompt is not None and self.echo_top is not None
        if not lps and not echoed:
            return None
        text = self.token_text
        if self.chat:

            def entry(token_id: int, lp: float) -> dict[str, Any]:
                t = text(token_id)
                return {"token": t, "logprob": lp, "bytes": list(t.encode())}

            return {
                "content": [
                    {**entry(x.token_id, x.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in x.top]}
                    for x in lps
                ]
            }
        tokens = [text(x.token_id) for x in lps]
        values: list[float | None] = [x.logprob for x in lps]
        def top(x: pb.TokenLogprob, k: int = MAX_TOP_LOGPROBS) -> dict[str, float]:
            return _first_per_key((text(t.token_id), t.logprob) for t in x.top[:k])

        tops: list[dict[str, float] | None] = [top(x) for x in lps]
        if echoed:
            assert prompt is not None and self.echo_top is not None
            k, scored = self.echo_top, prompt.logprobs
            tokens[:0] = [text(prompt.first_token_id), *(text(x.token_id) for x in scored)]
            values[:0] = [None, *(x.logprob for x in scored)]
            tops[:0] = [None, *(top(x, k) for x in scored)]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def prompt_logprobs(self, prompt: pb.PromptLogprobs | None) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs``: null for the first token, then per token a dict token id ->
        ``{logprob, rank, decoded_token}`` of the token and its best alternatives (rank 1, 2, ...)."""
        if prompt is None or self.prompt_top is None:
            return None
        text, k = self.token_text, self.prompt_top
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for x, rank in zip(prompt.logprobs, prompt.ranks, strict=True):
            entry = {str(x.token_id): {"logprob": x.logprob, "rank": rank, "decoded_token": text(x.token_id)}}
            for j, t in enumerate(x.top[:k]):
                alt = {"logprob": t.logprob, "rank": j + 1, "decoded_token": text(t.token_id)}
                entry.setdefault(str(t.token_id), alt)
            out.append(entry)
        return out

    def _echo_text(self, index: int) -> str:
        assert self.echo is not None
        return self.echo[index // self.body.n]

    @staticmethod
    def _finish(resp: pb.GenerateResponse, calls: int = 0) -> str:
        if resp.finish_reason == pb.FINISH_REASON_ERROR:
            raise GenerationFailed(f"generation failed: {resp.error or 'unknown error'}")
        reason = FINISH[resp.finish_reason]
        return "tool_calls" if calls and reason == "stop" else reason

    async def whole(self, choices: ChoiceStream) -> dict[str, Any]:
        got: dict[int, _Choice] = {}
        async for index, resp in choices:
            c = got.setdefault(index, _Choice())
            c.text.append(resp.text)
            c.logprobs += resp.logprobs
            if resp.HasField("prompt_logprobs"):
                c.prompt = resp.prompt_logprobs
            if resp.finish_reason:
                c.last = resp
        lasts = {i: c.last for i, c in got.items() if c.last is not None}
        out = []
        for i in sorted(got):
            c = got[i]
            assert c.last is not None
            text = "".join(c.text)
            item: dict[str, Any] = {"index": i, "logprobs": self.logprobs(c.logprobs, prompt=c.prompt)}
            calls = 0
            if not self.chat:
                item["text"] = self._echo_text(i) + text if self.echo is not None else text
                if self.prompt_top is not None:
                    item["prompt_logprobs"] = self.prompt_logprobs(c.prompt)
            elif self.chat_output is None:
                item["message"] = {"role": "assistant", "content": text}
            else:
                split, message = self.chat_output(), ChatMessageBuilder()
                message.add(split.feed(text))
                message.add(split.finish())
                item["message"] = message.message(self.reasoning_key)
                calls = split.calls
            item["finish_reason"] = self._finish(c.last, calls)
            out.append(item)
        whole = {**self._head(self.object), "choices": out, "usage": self.usage(lasts)}
        if self.chat and self.prompt_top is not None:  # vLLM's place for it: one prompt for every choice
            whole["prompt_logprobs"] = self.prompt_logprobs(got[0].prompt if 0 in got else None)
        return whole

    async def events(self, choices: ChoiceStream) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        include_usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        started: set[int] = set()
        offsets: dict[int, int] = {}
        lasts: dict[int, pb.GenerateResponse] = {}
        splits: dict[int, ChatOutput] = {}
        # The chunk of a token in mid-stream (no logprobs, no finish, not the first) is the same
        # JSON but for its index and text: formatted from a prefix made once.
        head = json.dumps(self._head(obj), separators=(",", ":"))[:-1].replace("%", "%%")  # ids may hold %
        field_ = '"delta":{"content":%s}' if self.chat else '"text":%s'
        tail = ',"usage":null}' if include_usage else "}"
        plain = head + ',"choices":[{"index":%d,"logprobs":null,"finish_reason":null,' + field_ + "}]" + tail
        fast = self.chat_output is None
        async for index, resp in choices:
            split = splits.get(index)
            finished = bool(resp.finish_reason)
            if finished:
                lasts[index] = resp
            # One chunk per sampled token (or per batch of tokens that arrived together), even when
            # it adds no text yet (half a UTF-8 character, held-back stop-string text): clients
            # count chunks as tokens and time the first one as TTFT.
            if not (resp.token_ids or resp.text or finished or (self.chat and index not in started)):
                continue
            passthrough = fast or (split is not None and split.passthrough)
            if passthrough and not finished and not resp.logprobs and index in started:
                yield b"data: " + (plain % (index, json.dumps(resp.text))).encode() + b"\n\n"
                continue
            # A choice's first chunk brings the echoed prompt (text, and its scores with logprobs).
            first = index not in started
            scored = resp.prompt_logprobs if resp.HasField("prompt_logprobs") else None
            lp = self.logprobs(list(resp.logprobs), offsets.get(index, 0), scored if first else None)
            choice: dict[str, Any] = {"index": index, "logprobs": lp, "finish_reason": None}
            if lp is not None and not self.chat:
                offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            calls = 0
            extra: dict[str, Any] = {}
            if scored is not None and self.prompt_top is not None:
                if not self.chat:
                    extra["prompt_logprobs"] = self.prompt_logprobs(scored)
                elif index == 0:
                    extra = {"prompt_logprobs": self.prompt_logprobs(scored)}
            if not self.chat:
                choice["text"] = self._echo_text(index) + resp.text if first and self.echo is not None else resp.text
                choice.update(extra)
                extra = {}
            elif fast:
                choice["delta"] = {"content": resp.text}
            else:
                if split is None:
                    split = splits[index] = self.chat_output()  # type: ignore[misc]
                delta = split.feed(resp.text)
                if finished:
                    last = split.finish()
                    delta = ChatDelta(delta.reasoning + last.reasoning, delta.content + last.content,
                                      delta.calls + last.calls)  # fmt: skip
                choice["delta"] = delta.openai()
                calls = split.calls
            if self.chat and index not in started:
                choice["delta"] = {"role": "assistant", **choice["delta"]}
            if finished:
                choice["finish_reason"] = self._finish(resp, calls)
            started.add(index)
            chunk = {**self._head(obj), "choices": [choice], **extra}
            if include_usage:
                chunk["usage"] = None
            yield sse(chunk)
        if include_usage:
            yield sse({**self._head(obj), "choices": [], "usage": self.usage(lasts)})
        yield sse("[DONE]")
