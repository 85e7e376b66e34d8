"""Elastic pools vs static splits on a phase-changing workload (hybrid model, one byte budget).

    python -m services.bench.elastic --model models/qwen3-next-bench

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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
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
            t0 = time.perf_counter()
            c1, r1, n1 = await _phase(b, phases[0], args.out_len)
            _say(f"   phase 1: {c1} done, {r1} rejected, {time.perf_counter() - t0:.0f}s")
            c2, r2, n2 = await _phase(b, phases[1], args.out_len)
            dt = time.perf_counter() - t0
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
    committed = eng.kv.committed_bytes + (eng.mamba.committed_bytes if eng.mamba is not None else 0)
    return Result(label, eng.info.num_slots, eng.info.num_mamba_slots, completed, rejected, dt, tokens / dt,
                  info.get("retractions", 0), info.get("resizes", 0), committed / 2**20,
                  info.get("working_set", committed) / 2**20)


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
    args = p.parse_args(argv)
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
    runs: list[tuple[str, int, int, bool]] = []
    has_default = default_kv >= (args.long_len + args.out_len) * kv_b
    if has_default:
        runs.append((f"static default ({default_states} states)", default_kv, default_states, False))
    for share in (0.25, 0.5, 0.75):
        kv, states = split(share)
        # Without room for 3 states per row, the even split stands in for the default.
        name = "static default = even split" if share == 0.5 and not has_default else f"static {share:.0%} KV"
        runs.append((f"{name} ({states} states)", kv, states, False))
    runs.append(("elastic", (args.long_len + args.out_len) * kv_b, 1, True))
    t0 = time.perf_counter()
    results = [run_one(label, args, kv, st, el, phases) for label, kv, st, el in runs]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "budget_bytes": args.budget, "kv_bytes_per_slot": kv_b, "mamba_bytes_per_slot": m_b,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": [asdict(r) for r in results], "elapsed_s": time.perf_counter() - t0,
    }, indent=2) + "\n")
    print("| run | KV slots at start | states at start | completed | rejected | tokens/s | retractions | resizes | "
          "pool MiB when idle | working set MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.label} | {r.kv_slots} | {r.mamba_slots} | {r.completed} | {r.rejected} | {r.tokens_per_s:.0f} | "
              f"{r.retractions} | {r.resizes} | {r.idle_committed_mib:.1f} | {r.working_set_mib:.1f} |")
    el, static = results[-1], results[:-1]
    best = max(static, key=lambda r: (r.completed, r.tokens_per_s))
    print(f"\nelastic / best static ({best.label}) tokens/s: {el.tokens_per_s / best.tokens_per_s:.3f}; "
          f"idle footprint / working set: {el.idle_committed_mib / max(el.working_set_mib, 1e-9):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
