"""Grammar-constrained decoding on the scheduler: compile once per grammar, match per request.

The scheduler owns the grammar state; the worker only applies the packed bitmask the scheduler
puts in ``ReqInput.token_bitmask`` (format: ``services.common.step`` / ``kernels.bitmask``).

Lifecycle of a constrained request (what the scheduler calls, in order):

1. **Before admission** — ``compiled = await service.compile(constraint)``. Compiling runs in a
   worker thread (xgrammar releases the GIL), so the event loop keeps stepping. An invalid schema,
   regex or grammar raises ``InvalidArgument`` here, before the request holds any row or slot.
2. **At admission** — ``req.grammar = compiled.matcher()`` (cheap; one matcher per request).
3. **Each sampling step** — ``ri.token_bitmask = req.grammar.bitmask()`` for the NEXT token.
4. **On each sampled token** — ``req.grammar.accept(tok)`` *before* the next ``bitmask()``. If it
   returns False the mask was not applied (a bug): finish the request with an error, never emit
   the token. If ``is_terminated()`` afterwards, finish with STOP.

Stop tokens: the matcher is built with the model's stop ids (``stop_token_ids``, normally
``WorkerInfo.eos_token_ids``). While the grammar is incomplete they are masked out; once the
accepted text is a complete match they are allowed (alone, if the grammar cannot continue; beside
the continuations otherwise, e.g. regex ``a+``). Accepting one terminates the matcher, and the
scheduler finishes the request with STOP on ``is_terminated()`` — checked independently of the
EOS rule, so ``ignore_eos`` cannot keep a finished grammar running (its mask would allow only
stop tokens forever). Like an unconstrained EOS, the stop token is not detokenized. A request's
own ``stop_token_ids`` still end it when sampled as ordinary text the grammar allows; its output
is then a prefix of a match, as with LENGTH.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from services.common.errors import InvalidArgument
from services.common.json_grammar import JSON_MAX_WHITESPACE, valid_json_strings
from services.scheduler.tool_grammar import tool_calls_ebnf

if TYPE_CHECKING:  # xgrammar loads torch and transformers (~3.5 s on 2 cores): at the first grammar
    import xgrammar as xgr  # (``GrammarService``), not at every scheduler's start
    from transformers import PreTrainedTokenizerBase

ConstraintKind = Literal["json_schema", "regex", "ebnf", "tool_calls"]
COMPILE_THREADS = 2  # grammar compiles at once; more wait in the pool's queue
_KINDS: tuple[ConstraintKind, ...] = ("json_schema", "regex", "ebnf", "tool_calls")

# xgrammar's reasons are one line; a JSON error also echoes the whole schema, which we cut.
_MAX_REASON_CHARS = 400
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(?:Check failed: \(.*?\) is false:\s*)?")


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's output constraint, as the client sent it (``Constraint`` oneof in the proto)."""

    kind: ConstraintKind
    text: str


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters of the compile cache since start."""

    hits: int  # compile() answered from the cache
    joins: int  # compile() joined a compile already in flight for the same grammar
    compiles: int  # grammars compiled successfully (= cache inserts)
    failures: int  # compiles that raised InvalidArgument (not cached)
    evictions: int
    size: int  # grammars in the cache now
    bytes: int  # their approximate memory, as xgrammar reports it
    cancelled: int = 0  # compiles dropped before they started: every caller had left


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """An immutable compiled grammar; shared by every request with the same constraint."""

    constraint: Constraint
    vocab_size: int
    compile_s: float
    _grammar: xgr.CompiledGrammar
    _base: np.ndarray  # [1, ceil(vocab / 32)] int32, read-only: ids a grammar may ever allow

    @property
    def memory_bytes(self) -> int:
        return int(self._grammar.memory_size_bytes)

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar, for one request."""
        return Matcher(self._grammar, self._base)


