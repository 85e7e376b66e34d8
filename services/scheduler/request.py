"""A request as the scheduler sees it, and the events it streams back to the servicer."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.step import TokenLogprob
from services.common.validation import Generation
from services.scheduler.memory.request_memory import Fork, RequestMemory

__all__ = ["Event", "FailEvent", "Finish", "FinishEvent", "Fork", "PromptEvent", "Req", "TokenEvent"]


class Finish(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    # A prefill-role scheduler's end after the first token: the prompt's pages are in the kvstore
    # and the client goes on with a decode replica (prefill/decode disaggregation).
    HANDOFF = "handoff"


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Tokens sampled for a request since its previous event."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptEvent:
    """The scored prompt (``Generation.prompt_logprobs``), once every position is: before the
    request's first ``TokenEvent`` (or its end, when it generates nothing). ``logprobs[j]`` and
    ``ranks[j]`` are prompt token ``j + 1``'s."""

    first_token_id: int
    logprobs: tuple[TokenLogprob, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FinishEvent:
    reason: Finish
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str = ""


@dataclass(frozen=True, slots=True)
class FailEvent:
    """The request cannot run (its worker is gone and none came back in time): the servicer ends
    the call with ``error``'s status instead of a finish reason."""

    error: Exception


Event = TokenEvent | PromptEvent | FinishEvent | FailEvent


@dataclass(eq=False, slots=True)
class Req:
    """One generation request. ``mem`` is what it holds of the worker's memory (``Memory``'s to
    write): ``mem.slots[i]`` holds the KV of token ``i`` of ``seq`` (prompt + output), so
    ``len(mem.slots)`` tokens are computed."""

    rid: str
    prompt: list[int]
    gen: Generation
    seed: int
    cache_salt: str = ""
    trace_context: dict[str, str] = field(default_factory=dict)
    arrived: float = field(default_factory=time.monotonic)  # when submitted (queue-time metric)
    grammar: Any = None  # a compiled matcher (grammar issue); None = unconstrained
    output: list[int] = field(default_factory=list)
    mem: RequestMemory = field(default_factory=RequestMemory)
    cached_tokens: int = 0  # prompt tokens reused on first admission (reported as usage)
    handoff: bool = False  # a prefill-role scheduler ends this request after its first token (Finish.HANDOFF)
    first_admission: bool = True
    sent_history: bool = False
    aborted: bool = False
    finished: Finish | None = None
    retractions: int = 0
    # Samples planned in steps whose results have not come back (overlap scheduling): the next
    # decode input is then the worker's last sample for this row, not a known id.
    inflight: int = 0
    # Speculative decoding: drafts kept per verify step (running mean), and the back-off after
    # failed tries (decodes to wait before the next, and the current back-off length).
    spec_score: float = 1.0
    spec_wait: int = 0
    spec_backoff: int = 0
    # Prompt scoring (``gen.prompt_logprobs``): entry j scores prompt token j + 1, gathered chunk by
    # chunk from the steps' results; ``prompt_sent`` once the PromptEvent went out.
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    prompt_sent: bool = False
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    # Where events go instead of ``events``: a session's collector (``services.scheduler.session``),
    # which sends a whole step's events for all its requests as one message.
    sink: Callable[[Event], None] | None = None

    @property
    def seq(self) -> list[int]:
        """Known tokens: prompt + output. ``inflight`` more are sampled but not yet known."""
        return self.prompt + self.output

    @property
    def seq_len(self) -> int:
        """``len(seq)`` without building ``seq`` (per step, per request: a copy of the whole context)."""
        return len(self.prompt) + len(self.output)

    def tokens(self, start: int, n: int) -> list[int]:
        """``seq[start:start + n]`` without building ``seq``."""
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p : start - p + n]
        if start + n <= p:
            return self.prompt[start : start + n]
        return self.prompt[start:] + self.output[: start + n - p]

    @property
    def scoring(self) -> bool:
        """Prompt positions are still to be scored (their logits are computed, never cached)."""
        return self.gen.prompt_logprobs is not None and not self.prompt_sent

    @property
    def matchable(self) -> int:
        """Tokens of ``seq`` a prefix-cache hit may cover: all but the last, whose logits are
        needed; while the prompt is being scored, only the positions already scored (a cached
        prefix keeps KV, not the logits its positions would need)."""
        n = self.seq_len - 1
        return min(n, len(self.prompt_scores)) if self.scoring else n

    @property
    def computed(self) -> int:
        return len(self.mem.slots)

    @property
    def remaining_prefill(self) -> int:
        """Tokens without KV, counting the ``inflight`` ones not yet known (overlap)."""
        return len(self.prompt) + len(self.output) + self.inflight - self.computed

    def emit(self, event: Event) -> None:
        if self.sink is not None:
            self.sink(event)
        else:
            self.events.put_nowait(event)

    def emit_abort(self) -> None:
        self.finished = Finish.ABORT
        self.emit(FinishEvent(Finish.ABORT, len(self.prompt), len(self.output), self.cached_tokens))
