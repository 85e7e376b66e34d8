"""What a chaos run (benchmarks/chaos.py) found: requests counted by outcome, the gap each fault
left in the streams it crossed, every service's RSS slope; the tables of docs/reliability.md and
the RSS plot. ``summarize`` is pure: it takes what the run recorded (outcomes, faults, samples).

Counting, for the issue's goal (0 lost except on a killed tokenizer, 0 wrong, RSS <= 10 MiB/h):

- *completed*: the stream ended with ``length`` (eos is ignored, so every request runs to its
  ``max_new_tokens``), no error; judged against the reference (chaos_stats.verdict): ok,
  duplicated, skipped or wrong — gRPC streams by their token ids and then their text, HTTP ones
  by their text.
- *failed*: an error, or a stream that ended without ``length``. A failure whose request was
  in flight when the tokenizer was SIGKILLed is *tokenizer_connection*: the client's own
  connection died with that process, which nothing behind it can save. So is one sent on that
  connection in the instant after the kill, before the client saw it close: it failed with the
  connection's reset within ``DEAD_CONNECTION_S`` of the kill. Every other failure is *lost*.
  A failed stream whose tokens so far were not a prefix of the reference counts as wrong too.
- *resume*: for every fault and every stream in flight across its start (sent before it, a token
  after it), the stall (last token before the fault to the first after) and, for a stream really
  interrupted (stall >= ``INTERRUPTED_S``), the resume latency: from the signal (SIGKILL or
  SIGSTOP) to its first token after it. A stop's interrupted stream either waits for the SIGCONT
  (~``stop_s``) or is resumed elsewhere before it (``moved``: its scheduler's lease lapsed).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from benchmarks.chaos_load import Outcome, Prompt
from benchmarks.chaos_stats import after_warmup, gap_across, is_prefix, percentile, slope_within, verdict

INTERRUPTED_S = 1.0  # a stall at least this long across a fault is an interruption (tokens come every ~0.1 s)
SLOPE_BAR_MIB_PER_HOUR = 10.0  # the bar, for every service
# A request written into a killed tokenizer's socket fails with the connection's reset this soon.
DEAD_CONNECTION_S = 1.0
_CONNECTION_ERRORS = ("Connection reset", "Socket closed", "Connection error")


@dataclass(slots=True)
class FaultRecord:
    """One fault as injected (times: seconds since the load started)."""

    at: float
    target: str  # a service name ("worker-1", "etcd")
    action: Literal["kill", "stop"]
    pid: int
    ended: float = 0.0  # kill: = at; stop: when SIGCONT was sent
    restarted_s: float | None = None  # kill: from the kill to the new process's READY (None: not seen)
    restarted_by: str = ""  # "strata up" (its --restart on-failure); "rig" in runs before it restarted etcd
    new_pid: int = 0


@dataclass(slots=True)
class RssSample:
    t: float  # seconds since the load started
    service: str
    pid: int
    age_s: float  # seconds since this process started
    rss_mib: float


@dataclass(slots=True)
class Resume:
    """The streams in flight across faults of one kind (target kind x action)."""

    spanning: int = 0  # streams in flight across the fault's start
    interrupted: int = 0  # of those, stalled >= INTERRUPTED_S
    stalls_s: list[float] = field(default_factory=list)  # of the interrupted
    resume_s: list[float] = field(default_factory=list)  # of the interrupted, from the signal
    moved: int = 0  # of a stop's interrupted streams, those streaming again before its SIGCONT
    fronts: dict[str, int] = field(default_factory=dict)  # the interrupted streams' fronts


@dataclass(slots=True)
class Trend:
    service: str
    restarts: int  # processes seen beyond the first
    first_mib: float
    last_mib: float
    max_mib: float
    points: int  # samples after each process's warm-up
    slope_mib_per_hour: float | None  # least squares, one intercept per process life (None: too few points)

    @property
    def within_bar(self) -> bool:
        return self.slope_mib_per_hour is not None and self.slope_mib_per_hour <= SLOPE_BAR_MIB_PER_HOUR


@dataclass(slots=True)
class Summary:
    sent: int = 0
    completed: int = 0
    ok: int = 0
    duplicated: int = 0
    skipped: int = 0
    wrong: int = 0  # completed and wrong, or failed after wrong tokens
    failed: int = 0
    tokenizer_connection: int = 0  # failed: in flight when the tokenizer was SIGKILLed
    lost: int = 0  # failed otherwise
    in_flight_at_end: int = 0  # never ended (the run's drain timed out): counted as lost too
    by_front: dict[str, dict[str, int]] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)  # failure reason -> count (lost ones)
    tokenizer_reasons: dict[str, int] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)  # every failed or not-ok request
    resume: dict[str, Resume] = field(default_factory=dict)  # "worker kill" -> ...
    normal_gap_p99_s: float = 0.0  # inter-token gaps of streams that crossed no fault
    trends: dict[str, Trend] = field(default_factory=dict)

    @property
    def goal_met(self) -> bool:
        return (
            self.lost == 0 and self.wrong == 0 and self.duplicated == 0 and self.skipped == 0
            and all(t.within_bar for t in self.trends.values())
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["trends"] = {k: {**asdict(t), "within_bar": t.within_bar} for k, t in self.trends.items()}
        out["goal_met"] = self.goal_met
        return out


def reason(error: str) -> str:
    """A failure's reason without its variable parts (addresses, ids, numbers)."""
    r = re.sub(r"\d+(\.\d+)?", "N", error.splitlines()[0] if error else "no error")
    return r[:120]