class Matcher:
    """The grammar state of one request. Not thread-safe: use it from the scheduler loop only.

    Holds the xgrammar matcher and one ``ceil(vocab / 32)`` int32 buffer, nothing else — no
    logits, tensors or batch references — so a finished request frees it entirely.
    """

    __slots__ = ("_accepted", "_base", "_buf", "_matcher", "_vocab_size")

    def __init__(self, grammar: xgr.CompiledGrammar, base: np.ndarray) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(grammar)
        self._base = base  # shared and read-only, one per service
        self._vocab_size = base.shape[1] * 32
        self._buf = np.empty_like(base)
        self._accepted = 0

    @property
    def num_accepted(self) -> int:
        """Tokens accepted and not rolled back (the stop token included)."""
        return self._accepted

    def bitmask(self) -> bytes:
        """The packed mask of tokens allowed NEXT: ``ceil(vocab / 32) * 4`` bytes.

        Little-endian int32 words; bit ``i`` of word ``w`` set = token ``32 * w + i`` allowed.
        Ids at or above the tokenizer's size (model padding) and special tokens other than the
        stop tokens are never allowed. Does not change the matcher state.

        The mask is filled into this matcher's one preallocated buffer and returned as an
        immutable copy: the buffer is refilled on the next call while the previous step's request
        may still be queued or serialising (overlap scheduling), and ``bytes`` holds no reference
        to the buffer, so nothing downstream keeps mask memory alive or sees it change.

        Raises:
            RuntimeError: if the matcher is terminated (the request should have finished).
        """
        if self._matcher.is_terminated():
            raise RuntimeError("bitmask() of a terminated matcher: the request should have finished")
        self._matcher.fill_next_token_bitmask(self._buf)
        # xgrammar stores large allowed sets as "all but the rejected", which leaves the bits of
        # padding ids, of ids past the vocabulary and of the tokenizer's special tokens set.
        np.bitwise_and(self._buf, self._base, out=self._buf)
        return self._buf.astype("<i4", copy=False).tobytes()

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (state unchanged) if the grammar does not allow it.

        False cannot happen for a token sampled under this matcher's latest ``bitmask()``; it
        means the mask was not applied or the wrong token was reported. The caller then finishes
        the request with an error and does not emit the token: the output can no longer be made
        to match, and silently continuing would return invalid text.
        """
        if not 0 <= token_id < self._vocab_size or not _bit(self._base, token_id):
            return False
        ok = bool(self._matcher.accept_token(token_id))
        if ok:
            self._accepted += 1
        return ok

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete match: the request ends (STOP)."""
        return bool(self._matcher.is_terminated())

    def is_completed(self) -> bool:
        """True when the text accepted so far is a complete match (a stop token is now allowed)."""
        return bool(self._matcher.is_completed())

    def accepted_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar takes in a row (draft tokens to verify), up to
        the first it rejects and short of one that would end it: a token after which nothing can
        be sampled has no next mask. The state is unchanged."""
        n = 0
        for tok in tokens:
            if not self.accept(tok):
                break
            if self.is_terminated():
                self.rollback(1)
                break
            n += 1
        self.rollback(n)
        return n

    def bitmasks(self, tokens: Sequence[int]) -> bytes:
        """The masks of the next token and of the token after each of ``tokens``, concatenated
        (``1 + len(tokens)`` masks, each as ``bitmask()``): what the worker samples under at each
        position of a verify pass. The state is unchanged.

        Raises:
            ValueError: if the grammar does not take ``tokens`` (check with ``accepted_prefix``).
        """
        masks = [self.bitmask()]
        taken = 0
        try:
            for tok in tokens:
                if not self.accept(tok):
                    raise ValueError(f"bitmasks: the grammar rejects token {tok} at offset {taken}")
                taken += 1
                masks.append(self.bitmask())  # raises RuntimeError if the token ended the grammar
        finally:
            self.rollback(taken)
        return b"".join(masks)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (speculative positions that were rejected).

        Raises:
            ValueError: if ``n`` is negative or more than ``num_accepted``.
        """
        if not 0 <= n <= self._accepted:
            raise ValueError(f"rollback({n}): only {self._accepted} accepted tokens can be undone")
        if n:
            self._matcher.rollback(n)
            self._accepted -= n


