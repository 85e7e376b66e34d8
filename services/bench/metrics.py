"""Per-request records and the metrics of one run.

Times are ``time.perf_counter()`` seconds. A record's ``token_times`` holds one timestamp per
*chunk* received together with the number of tokens in it, so that ITL is computed per token even
when a server coalesces several tokens into one message (the gap is spread evenly over them).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """What one request did, as its client saw it."""

    prompt_tokens: int
    max_new_tokens: int
    ideal_reuse: int
    submitted: float
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in the chunk)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.finished is not None

    def itls(self) -> list[float]:
        """Inter-token latencies, one per output token after the first."""
        out: list[float] = []
        prev: float | None = None
        for i, (t, n) in enumerate(self.chunks):
            if i == 0:
                out += [0.0] * (n - 1)  # tokens that came with the first one: no gap measurable
            elif prev is not None and n > 0:
                out += [(t - prev) / n] * n
            prev = t
        return out


@dataclass(frozen=True, slots=True)
class Percentiles:
    mean: float
    median: float
    p99: float

    @staticmethod
    def of(values: list[float]) -> Percentiles | None:
        if not values:
            return None
        return Percentiles(statistics.fmean(values), statistics.median(values), percentile(values, 99.0))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class RunMetrics:
    """Aggregates of one run (throughputs in per-second units of wall time ``duration_s``)."""

    label: str
    requests: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    ideal_reuse: int
    request_throughput: float
    output_throughput: float
    total_throughput: float
    ttft_s: Percentiles | None
    itl_s: Percentiles | None
    e2e_s: Percentiles | None
    cache_hit_rate: float | None  # Σcached / Σprompt (None: the backend does not report it)
    reuse_vs_ideal: float | None  # Σcached / Σideal (None: nothing to reuse, or not reported)
    hits_by_tier: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(label: str, records: list[RequestRecord], duration_s: float, reports_cache: bool = True) -> RunMetrics:
    """Aggregate ``records`` of a run that took ``duration_s`` seconds of wall time.

    Only successful requests count towards throughput and latency; ``failed`` says how many did not.
    Latencies are ``None`` when no request reported them (e.g. a non-streaming reference); cache
    figures are ``None`` when ``reports_cache`` is False (transformers says nothing about reuse).
    """
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ideal = sum(r.ideal_reuse for r in ok)
    d = max(duration_s, 1e-9)
    ttft = [r.first_token - r.submitted for r in ok if r.first_token is not None]
    e2e = [r.finished - r.submitted for r in ok if r.finished is not None]
    itl = [x for r in ok for x in r.itls()]
    return RunMetrics(
        label=label,
        requests=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        prompt_tokens=prompt,
        output_tokens=output,
        cached_tokens=cached,
        ideal_reuse=ideal,
        request_throughput=len(ok) / d,
        output_throughput=output / d,
        total_throughput=(prompt + output) / d,
        ttft_s=Percentiles.of(ttft),
        itl_s=Percentiles.of(itl),
        e2e_s=Percentiles.of(e2e),
        cache_hit_rate=(cached / prompt if prompt else 0.0) if reports_cache else None,
        reuse_vs_ideal=cached / ideal if ideal and reports_cache else None,
        # The public usage does not split tiers yet: every reported hit counts as device.
        hits_by_tier={"device": cached} if reports_cache else {},
    )


@dataclass(frozen=True, slots=True)
class Comparison:
    """``value`` = metric of ``a`` / metric of ``b`` (or an absolute ratio when ``b`` is empty)."""

    name: str
    metric: str
    a: str
    b: str
    value: float
    goal: float | None
    lower_is_better: bool = False  # a time ratio (TTFT / forward, step / floor): met when <= goal

    @property
    def met(self) -> bool | None:
        if self.goal is None:
            return None
        return self.value <= self.goal if self.lower_is_better else self.value >= self.goal


@dataclass(slots=True)
class BenchResults:
    config: dict[str, Any]
    machine: dict[str, Any]
    runs: list[RunMetrics] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    profile: str = ""
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