def _plain(x: Sequence[object]) -> str | list[object]:
    return x if isinstance(x, str) else list(x)


# What the services' logs say happened, counted after the run: (label, log file prefix, pattern).
LOG_EVENTS = (
    ("streams resumed by the tokenizer", "tokenizer", re.compile(r"after \d+ tokens; resuming")),
    ("requests submitted again (scheduler lost before its first token)", "tokenizer",
     re.compile(r"lost \(.*\); submitting again")),
    ("sessions dropped when their scheduler left discovery", "tokenizer", re.compile(r"left discovery")),
    ("worker losses seen by a scheduler", "scheduler", re.compile(r"worker lost \(")),
    ("tracebacks", "", re.compile(r"^Traceback", re.M)),
)  # fmt: skip


def log_events(run_dir: Path) -> dict[str, int]:
    """Counts of ``LOG_EVENTS`` over the services' logs in ``run_dir`` (every start of a service
    appends to one log)."""
    out = dict.fromkeys((label for label, _, _ in LOG_EVENTS), 0)
    for path in sorted(run_dir.glob("*.log")):
        text = path.read_text(errors="replace")
        for label, prefix, pattern in LOG_EVENTS:
            if path.name.startswith(prefix):
                out[label] += len(pattern.findall(text))
    return out


def _kind(target: str) -> str:
    return target.split("-")[0]


def _on_killed_connection(o: Outcome, kill: float, why: str) -> bool:
    """Whether a failed request's own connection was the tokenizer killed at ``kill``: in flight
    at the kill, or sent just after it and failed with that connection's reset."""
    if o.sent <= kill <= o.ended:
        return True
    return kill < o.sent and o.ended - kill <= DEAD_CONNECTION_S and any(e in why for e in _CONNECTION_ERRORS)


