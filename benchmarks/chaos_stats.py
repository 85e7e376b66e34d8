"""The chaos run's accounting (benchmarks/chaos.py), pure so that it can be tested on synthetic data:
what a stream's output says about its request (``verdict``), the gap a fault left in a stream
(``gap_across``), percentiles, and the RSS slope of a service whose process is restarted
(``slope_within``: one least-squares slope shared by every process lifetime, each with its own
intercept, so that a restart's drop to a fresh process is not read as a trend).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal, TypeVar

T = TypeVar("T")

# ok: equal to the reference. duplicated: the reference with one run of its tokens sent twice (a
# resumed stream that repeated what the client already had). skipped: the reference with one run
# missing (a resumed stream that lost tokens). wrong: anything else.
Verdict = Literal["ok", "duplicated", "skipped", "wrong"]


def _insertions(longer: Sequence[T], shorter: Sequence[T]) -> list[int]:
    """Every ``j`` such that ``longer`` is ``shorter`` with one contiguous run inserted at ``j``."""
    d = len(longer) - len(shorter)
    if d <= 0:
        return []
    k = 0  # the run starts within the common prefix or right after it
    while k < len(shorter) and longer[k] == shorter[k]:
        k += 1
    return [j for j in range(k + 1) if list(longer[j + d :]) == list(shorter[j:])]


def verdict(got: Sequence[T], want: Sequence[T]) -> Verdict:
    """Judge a finished stream's output (token ids, or the characters of its text) against the
    reference. A duplicated stream repeats a run it had already sent: ``got`` is ``want`` with a
    copy of ``want[j-d:j]`` inserted at ``j``."""
    if list(got) == list(want):
        return "ok"
    d = len(got) - len(want)
    if any(j >= d and list(got[j : j + d]) == list(want[j - d : j]) for j in _insertions(got, want)):
        return "duplicated"
    if _insertions(want, got):
        return "skipped"
    return "wrong"


def is_prefix(got: Sequence[T], want: Sequence[T]) -> bool:
    """Whether a stream that ended early had sent only correct tokens."""
    return len(got) <= len(want) and list(want[: len(got)]) == list(got)


def gap_across(times: Sequence[float], sent: float, t: float) -> float | None:
    """The gap a stream shows across instant ``t``: from its last token at or before ``t`` (or its
    sending, when none came yet) to its first token after ``t``. None when the stream did not span
    ``t`` (sent after it, or its last token came before it)."""
    if sent > t or not times or times[-1] <= t:
        return None
    before = max((x for x in times if x <= t), default=sent)
    after = next(x for x in times if x > t)
    return after - before


def percentile(xs: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks; nan when empty."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def slope_within(segments: Iterable[Sequence[tuple[float, float]]]) -> float | None:
    """Least-squares slope of y over x shared by every segment, each segment with its own intercept
    (a fixed-effects fit: x and y are centred per segment). Segments of fewer than two points
    carry no slope. None when no segment's x varies."""
    num = den = 0.0
    for seg in segments:
        if len(seg) < 2:
            continue
        mx = sum(x for x, _ in seg) / len(seg)
        my = sum(y for _, y in seg) / len(seg)
        num += sum((x - mx) * (y - my) for x, y in seg)
        den += sum((x - mx) ** 2 for x, _ in seg)
    return num / den if den > 0 else None


def after_warmup(points: Sequence[tuple[float, float, float]], warmup_s: float) -> list[tuple[float, float]]:
    """``(x, y)`` of the points ``(x, age, y)`` whose process had run at least ``warmup_s`` (age:
    seconds since that process started)."""
    return [(x, y) for x, age, y in points if age >= warmup_s]
