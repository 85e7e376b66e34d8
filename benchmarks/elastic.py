"""Elastic pools vs static splits on a phase-changing workload (hybrid model, one byte budget).

    python -m benchmarks.elastic --model models/qwen3-next-bench

Phase 1 (KV-heavy): ``--long`` requests of ``--long-len`` prompt tokens, all at once.
Phase 2 (state-heavy): ``--short`` requests of ``--short-len`` tokens, all at once.
Every run gets the same budget for KV + Mamba pool bytes:

- static splits: the worker's pools are fixed at a KV share of the budget (the rest is Mamba
  states): 25 / 50 / 75 % KV, and ``default``, the split a worker gets from its defaults (3 states
  per row, KV takes the rest) — when that does not fit the budget, the even split stands in;
- elastic: the pools start at their minimums inside a reservation of the whole budget for each,
  and the scheduler's orchestrator moves capacity between them (``--elastic-budget-bytes``).

Reported per run: completed requests, total tokens/s over both phases, retractions, and for the
elastic run the pool memory the worker still holds after ``--idle-s`` of idleness against the
live working set it must keep (the minimum capacities). Writes ``--out`` (JSON) and prints a
markdown table. Progress goes to stderr.

``--repeats N`` runs every configuration N times, interleaved (round ``i`` starts ``i`` runs
further down the list, so no configuration always runs first or last on a machine whose load
drifts), and reports the median of each figure with the tokens/s spread; the elastic run is also
compared with the best static split round by round (paired ratios), which cancels load that
changes between rounds. ``--runs`` picks a subset (for quick checks; the full set is the
benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from services.bench.runner import InProcessBackend
from services.scheduler.loop import LoopConfig


@dataclass(frozen=True, slots=True)
class Result:
    label: str
    kv_slots: int  # at start
    mamba_slots: int  # at start
    completed: int
    rejected: int
    seconds: float
    tokens_per_s: float
    retractions: int
    resizes: int
    idle_committed_mib: float
    working_set_mib: float
    cpu_s: float  # CPU seconds this process spent over both phases (all threads)
    others_cpu_s: float  # CPU seconds other processes took meanwhile (load that slows wall-clock figures)


@dataclass(frozen=True, slots=True)
class Run:
    key: str  # what --runs names it by
    label: str
    kv_bytes: int
    mamba_slots: int
    elastic: bool


RUN_KEYS = ("default", "25", "50", "75", "elastic")


def median_result(rs: list[Result]) -> Result:
    """Per-field median of one configuration's repeats (the start capacities are the same in all)."""
    vals: dict[str, Any] = {}
    for f in fields(Result):
        xs = [getattr(r, f.name) for r in rs]
        if f.name == "label":
            vals[f.name] = xs[0]
        elif isinstance(xs[0], int):
            vals[f.name] = int(statistics.median_low(xs))
        else:
            vals[f.name] = statistics.median(xs)
    return Result(**vals)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(f"elastic/{args.seed}")
    long = [[rng.randrange(3, vocab) for _ in range(args.long_len)] for _ in range(args.long)]
    short = [[rng.randrange(3, vocab) for _ in range(args.short_len)] for _ in range(args.short)]
    return long, short


async def _phase(b: InProcessBackend, prompts: list[list[int]], out_len: int) -> tuple[int, int, int]:
    """(completed, rejected, tokens) of one phase, every request submitted at once."""
    from services.bench.metrics import RequestRecord
    from services.bench.runner import BackendError

    async def one(p: list[int]) -> int:
        rec = RequestRecord(len(p), out_len, 0, time.perf_counter())
        try:
            got = await b.generate(p, out_len, rec)
        except BackendError:
            return -1
        return len(p) + len(got)

    done = await asyncio.gather(*(one(p) for p in prompts))
    ok = [n for n in done if n >= 0]
    return len(ok), len(done) - len(ok), sum(ok)