def summarize(
    outcomes: Sequence[Outcome], prompts: dict[str, Prompt], faults: Sequence[FaultRecord],
    samples: Sequence[RssSample], t0: float, warmup_s: float, unfinished: int = 0,
) -> Summary:  # fmt: skip
    """Count ``outcomes`` (times monotonic; ``t0`` the load's start, which fault and sample times
    are relative to), measure the faults' gaps and the services' slopes."""
    s = Summary(sent=len(outcomes) + unfinished, in_flight_at_end=unfinished)
    tokenizer_kills = [t0 + f.at for f in faults if _kind(f.target) == "tokenizer" and f.action == "kill"]
    fronts: dict[str, Counter[str]] = {}
    reasons: Counter[str] = Counter()
    tok_reasons: Counter[str] = Counter()
    for o in outcomes:
        p = prompts[o.prompt]
        # gRPC streams are judged by their ids, then by their text; HTTP ones by their text.
        by_ids = o.front.startswith("grpc") and verdict(o.ids, p.want_ids) != "ok"
        got: Sequence[object] = o.ids if by_ids else o.text
        want: Sequence[object] = p.want_ids if by_ids else p.want_text
        c = fronts.setdefault(o.front, Counter())
        c["sent"] += 1
        if not o.error and o.finish == "length":
            s.completed += 1
            v = verdict(got, want)
            setattr(s, v, getattr(s, v) + 1)
            c[v] += 1
            if v != "ok":
                s.failures.append({"n": o.n, "front": o.front, "prompt": o.prompt, "verdict": v,
                                   "sent_s": o.sent - t0, "got": _plain(got), "want": _plain(want)})  # fmt: skip
            continue
        s.failed += 1
        why = o.error or f"stream ended with {o.finish or 'no finish reason'}"
        on_tokenizer = any(_on_killed_connection(o, k, why) for k in tokenizer_kills)
        if on_tokenizer:
            s.tokenizer_connection += 1
            tok_reasons[reason(why)] += 1
            c["tokenizer_connection"] += 1
        else:
            s.lost += 1
            reasons[reason(why)] += 1
            c["lost"] += 1
        partial_ok = is_prefix(got, want)
        if not partial_ok:
            s.wrong += 1
        s.failures.append({"n": o.n, "front": o.front, "prompt": o.prompt, "error": why, "sent_s": o.sent - t0,
                           "ended_s": o.ended - t0, "tokenizer_connection": on_tokenizer,
                           "partial_ok": partial_ok, "tokens_or_chars": len(got)})  # fmt: skip
    s.lost += unfinished
    s.by_front = {k: dict(v) for k, v in sorted(fronts.items())}
    s.reasons, s.tokenizer_reasons = dict(reasons.most_common()), dict(tok_reasons.most_common())
    s.resume, s.normal_gap_p99_s = _resume(outcomes, faults, t0)
    s.trends = trends(samples, warmup_s)
    return s


def _resume(outcomes: Sequence[Outcome], faults: Sequence[FaultRecord], t0: float) -> tuple[dict[str, Resume], float]:
    out: dict[str, Resume] = {}
    crossed: set[int] = set()
    for f in faults:
        r = out.setdefault(f"{_kind(f.target)} {f.action}", Resume())
        start, end = t0 + f.at, t0 + f.ended
        for o in outcomes:
            stall = gap_across(o.times, o.sent, start)
            if stall is None:
                continue
            crossed.add(o.n)
            r.spanning += 1
            if stall >= INTERRUPTED_S:
                r.interrupted += 1
                r.stalls_s.append(round(stall, 4))
                r.fronts[o.front] = r.fronts.get(o.front, 0) + 1
                after = next(x for x in o.times if x > start)  # exists: the stall spans the fault
                r.resume_s.append(round(after - start, 4))
                r.moved += f.action == "stop" and after < end
    normal = [b - a for o in outcomes if o.n not in crossed for a, b in zip(o.times, o.times[1:], strict=False)]
    return out, percentile(normal, 99) if normal else 0.0


def trends(samples: Sequence[RssSample], warmup_s: float) -> dict[str, Trend]:
    """Per service: the slope of its RSS over the run's clock, one intercept per process (a
    restarted service starts afresh), from ``warmup_s`` into both the load and the process's life."""
    out: dict[str, Trend] = {}
    for name in dict.fromkeys(x.service for x in samples):
        mine = [x for x in samples if x.service == name]
        by_pid: dict[int, list[tuple[float, float, float]]] = {}
        for x in mine:
            by_pid.setdefault(x.pid, []).append((x.t, min(x.age_s, x.t), x.rss_mib))  # warm: the load's too
        segments = [after_warmup(seg, warmup_s) for seg in by_pid.values()]
        slope = slope_within(segments)
        out[name] = Trend(
            name, len(by_pid) - 1, mine[0].rss_mib, mine[-1].rss_mib, max(x.rss_mib for x in mine),
            sum(len(seg) for seg in segments), None if slope is None else slope * 3600,
        )  # fmt: skip
    return out


def _ms(xs: list[float], q: float) -> str:
    return f"{percentile(xs, q):.2f}" if xs else "-"


