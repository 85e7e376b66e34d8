"""When to plan the next step while the worker runs this one (overlap, ``LoopConfig.overlap``).

Pipelining a second step hides the scheduler's own time (planning, committing) behind the
worker's forward. It also fixes that second step's contents before the first one ends, so a
request arriving during the first waits for both: one step more than without overlap. Behind a
decode step of a few milliseconds that trade is good. Behind a step that prefills many tokens it
is not. On the bench model an agent's 128-token turn over a 2-3k cached prefix is a step of
~100 ms against ~1 ms of planning, so overlap hides 1 % of it. The second agent's turn, arriving
during it, waited for the decode step pipelined behind it too: its TTFT went from ~160 to
~180 ms (docs/benchmarks.md).

The rule: a step with prefill tokens is pipelined behind only while its predicted worker time is
below ``ratio`` times the scheduler's time per step, that is, while overlap would hide at least
1/``ratio`` of it. Decode-only steps are always pipelined behind, as before. The prediction is
linear in the step's prefill tokens, from running means of what the worker reported (its forward
and sampling time) and what the loop measured of itself.
"""

from __future__ import annotations

from dataclasses import dataclass

_ALPHA = 0.2  # weight of the newest observation in each running mean
_MIN_TOKENS = 16  # steps with fewer prefill tokens teach nothing about the per-token cost


@dataclass(slots=True)
class OverlapPolicy:
    """Running means of step costs, and the pipelining decision (module docstring)."""

    ratio: float = 20.0
    scheduler_s: float = 0.0  # the loop's own time per step: plan + commit
    decode_s: float = 0.0  # the worker's time for a step without prefill tokens
    token_s: float = 0.0  # the worker's time per prefill token, beyond a decode step's

    def observe_scheduler(self, seconds: float) -> None:
        """The loop spent ``seconds`` planning and committing one step."""
        self.scheduler_s = _mean(self.scheduler_s, seconds)

    def observe_step(self, prefill_tokens: int, worker_s: float) -> None:
        """The worker reported ``worker_s`` (forward + sampling) for a step with ``prefill_tokens``."""
        if prefill_tokens == 0:
            self.decode_s = _mean(self.decode_s, worker_s)
        elif prefill_tokens >= _MIN_TOKENS:
            self.token_s = _mean(self.token_s, max(0.0, worker_s - self.decode_s) / prefill_tokens)

    def predicted_s(self, prefill_tokens: int) -> float:
        return self.decode_s + prefill_tokens * self.token_s

    def pipeline_behind(self, prefill_tokens: int) -> bool:
        """Whether to plan another step while one with ``prefill_tokens`` runs (always with ``ratio`` 0)."""
        if not self.ratio or prefill_tokens == 0 or self.scheduler_s == 0.0 or self.token_s == 0.0:
            return True
        return self.predicted_s(prefill_tokens) < self.ratio * self.scheduler_s


def _mean(old: float, new: float) -> float:
    return new if old == 0.0 else old + _ALPHA * (new - old)
