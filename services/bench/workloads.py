"""Seeded benchmark workloads: the same arguments always give the same token ids.

Every workload is a list of *conversations*; a conversation is a list of turns run one after the
other by one client. Single-turn workloads (``random``, ``shared_prefix``) have one turn per
conversation. A turn's prompt is built at run time by ``Turn.prompt_for(history)``:

* turn 0: ``prefix + question``;
* turn k > 0 (``multi_turn``, ``agent``): ``history + question``, where ``history`` is the previous
  turn's prompt followed by its answer (known only once the previous turn has finished; empty
  when the backend returns text, not ids, as the OpenAI HTTP backend does).

``Turn.reusable`` is what an ideal prefix cache of unbounded size could serve of the turn's prompt;
it is the denominator of the "reuse vs ideal" ratio (see ``ideal_reuse``).

Token ids are drawn from ``[FIRST_ID, vocab_size)`` so that special tokens (which the tiny
checkpoints put first) never appear; generation uses greedy + ``ignore_eos`` so that output
lengths are exact.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

# The tiny checkpoints' special tokens are ids 0..2; everything from here is ordinary text.
FIRST_ID = 3

WorkloadKind = Literal["random", "shared_prefix", "multi_turn", "agent"]


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a conversation.

    ``prefix`` is shared with other conversations (a system prompt), ``question`` is this turn's
    own text; ``shared_prefix_reusable`` is True when an earlier conversation already sent the same
    ``prefix`` (so an ideal cache serves it).
    """

    prefix: tuple[int, ...]
    question: tuple[int, ...]
    max_new_tokens: int
    shared_prefix_reusable: bool = False

    def prompt_for(self, history: list[int]) -> list[int]:
        """The prompt of this turn given the conversation so far (empty on turn 0)."""
        return [*history, *self.question] if history else [*self.prefix, *self.question]

    def ideal_reuse(self, history: list[int]) -> int:
        """Prompt tokens an ideal unbounded cache would reuse.

        Turn k > 0 reuses the whole history but its very last token: the last sampled answer token
        was never fed to the model, so it has no KV.
        """
        if history:
            return len(history) - 1
        return len(self.prefix) if self.shared_prefix_reusable else 0


@dataclass(frozen=True, slots=True)
class Workload:
    """Conversations to replay; ``request_rate`` in requests/s (``inf`` = all at once),
    ``max_parallel`` bounds conversations in flight (0 = only the driver's concurrency)."""

    kind: WorkloadKind
    name: str
    conversations: tuple[tuple[Turn, ...], ...]
    request_rate: float = math.inf
    max_parallel: int = 0
    seed: int = 0

    @property
    def num_requests(self) -> int:
        return sum(len(c) for c in self.conversations)

    def describe(self) -> str:
        return f"{self.name}: {len(self.conversations)} conversations, {self.num_requests} requests"


@dataclass(frozen=True, slots=True)
class RandomSpec:
    """No reuse: ``count`` prompts of independent random ids (lengths uniform in
    ``[range_ratio * input_len, input_len]``)."""

    count: int = 64
    input_len: int = 256
    output_len: int = 32
    range_ratio: float = 1.0


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    """``groups`` system prompts of ``system_len`` ids, each followed by ``prompts_per_group``
    distinct questions of ``question_len`` ids; the prompts of all groups are interleaved."""

    groups: int = 4
    prompts_per_group: int = 16
    system_len: int = 512
    question_len: int = 32
    output_len: int = 32


@dataclass(frozen=True, slots=True)
class MultiTurnSpec:
    """``clients`` conversations of ``rounds`` turns; each turn adds ``request_len`` new ids."""

    clients: int = 8
    rounds: int = 4
    request_len: int = 64
    output_len: int = 32
    request_rate: float = math.inf
    max_parallel: int = 8


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """``conversations`` agents, each on its own ``context_len``-id context (instructions, tools,
    files), running ``turns`` turns; each turn appends ``turn_len`` new ids (a tool result or a
    user message) to the conversation so far and asks for ``output_len`` tokens."""

    conversations: int = 2
    turns: int = 8
    context_len: int = 2048
    turn_len: int = 128
    output_len: int = 32


def _ids(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ID, vocab_size) for _ in range(n))


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= FIRST_ID + 1:
        raise ValueError(f"vocab_size must be > {FIRST_ID + 1}, got {vocab_size}")