def run_one(label: str, args: argparse.Namespace, kv_bytes: int, mamba_slots: int, elastic: bool,
            phases: tuple[list[list[int]], list[list[int]]]) -> Result:
    from services.worker.engine import Engine, EngineConfig

    if elastic:
        ecfg = EngineConfig(kv_cache_bytes=kv_bytes, max_rows=args.rows, mamba_slots=mamba_slots,
                            kv_max_bytes=args.budget, mamba_max_slots=args.max_states)
    else:
        ecfg = EngineConfig(kv_cache_bytes=kv_bytes, max_rows=args.rows, mamba_slots=mamba_slots)
    eng = Engine(args.model, ecfg)
    cfg = LoopConfig(max_prefill_tokens=args.max_prefill_tokens, max_running=args.rows,
                     elastic_budget_bytes=args.budget if elastic else 0, elastic_idle_s=args.idle_s,
                     elastic_min_kv_slots=args.long_len + args.out_len if elastic else 0)
    info: dict[str, Any] = {}

    async def go() -> tuple[int, int, int, float]:
        async with InProcessBackend(eng, cfg, label) as b:
            t0, cpu0, busy0 = time.perf_counter(), time.process_time(), _machine_busy_s()
            c1, r1, n1 = await _phase(b, phases[0], args.out_len)
            _say(f"   phase 1: {c1} done, {r1} rejected, {time.perf_counter() - t0:.0f}s")
            c2, r2, n2 = await _phase(b, phases[1], args.out_len)
            dt = time.perf_counter() - t0
            info["cpu_s"] = time.process_time() - cpu0
            info["others_cpu_s"] = max(0.0, _machine_busy_s() - busy0 - info["cpu_s"])
            _say(f"   phase 2: {c2} done, {r2} rejected, {dt:.0f}s in all")
            assert b.loop is not None and b.loop.batcher is not None
            batcher = b.loop.batcher
            info["retractions"] = batcher.retractions
            if batcher.elastic is not None:
                await asyncio.sleep(args.idle_s + 1.5)  # idle: the loop gives memory back
                el = batcher.elastic
                info["resizes"] = el.resizes
                floor = el.orch.bytes_of(el.orch.floor(el.demand([], busy=False)))
                info["working_set"] = floor
            return c1 + c2, r1 + r2, n1 + n2, dt

    _say(f"-- {label}: KV {eng.kv.num_slots} slots, {eng.info.num_mamba_slots} states")
    completed, rejected, tokens, dt = asyncio.run(go())
    _say(f"   {tokens / dt:.0f} tokens/s; CPU {info['cpu_s']:.1f}s, others {info['others_cpu_s']:.1f}s")
    committed = eng.kv.committed_bytes + (eng.mamba.committed_bytes if eng.mamba is not None else 0)
    return Result(label, eng.info.num_slots, eng.info.num_mamba_slots, completed, rejected, dt, tokens / dt,
                  info.get("retractions", 0), info.get("resizes", 0), committed / 2**20,
                  info.get("working_set", committed) / 2**20, info["cpu_s"], info["others_cpu_s"])


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores; Linux ``/proc/stat``, else 0)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("models/qwen3-next-bench"))
    p.add_argument("--budget", type=int, default=96 << 20, help="KV + Mamba pool bytes of every run")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--long", type=int, default=6, help="phase 1 requests")
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--short", type=int, default=128, help="phase 2 requests")
    p.add_argument("--short-len", type=int, default=32)
    p.add_argument("--out-len", type=int, default=16)
    p.add_argument("--max-states", type=int, default=128, help="elastic run: Mamba reservation")
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--idle-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/bench/elastic.json"))
    p.add_argument("--repeats", type=int, default=1, help="runs of every configuration, interleaved; medians")
    p.add_argument("--runs", default="", help=f"comma-separated subset of {','.join(RUN_KEYS)} (default: all)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    from services.worker.engine import Engine, EngineConfig

    probe = Engine(args.model, EngineConfig(kv_cache_bytes=1 << 20, max_rows=1, mamba_slots=1))
    if not probe.info.hybrid:
        p.error(f"{args.model} is not a hybrid model: the phases trade KV for Mamba states")
    kv_b, m_b = probe.info.bytes_per_slot, probe.info.bytes_per_mamba_slot
    vocab = probe.info.vocab_size
    del probe
    phases = _workload(args, vocab)

    def split(kv_share: float) -> tuple[int, int]:
        states = max(1, int(args.budget * (1 - kv_share)) // m_b)
        return args.budget - states * m_b, states

    default_states = 3 * args.rows
    default_kv = args.budget - default_states * m_b
    runs: list[Run] = []
    has_default = default_kv >= (args.long_len + args.out_len) * kv_b
    if has_default:
        runs.append(Run("default", f"static default ({default_states} states)", default_kv, default_states, False))
    for share in (0.25, 0.5, 0.75):
        kv, states = split(share)
        # Without room for 3 states per row, the even split stands in for the default.
        name = "static default = even split" if share == 0.5 and not has_default else f"static {share:.0%} KV"
        runs.append(Run(f"{share * 100:.0f}", f"{name} ({states} states)", kv, states, False))
    runs.append(Run("elastic", "elastic", (args.long_len + args.out_len) * kv_b, 1, True))
    if args.runs:
        keep = set(args.runs.split(","))
        if not keep <= set(RUN_KEYS):
            p.error(f"--runs takes a comma-separated subset of {','.join(RUN_KEYS)}, got {args.runs!r}")
        runs = [run for run in runs if run.key in keep]
    t0 = time.perf_counter()
    by_label: dict[str, list[Result]] = {run.label: [] for run in runs}
    for i in range(args.repeats):
        order = runs[i % len(runs):] + runs[: i % len(runs)]
        if args.repeats > 1:
            _say(f"== round {i + 1} of {args.repeats}")
        for run in order:
            by_label[run.label].append(run_one(run.label, args, run.kv_bytes, run.mamba_slots, run.elastic, phases))
    results = [median_result(by_label[run.label]) for run in runs]
    static = [r for r in results if r.label != "elastic"]
    el = next((r for r in results if r.label == "elastic"), None)
    best = max(static, key=lambda r: (r.completed, r.tokens_per_s)) if static else None
    default = next((r for r in static if "default" in r.label), None)

    def paired(other: Result | None) -> list[float]:
        if el is None or other is None:
            return []
        pairs = zip(by_label["elastic"], by_label[other.label], strict=True)
        return [e.tokens_per_s / o.tokens_per_s for e, o in pairs]

    vs_best, vs_default = paired(best), paired(default)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "budget_bytes": args.budget, "kv_bytes_per_slot": kv_b, "mamba_bytes_per_slot": m_b,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": [asdict(r) for r in results],  # medians over the repeats
        "repeats": {label: [asdict(r) for r in rs] for label, rs in by_label.items()},
        "elastic_vs_best_static": {"best": best.label if best else None, "median_ratio": _median(vs_best),
                                   "paired_ratios": vs_best},
        "elastic_vs_default": {"default": default.label if default else None, "median_ratio": _median(vs_default),
                               "paired_ratios": vs_default},
        "elapsed_s": time.perf_counter() - t0,
    }, indent=2) + "\n")
    reps = f" (median of {args.repeats})" if args.repeats > 1 else ""
    print(f"| run | KV slots at start | states at start | completed | rejected | tokens/s{reps} | tokens/s min-max | "
          "retractions | resizes | pool MiB when idle | working set MiB | CPU s | others' CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        tps = [x.tokens_per_s for x in by_label[r.label]]
        print(f"| {r.label} | {r.kv_slots} | {r.mamba_slots} | {r.completed} | {r.rejected} | {r.tokens_per_s:.0f} | "
              f"{min(tps):.0f}-{max(tps):.0f} | {r.retractions} | {r.resizes} | {r.idle_committed_mib:.1f} | "
              f"{r.working_set_mib:.1f} | {r.cpu_s:.1f} | {r.others_cpu_s:.1f} |")
    if el is not None and best is not None:
        print(f"\nelastic / best static ({best.label}) tokens/s: {el.tokens_per_s / best.tokens_per_s:.3f} "
              f"(medians); paired by round: median {_median(vs_best):.3f}, "
              f"range {min(vs_best):.3f}-{max(vs_best):.3f}")
        if default is not None:
            print(f"elastic / default ({default.label}) tokens/s: {el.tokens_per_s / default.tokens_per_s:.3f} "
                  f"(medians); paired by round: median {_median(vs_default):.3f}")
        print(f"idle footprint / working set: {el.idle_committed_mib / max(el.working_set_mib, 1e-9):.2f}")
    return 0


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


if __name__ == "__main__":
    raise SystemExit(main())