class GrammarService:
    """Compiles constraints for one tokenizer and model vocabulary, with a bounded LRU cache.

    The cache holds at most ``cache_size`` compiled grammars, keyed by ``(kind, text)`` exactly
    (two schemas that differ only in whitespace are two entries). It is bounded by count, not
    bytes: a compiled grammar is typically tens of KB to a few MB (``CacheStats.bytes`` reports
    the sum), and a count is what an operator can reason about. Failed compiles are not cached.
    xgrammar's own (unbounded) cache is disabled so memory stays flat under distinct schemas.

    ``compile`` is called from the event loop only (the cache and in-flight table are not
    locked); the compile itself runs in a thread, and concurrent calls for the same grammar
    share one compile.

    Building the service decodes the whole vocabulary once (tens of ms for a 150k vocabulary,
    more with a slow tokenizer): construct it at start-up, not per request.
    """

    def __init__(
        self,
        tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase,
        vocab_size: int,
        *,
        stop_token_ids: Sequence[int] | None = None,
        cache_size: int = 64,
        threads: int = 1,
    ) -> None:
        """
        Args:
            tokenizer: a Hugging Face tokenizer, or the directory it loads from.
            vocab_size: the model's ``config.vocab_size`` (the logits' width, the mask's size);
                may exceed the tokenizer's size, whose extra ids are never allowed.
            stop_token_ids: ids that end a complete match (the model's EOS ids); default: the
                tokenizer's ``eos_token_id``.
            cache_size: compiled grammars kept (LRU), at least 1.
            threads: xgrammar threads per compile, at least 1.

        Raises:
            ValueError: on a non-positive size, or a stop id outside ``[0, vocab_size)``.
        """
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        stops = None if stop_token_ids is None else sorted(set(stop_token_ids))
        if stops is not None and (not stops or stops[0] < 0 or stops[-1] >= vocab_size):
            raise ValueError(f"stop_token_ids must be non-empty ids in [0, {vocab_size}), got {stops}")
        import xgrammar as xgr
        from transformers import AutoTokenizer, PreTrainedTokenizerBase

        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        self.vocab_size = vocab_size
        self.stop_token_ids: tuple[int, ...] = tuple(info.stop_token_ids)
        self._base = _base_mask(tokenizer, vocab_size, self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._cache_size = cache_size
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._inflight: dict[Constraint, asyncio.Task[CompiledGrammar]] = {}
        # Compiles run in this pool; one still queued when its last waiter leaves never starts.
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="grammar")
        self._jobs: dict[Constraint, Future[CompiledGrammar]] = {}
        self._waiting: dict[Constraint, int] = {}
        self._hits = self._joins = self._compiles = self._failures = self._evictions = self._cancelled = 0

    async def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of ``constraint``, from the cache or compiled in a thread.

        Cancelling the caller does not cancel a compile others share, nor one already running
        (its result is cached); a compile still queued when its last caller leaves never runs.

        Raises:
            InvalidArgument: ``constraint.<kind>: <reason>`` for an unknown kind or a schema,
                regex or grammar that does not compile.
        """
        if constraint.kind not in _KINDS:
            raise InvalidArgument(f"constraint: unknown kind {constraint.kind!r}; expected one of {_KINDS}")
        hit = self._cache.get(constraint)
        if hit is not None:
            self._cache.move_to_end(constraint)
            self._hits += 1
            return hit
        task = self._inflight.get(constraint)
        if task is None:
            task = asyncio.create_task(self._compile_and_cache(constraint))
            task.add_done_callback(_retrieve_exception)
            self._inflight[constraint] = task
        else:
            self._joins += 1
        self._waiting[constraint] = self._waiting.get(constraint, 0) + 1
        try:
            return await asyncio.shield(task)
        finally:
            self._waiting[constraint] -= 1
            if not self._waiting[constraint]:
                del self._waiting[constraint]
                job = self._jobs.get(constraint)
                if not task.done() and job is not None and job.cancel():  # queued, nobody waits
                    self._cancelled += 1
                    task.cancel()

    def compile_blocking(self, constraint: Constraint) -> CompiledGrammar:
        """Compile on the calling thread, bypassing the cache (tools and tests)."""
        if constraint.kind not in _KINDS:
            raise InvalidArgument(f"constraint: unknown kind {constraint.kind!r}; expected one of {_KINDS}")
        return self._compile(constraint)

    def stats(self) -> CacheStats:
        return CacheStats(
            hits=self._hits,
            joins=self._joins,
            compiles=self._compiles,
            failures=self._failures,
            evictions=self._evictions,
            size=len(self._cache),
            bytes=sum(g.memory_bytes for g in self._cache.values()),
            cancelled=self._cancelled,
        )

    async def _compile_and_cache(self, constraint: Constraint) -> CompiledGrammar:
        try:
            job = self._pool.submit(self._compile, constraint)
            self._jobs[constraint] = job
            compiled = await asyncio.wrap_future(job)
        except InvalidArgument:
            self._failures += 1
            raise
        finally:
            self._inflight.pop(constraint, None)
            self._jobs.pop(constraint, None)
        self._compiles += 1
        self._cache[constraint] = compiled
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
            self._evictions += 1
        return compiled

    def _compile(self, c: Constraint) -> CompiledGrammar:
        field = f"constraint.{c.kind}"
        t0 = time.perf_counter()
        try:
            if c.kind == "json_schema":
                try:
                    json.loads(c.text)
                except ValueError as e:
                    raise InvalidArgument(f"{field}: not valid JSON: {e}") from None
                grammar = self._compiler.compile_grammar(_json_schema_ebnf(c.text))
            elif c.kind == "regex":
                grammar = self._compiler.compile_regex(c.text)
            elif c.kind == "tool_calls":  # text: tool_grammar.tool_calls_key
                grammar = self._compiler.compile_grammar(tool_calls_ebnf(c.text))
            else:
                grammar = self._compiler.compile_grammar(c.text)
        except (RuntimeError, ValueError) as e:
            if isinstance(e, InvalidArgument):
                raise
            raise InvalidArgument(f"{field}: {_reason(e)}") from None
        return CompiledGrammar(c, self.vocab_size, time.perf_counter() - t0, grammar, self._base)


def _base_mask(tokenizer: PreTrainedTokenizerBase, vocab_size: int, stops: Sequence[int]) -> np.ndarray:
    """The ids any grammar may allow: the tokenizer's ids below ``vocab_size``, except special
    (control) tokens that are not stop tokens; padding ids and bits past the vocabulary are clear.
    """
    allowed = np.zeros(math.ceil(vocab_size / 32) * 32, dtype=bool)
    allowed[: min(len(tokenizer), vocab_size)] = True
    special = [i for i, t in tokenizer.added_tokens_decoder.items() if t.special and i < vocab_size]
    allowed[special] = False
    allowed[list(stops)] = True
    words = np.packbits(allowed, bitorder="little").view("<i4").astype(np.int32).reshape(1, -1)
    words.flags.writeable = False
    return words


def _bit(words: np.ndarray, token_id: int) -> bool:
    return bool((int(words[0, token_id >> 5]) >> (token_id & 31)) & 1)


def _json_schema_ebnf(schema: str) -> str:
    """The EBNF of ``schema`` (any whitespace, at most ``JSON_MAX_WHITESPACE`` per gap; strict:
    no properties or items beyond the schema), with length-bounded strings made valid JSON."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(
        schema, any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE, strict_mode=True
    )
    return valid_json_strings(str(grammar))


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its log prefix, its schema echo, and trailing lines."""
    text = _LOG_PREFIX.sub("", str(exc).strip())
    text = text.split(" The JSON string is:", 1)[0].strip()
    text = " ".join(text.split())
    if len(text) > _MAX_REASON_CHARS:
        text = text[: _MAX_REASON_CHARS - 3] + "..."
    return text or type(exc).__name__


def _retrieve_exception(task: asyncio.Task[CompiledGrammar]) -> None:
    # Every caller may have been cancelled; mark the error seen so asyncio does not log it.
    if not task.cancelled():
        task.exception()