def tables(s: Summary, faults: Sequence[FaultRecord]) -> str:
    """The markdown tables of docs/reliability.md's chaos section."""
    lines = [
        "| sent | completed | ok | duplicated | skipped | wrong | failed: tokenizer connection | failed: lost |",
        "|---|---|---|---|---|---|---|---|",
        f"| {s.sent} | {s.completed} | {s.ok} | {s.duplicated} | {s.skipped} | {s.wrong} "
        f"| {s.tokenizer_connection} | {s.lost} |",
        "",
        "| front | "
        + " | ".join(("sent", "ok", "duplicated", "skipped", "wrong", "tokenizer_connection", "lost"))
        + " |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for front, c in s.by_front.items():
        cols = ("sent", "ok", "duplicated", "skipped", "wrong", "tokenizer_connection", "lost")
        lines.append(f"| {front} | " + " | ".join(str(c.get(k, 0)) for k in cols) + " |")
    lines += [
        "",
        "| fault | times | streams across | interrupted (stall >= 1 s) | stall p50 / p99 (s) "
        "| resume after the signal p50 / p99 / max (s) | restarted after (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, r in s.resume.items():
        mine = [f for f in faults if f"{_kind(f.target)} {f.action}" == kind]
        restarts = [f"{f.restarted_s:.1f}" if f.restarted_s is not None else "not seen" for f in mine]
        moved = f"SIGCONT after {mine[0].ended - mine[0].at:.0f} s; {r.moved} moved before it"
        restarted = ", ".join(restarts) if mine[0].action == "kill" else moved
        worst = f"{max(r.resume_s):.2f}" if r.resume_s else "-"
        lines.append(
            f"| {kind} | {len(mine)} | {r.spanning} | {r.interrupted} | {_ms(r.stalls_s, 50)} / {_ms(r.stalls_s, 99)} "
            f"| {_ms(r.resume_s, 50)} / {_ms(r.resume_s, 99)} / {worst} | {restarted} |"
        )
    lines += [
        "",
        "| service | restarts | RSS first → last, max (MiB) | points after warm-up | slope (MiB/h) | ≤ 10 MiB/h |",
        "|---|---|---|---|---|---|",
    ]
    for t in s.trends.values():
        slope = "-" if t.slope_mib_per_hour is None else f"{t.slope_mib_per_hour:+.1f}"
        lines.append(
            f"| {t.service} | {t.restarts} | {t.first_mib:.0f} → {t.last_mib:.0f}, {t.max_mib:.0f} | {t.points} "
            f"| {slope} | {'yes' if t.within_bar else 'no'} |"
        )
    return "\n".join(lines)


def plot(samples: Sequence[RssSample], faults: Sequence[FaultRecord], path: Path, warmup_s: float) -> Path:
    """RSS of every service over the run, one line per process life (left), and each process's
    growth since the end of its warm-up (right, the slope's view); faults marked on both (kills
    solid, stops dashed with their pause shaded)."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(14, 5.5))
    ax, bx = fig.subplots(1, 2)
    colors: dict[str, str] = {}
    for name in dict.fromkeys(x.service for x in samples):
        by_pid: dict[int, list[RssSample]] = {}
        for x in samples:
            if x.service == name:
                by_pid.setdefault(x.pid, []).append(x)
        for i, seg in enumerate(by_pid.values()):
            (line,) = ax.plot([x.t / 60 for x in seg], [x.rss_mib for x in seg], color=colors.get(name),
                              label=name if i == 0 else None)  # fmt: skip
            colors[name] = line.get_color()
            warm = [x for x in seg if min(x.age_s, x.t) >= warmup_s]
            if warm:
                bx.plot([x.t / 60 for x in warm], [x.rss_mib - warm[0].rss_mib for x in warm], color=colors[name],
                        label=name if i == 0 else None)  # fmt: skip
    for f in faults:
        color = colors.get(f.target, "grey")
        for a in (ax, bx):
            a.axvline(f.at / 60, color=color, linestyle="-" if f.action == "kill" else "--", linewidth=0.8)
            if f.action == "stop":
                a.axvspan(f.at / 60, f.ended / 60, color=color, alpha=0.1)
        if len(faults) <= 30:
            ax.text(f.at / 60, 0.98, f" {f.target} {f.action}", transform=ax.get_xaxis_transform(), rotation=90,
                    fontsize=7, va="top", ha="right")  # fmt: skip
    ax.set_yscale("log")
    ax.set_ylabel("RSS (MiB, log scale)")
    ax.set_title("RSS (solid: SIGKILL, dashed + shaded: SIGSTOP)")
    bx.set_ylabel("MiB since the process's warm-up")
    bx.set_title(f"Growth of each process after its first {warmup_s:g} s")
    for a in (ax, bx):
        a.set_xlabel("minutes")
        a.legend(loc="lower left", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return path
