"""A benchmark ``Backend`` for any OpenAI-compatible server, through the official ``openai`` client.

Each request is one streamed ``POST /v1/completions``: greedy (``temperature=0``), ``max_tokens``,
``stream_options.include_usage``, plus ``extra_body`` — whatever makes that server ignore eos
(``{"ignore_eos": true}`` for Strata and vLLM-style servers, a ``generation_config`` for
``transformers serve``, which refuses unknown fields).

Client CPU is server CPU on a small machine, so the client stays light: the SSE lines of
``with_streaming_response`` are parsed here (one JSON object per ``data:`` line) instead of
building the SDK's pydantic model per chunk, and token ids go in ``extra_body`` (which overrides
the typed field) because ``create()`` type-checks every element of a list prompt — ~17 ms of CPU
for 544 ids. Together they took the client from ~1.0 to ~0.35 s of CPU per 64-request run (the
gRPC client: ~0.25 s).

Prompts: the workload's ids are sent as ids, or — for a server that takes text only — as
``decode(ids)``. The server re-tokenizes that text, and its count differs from the ids' (random
ids re-tokenize to ~10 % more tokens with the bench tokenizer), so a record's ``prompt_tokens`` is
always the server's ``usage.prompt_tokens``.

Output tokens: counted from ``usage.completion_tokens`` of the final chunk, never from chunks —
a server holds back a token that ends inside a UTF-8 character and may coalesce several tokens
into one chunk. When the chunks with text are fewer than the tokens, the first chunk counts one
token (TTFT is the first text a client sees) and the rest are spread evenly over the later chunks
(``spread``): the mean ITL stays exact, its median and p99 become estimates; ``respread`` counts
the requests this happened to.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx2
import openai

from services.bench.metrics import RequestRecord
from services.bench.runner import BackendError

KEEPALIVE_S = 2.0  # below the servers' keep-alive timeout (uvicorn: 5 s)


def spread(times: list[float], tokens: int) -> list[tuple[float, int]]:
    """``(time, tokens)`` per chunk for ``tokens`` tokens that arrived in chunks at ``times``:
    one token in the first chunk, the others spread evenly over the later ones (any remainder on
    the last chunks). With as many chunks as tokens, one token each."""
    if not times or tokens <= 0:
        return []
    if tokens <= len(times):
        return [(t, 1) for t in times[:tokens]]
    if len(times) == 1:
        return [(times[0], tokens)]
    later = len(times) - 1
    base, extra = divmod(tokens - 1, later)
    return [(times[0], 1)] + [(t, base + (i >= later - extra)) for i, t in enumerate(times[1:])]


def sse_event(line: str) -> dict[str, Any] | None:
    """The JSON object of one SSE ``data:`` line; None for any other line and for ``[DONE]``.
    An error event (a server failing mid-stream) raises ``BackendError``."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    try:
        event = json.loads(data)
    except ValueError as e:
        raise BackendError(f"not JSON in the event stream: {data[:200]!r}") from e
    if not isinstance(event, dict):
        raise BackendError(f"unexpected event in the stream: {data[:200]!r}")
    if event.get("error"):
        raise BackendError(f"server error mid-stream: {event['error']}")
    return event


class OpenAIBackend:
    """Streams ``/v1/completions`` from ``base_url`` (``http://host:port/v1``) for model ``model``.

    ``decode`` turns prompt ids into text (None: send the ids). ``extra_body`` is merged into every
    body. Counters for the report: ``requests`` answered, ``respread`` (chunks fewer than tokens),
    ``short`` (fewer tokens than asked: the server stopped early), ``prompt_ratio`` (Σ server prompt
    tokens / Σ workload prompt ids), ``reports_cache`` (usage carried ``cached_tokens``)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        label: str,
        *,
        decode: Callable[[list[int]], str] | None = None,
        extra_body: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.label = label
        self.model = model
        self._decode = decode
        self._extra = dict(extra_body or {})
        # No retries: a retried request would be timed as one slow request. Idle connections are
        # dropped before uvicorn's 5 s keep-alive timeout closes them from the server's side: with
        # equal timeouts a run that starts ~5 s after the last one (the other side's run) races the
        # server's close and loses requests ("Connection error").
        limits = httpx2.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=KEEPALIVE_S)
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key="none", max_retries=0, timeout=timeout_s,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=timeout_s),
        )  # fmt: skip
        self.reset()

    def reset(self) -> None:
        """Zero the counters (after a warm-up)."""
        self.requests = 0
        self.respread = 0
        self.short = 0
        self.reports_cache = False
        self._ids_sent = 0
        self._ids_counted = 0

    @property
    def prompt_ratio(self) -> float:
        return self._ids_counted / self._ids_sent if self._ids_sent else 1.0

    async def generate(self, prompt: list[int], max_new_tokens: int, rec: RequestRecord) -> list[int]:
        """One greedy streamed completion. Returns ``[]``: the server sends text, not ids, so a
        multi-turn workload (whose next prompt needs the answer's ids) cannot run on this backend."""
        if self._decode is not None:
            text, extra = self._decode(prompt), self._extra
        else:
            text, extra = "", {**self._extra, "prompt": prompt}
        times: list[float] = []
        usage: dict[str, Any] | None = None
        try:
            async with self._client.completions.with_streaming_response.create(
                model=self.model,
                prompt=text,
                max_tokens=max_new_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            ) as response:
                async for line in response.iter_lines():
                    event = sse_event(line)
                    if event is None:
                        continue
                    choices = event.get("choices") or ()
                    if choices and choices[0].get("text"):
                        now = time.perf_counter()
                        if rec.first_token is None:
                            rec.first_token = now
                        times.append(now)
                    if event.get("usage"):
                        usage = event["usage"]
        except (openai.OpenAIError, httpx2.HTTPError) as e:
            raise BackendError(f"{type(e).__name__}: {e}") from e
        if usage is None:
            raise BackendError("the stream ended without usage (stream_options.include_usage ignored?)")
        self._count(prompt, max_new_tokens, usage, times, rec)
        return []

    def _count(
        self, prompt: list[int], max_new_tokens: int, usage: dict[str, Any], times: list[float], rec: RequestRecord
    ) -> None:
        n = int(usage["completion_tokens"])
        prompt_tokens = int(usage["prompt_tokens"])
        self.requests += 1
        self.respread += len(times) < n
        self.short += n < max_new_tokens
        self._ids_sent += len(prompt)
        self._ids_counted += prompt_tokens
        rec.prompt_tokens = prompt_tokens
        rec.chunks = spread(times, n)
        rec.output_tokens = n
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            self.reports_cache = True
            rec.cached_tokens = int(cached)

    def describe(self) -> str:
        """One line of counters for the report."""
        return (
            f"{self.label}: {self.requests} requests, {self.respread} with fewer text chunks than tokens "
            f"(ITL spread), {self.short} stopped short, server prompt tokens / workload ids {self.prompt_ratio:.3f}"
        )

    async def close(self) -> None:
        await self._client.close()
