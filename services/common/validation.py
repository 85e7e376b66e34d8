"""Validation of public request fields, shared by the tokenizer (the public boundary) and the
scheduler (which checks again against its worker's real limits).

Every failure raises ``InvalidArgument`` whose message names the field, e.g.
``sampling.top_p: must be in (0, 1], got 1.5``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.common.step import MAX_TOP_LOGPROBS, SamplingParams
from strata.v1 import strata_pb2 as pb

DEFAULT_MAX_NEW_TOKENS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID_CHARS = 128
MAX_SALT_CHARS = 256
# Text is refused before tokenization when it could not fit the context even at this many
# characters per token (real tokenizers average about 4; long whitespace or digit runs more).
MAX_CHARS_PER_TOKEN = 32
MAX_GRAMMAR_CHARS = 1 << 20  # a JSON schema, regex or EBNF


@dataclass(frozen=True, slots=True)
class Limits:
    """What the served model allows."""

    vocab_size: int
    context_length: int


@dataclass(frozen=True, slots=True)
class Generation:
    """A validated generation request's parameters (everything but the prompt)."""

    sampling: SamplingParams
    max_new_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    seed: int | None
    return_logprobs: bool
    top_logprobs: int
    # Alternatives per scored prompt position (GenerateRequest.prompt_logprobs); None: no scoring.
    prompt_logprobs: int | None = None


def _finite(name: str, v: float) -> float:
    if math.isnan(v) or math.isinf(v):
        raise InvalidArgument(f"{name}: must be a finite number, got {v}")
    return v


def _in_range(name: str, v: float, lo: float, hi: float, lo_open: bool = False) -> float:
    _finite(name, v)
    if (v <= lo if lo_open else v < lo) or v > hi:
        lo_b = "(" if lo_open else "["
        raise InvalidArgument(f"{name}: must be in {lo_b}{lo}, {hi}], got {v}")
    return v


def check_ids(name: str, ids: list[int], limits: Limits) -> None:
    """Non-empty, every id below the vocabulary size."""
    if not ids:
        raise InvalidArgument(f"{name}: at least one token id is required")
    bad = [i for i in ids if i >= limits.vocab_size]
    if bad:
        raise InvalidArgument(
            f"{name}: token id {bad[0]} is out of range; "
            f"ids must be below the vocabulary size {limits.vocab_size}"
        )


def check_text(name: str, chars: int, limits: Limits) -> None:
    """Refuse text too long for the context before spending any time tokenizing it."""
    most = limits.context_length * MAX_CHARS_PER_TOKEN
    if chars > most:
        raise InvalidArgument(
            f"{name}: {chars} characters; at most {most} (context length {limits.context_length} "
            f"tokens x {MAX_CHARS_PER_TOKEN} characters)"
        )


def check_grammar(name: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidArgument(f"{name}: {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")


def check_request_id(rid: str) -> None:
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}")


def check_cache_salt(salt: str) -> None:
    if len(salt) > MAX_SALT_CHARS:
        raise InvalidArgument(f"cache_salt: at most {MAX_SALT_CHARS} characters, got {len(salt)}")


def generation(
    s: pb.SamplingParams, prompt_len: int, limits: Limits, return_logprobs: bool, top_logprobs: int,
    prompt_logprobs: int | None = None,
) -> Generation:
    """Validate and default ``s`` for a prompt of ``prompt_len`` tokens. ``prompt_logprobs``: score
    the prompt with that many alternatives per position (None: no scoring); only then may
    ``max_new_tokens`` be 0 (the prompt scored alone)."""
    temperature = s.temperature if s.HasField("temperature") else 1.0
    _finite("sampling.temperature", temperature)
    if temperature < 0:
        raise InvalidArgument(f"sampling.temperature: must be >= 0 (0 = greedy), got {temperature}")
    top_p = _in_range("sampling.top_p", s.top_p, 0.0, 1.0, lo_open=True) if s.HasField("top_p") else 1.0
    if s.top_k < -1:
        raise InvalidArgument(f"sampling.top_k: must be -1 or 0 (off) or >= 1, got {s.top_k}")
    top_k = max(s.top_k, 0)
    min_p = _in_range("sampling.min_p", s.min_p, 0.0, 1.0)
    rep = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
    _in_range("sampling.repetition_penalty", rep, 0.0, 2.0, lo_open=True)
    freq = _in_range("sampling.frequency_penalty", s.frequency_penalty, -2.0, 2.0)
    pres = _in_range("sampling.presence_penalty", s.presence_penalty, -2.0, 2.0)

    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"prompt_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {prompt_logprobs}")
    scoring_only = prompt_logprobs is not None and s.HasField("max_new_tokens") and s.max_new_tokens == 0
    room = limits.context_length - prompt_len
    if room < 1 and not (scoring_only and room == 0):
        raise InvalidArgument(
            f"input: the prompt has {prompt_len} tokens; the context length is {limits.context_length}, "
            "which leaves no room to generate"
        )
    if s.HasField("max_new_tokens"):
        max_new = s.max_new_tokens
        if max_new < 1 and not scoring_only:
            raise InvalidArgument(
                "sampling.max_new_tokens: must be >= 1 (0 only with prompt_logprobs: the prompt scored alone)"
            )
        if max_new > room:
            raise InvalidArgument(
                f"sampling.max_new_tokens: {max_new} exceeds the room left in the context: prompt "
                f"{prompt_len} + {max_new} > context length {limits.context_length}"
            )
    else:
        max_new = min(DEFAULT_MAX_NEW_TOKENS, room)

    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"sampling.stop: at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    for i, st in enumerate(s.stop):
        if not 1 <= len(st) <= MAX_STOP_CHARS:
            raise InvalidArgument(f"sampling.stop[{i}]: must have 1..{MAX_STOP_CHARS} characters")
    bad = [t for t in s.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise InvalidArgument(
            f"sampling.stop_token_ids: {bad[0]} is out of range; ids must be below {limits.vocab_size}"
        )
    if top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs: at most {MAX_TOP_LOGPROBS}, got {top_logprobs}")
    params = SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        min_p=float(min_p),
        repetition_penalty=float(rep),
        frequency_penalty=float(freq),
        presence_penalty=float(pres),
    )
    return Generation(
        sampling=params,
        max_new_tokens=int(max_new),
        stop=tuple(s.stop),
        stop_token_ids=frozenset(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        seed=s.seed if s.HasField("seed") else None,
        return_logprobs=return_logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
    )