def random_workload(spec: RandomSpec, vocab_size: int, seed: int = 0) -> Workload:
    _check_vocab(vocab_size)
    if not 0.0 < spec.range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in (0, 1], got {spec.range_ratio}")
    # The shape is in the key: two random workloads of one seed must not share prompt prefixes
    # (a 512-token prompt whose first 256 tokens were a 256-token workload's first prompt, run
    # earlier on the same server, was a cache hit where a cold prompt was meant).
    rng = random.Random(f"random/{spec.input_len}/{spec.count}/{spec.range_ratio}/{seed}")
    lo = max(1, int(spec.input_len * spec.range_ratio))
    convs = tuple(
        (Turn((), _ids(rng, rng.randint(lo, spec.input_len), vocab_size), spec.output_len),) for _ in range(spec.count)
    )
    name = f"random in={spec.input_len} out={spec.output_len} n={spec.count}"
    return Workload("random", name, convs, seed=seed)


def shared_prefix_workload(spec: SharedPrefixSpec, vocab_size: int, seed: int = 0) -> Workload:
    _check_vocab(vocab_size)
    rng = random.Random(f"shared_prefix/{seed}")
    systems = [_ids(rng, spec.system_len, vocab_size) for _ in range(spec.groups)]
    convs = []
    for i in range(spec.prompts_per_group):  # interleaved: group 0, 1, ..., 0, 1, ...
        for g in range(spec.groups):
            q = _ids(rng, spec.question_len, vocab_size)
            convs.append((Turn(systems[g], q, spec.output_len, shared_prefix_reusable=i > 0),))
    name = (
        f"shared_prefix groups={spec.groups}x{spec.prompts_per_group} system={spec.system_len} "
        f"q={spec.question_len} out={spec.output_len}"
    )
    return Workload("shared_prefix", name, tuple(convs), seed=seed)


def multi_turn_workload(spec: MultiTurnSpec, vocab_size: int, seed: int = 0) -> Workload:
    _check_vocab(vocab_size)
    rng = random.Random(f"multi_turn/{seed}")
    convs = tuple(
        tuple(Turn((), _ids(rng, spec.request_len, vocab_size), spec.output_len) for _ in range(spec.rounds))
        for _ in range(spec.clients)
    )
    name = (
        f"multi_turn clients={spec.clients} rounds={spec.rounds} req={spec.request_len} "
        f"out={spec.output_len} parallel={spec.max_parallel}"
    )
    return Workload(
        "multi_turn", name, convs, request_rate=spec.request_rate, max_parallel=spec.max_parallel, seed=seed
    )


def agent_workload(spec: AgentSpec, vocab_size: int, seed: int = 0) -> Workload:
    """Long contexts re-sent every turn: turn 0 is ``context + turn``, turn k the previous prompt (and
    its answer, when the backend returns ids) plus ``turn_len`` new ids. The conversations share
    nothing, so all reuse is within a conversation."""
    _check_vocab(vocab_size)
    rng = random.Random(f"agent/{seed}")
    convs = []
    for _ in range(spec.conversations):
        context = _ids(rng, spec.context_len, vocab_size)
        convs.append(tuple(Turn(context, _ids(rng, spec.turn_len, vocab_size), spec.output_len)
                           for _ in range(spec.turns)))  # fmt: skip
    name = (
        f"agent conversations={spec.conversations} turns={spec.turns} context={spec.context_len} "
        f"turn={spec.turn_len} out={spec.output_len}"
    )
    return Workload("agent", name, tuple(convs), max_parallel=spec.conversations, seed=seed)


def ideal_shared_prefix_reuse(spec: SharedPrefixSpec) -> int:
    """Closed form for ``shared_prefix``: per group, every prompt but the first reuses the system
    prompt (used by the tests to check ``Turn.ideal_reuse``)."""
    return spec.groups * (spec.prompts_per_group - 1) * spec.system_len


def max_context_needed(w: Workload) -> int:
    """The longest prompt + output any turn of ``w`` can reach (to size the KV pool)."""
    longest = 0
    for conv in w.conversations:
        total = 0
        for t in conv:
            total = (len(t.prefix) if total == 0 else total) + len(t.question) + t.max_new_tokens
        longest = max(longest, total)
    return longest
