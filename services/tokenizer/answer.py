"""What one generation request has produced so far, across every replica it ran on.

``StrataServicer.generate`` routes a request and follows it through resumes and hand-overs; an
``Answer`` turns the scheduler's chunks into the public responses: the detokenized text and stop
strings, the scored prompt, usage, the tokens a continuation starts from, and, for a request that
is not streamed, the one whole response at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.session import Chunk
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.v1 import strata_pb2 as pb


@dataclass(slots=True)
class Answer:
    rid: str
    stream: bool
    prompt_len: int
    detok: IncrementalDetokenizer
    on_tokens: Callable[[int, float], None] | None = None  # (tokens, seconds since the previous ones)
    t0: float = field(default_factory=time.perf_counter)
    first: float | None = None  # when the first token arrived
    previous: float = 0.0  # when the latest tokens arrived
    streamed: list[int] = field(default_factory=list)  # every output token: what a continuation starts from
    cached: int | None = None  # cached prompt tokens where the request started, once it was continued
    progressed: bool = False  # tokens came from the current scheduler (a lost one is resumed from them)
    scored: pb.PromptLogprobs | None = None  # the scored prompt (prompt_logprobs)
    # a request that is not streamed: everything so far, for the one response at the end
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)

    def take(self, chunk: Chunk, end: spb.RequestEnd | None, cached_now: int) -> pb.GenerateResponse:
        """The response for ``chunk``: its tokens and their text (a stop string ends it there);
        with ``end`` (an end that is not a failure or a hand-over), the rest of the text, the
        finish reason and usage. ``cached_now``: the current scheduler's cached prompt tokens."""
        final = pb.GenerateResponse(request_id=self.rid)
        self.progressed = self.progressed or bool(chunk.token_ids)
        if chunk.prompt is not None:
            self.scored = chunk.prompt
            if self.stream:
                final.prompt_logprobs.CopyFrom(chunk.prompt)
        if chunk.token_ids:
            now = time.perf_counter()
            if self.first is not None and self.on_tokens is not None:
                self.on_tokens(len(chunk.token_ids), now - self.previous)
            self.first, self.previous = self.first or now, now
            out = self.detok.feed(chunk.token_ids)
            final.token_ids.extend(chunk.token_ids)
            final.logprobs.extend(chunk.logprobs)
            final.text = out.text
            self.streamed += chunk.token_ids
            if out.stopped:  # a stop string: end here; closing the inbox frees the scheduler's slots
                final.finish_reason = pb.FINISH_REASON_STOP
                final.usage.CopyFrom(pb.Usage(
                    prompt_tokens=self.prompt_len, completion_tokens=len(self.streamed),
                    cached_tokens=cached_now if self.cached is None else self.cached,
                ))  # fmt: skip
        if end is not None and not self.detok.stopped:
            final.text += self.detok.flush().text
            final.finish_reason = end.finish_reason
            final.usage.CopyFrom(end.usage)
            if self.cached is not None:  # the continuation's replica counted its own hit
                final.usage.cached_tokens = self.cached
            final.error = end.error
        return final

    def keep(self, final: pb.GenerateResponse) -> None:
        """Add a response to the whole answer (a request that is not streamed)."""
        self.ids += final.token_ids
        self.text.append(final.text)
        self.logprobs += final.logprobs

    def whole(self, final: pb.GenerateResponse) -> pb.GenerateResponse:
        """The one response of a request that is not streamed, once ``final`` ended it."""
        return pb.GenerateResponse(
            request_id=self.rid, token_ids=self.ids, text="".join(self.text), logprobs=self.logprobs,
            finish_reason=final.finish_reason, usage=final.usage, error=final.error, prompt_logprobs=self.scored,
        )  # fmt: skip
