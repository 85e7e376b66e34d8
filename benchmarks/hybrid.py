"""Prefix reuse on a hybrid model vs a dense one, and the state checkpoint/eviction policy vs LRU.

    python -m benchmarks.hybrid --dense models/qwen3-bench --hybrid models/qwen3-next-bench

One multi-turn trace (``--clients`` conversations × ``--rounds`` turns, the history growing by a
new request and the answer every turn, all conversations open at once) is replayed in-process on:

1. the dense model (Qwen3, radix cache): the reference hit rate;
2. the hybrid model (Qwen3-Next, Mamba radix cache, Marconi eviction, default state pool);
3. a *mixed* trace — the same conversations plus a stream of one-off requests (short prompts
   that are never continued, ``--oneoff-parallel`` of them at a time) — on the hybrid model with a
   state pool too small to keep every state, once with Marconi eviction (recency + compute saved
   per byte) and once with plain LRU. The one-offs leave fresh, shallow states behind: LRU keeps
   them over the older, deeper states of conversations waiting for their next turn.

Hit rate = Σ cached prompt tokens / Σ prompt tokens; reuse = Σ cached / Σ ideal (an unbounded
cache reuses each turn's whole history but the last answer token). Writes ``--out`` (JSON) and
prints a markdown table for docs/benchmarks.md. Progress goes to stderr.
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

from services.bench.metrics import RunMetrics, summarize
from services.bench.runner import InProcessBackend, replay, warm_up
from services.bench.workloads import MultiTurnSpec, Turn, Workload, multi_turn_workload
from services.scheduler.loop import LoopConfig


@dataclass(frozen=True, slots=True)
class Run:
    label: str
    model: Path
    mixed: bool = False  # the trace with one-off requests
    policy: str = "marconi"
    mamba_slots: int = 0  # 0 = the worker's default (3 per row)


@dataclass(frozen=True, slots=True)
class Result:
    label: str
    hit_rate: float
    reuse_vs_ideal: float
    requests: int
    failed: int
    seconds: float
    tokens_per_s: float
    state_evictions: int
    forks_inserted: int
    forks_skipped: int
    donated: int


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def mixed_workload(w: Workload, args: argparse.Namespace, vocab: int) -> Workload:
    """``w``'s conversations plus ``--oneoffs`` single-turn requests, ``--oneoff-parallel`` open
    at a time beside the conversations (opened as earlier ones finish)."""
    rng = random.Random(f"oneoff/{args.seed}")
    oneoffs = tuple(
        (Turn((), tuple(rng.randrange(3, vocab) for _ in range(args.oneoff_len)), args.output_len),)
        for _ in range(args.oneoffs)
    )
    parallel = len(w.conversations) + args.oneoff_parallel
    name = f"{w.name} + {args.oneoffs} one-offs of {args.oneoff_len} tokens, {args.oneoff_parallel} at a time"
    return Workload("multi_turn", name, w.conversations + oneoffs, max_parallel=parallel, seed=w.seed)


def run_one(run: Run, w: Workload, args: argparse.Namespace) -> Result:
    from services.worker.engine import Engine, EngineConfig

    eng = Engine(run.model, EngineConfig(kv_cache_bytes=args.kv_cache_bytes, max_rows=args.rows,
                                         mamba_slots=run.mamba_slots))
    cfg = LoopConfig(max_prefill_tokens=args.max_prefill_tokens, max_running=args.rows, mamba_policy=run.policy)
    counters: dict[str, int] = {}

    async def go() -> tuple[list[Any], float]:
        async with InProcessBackend(eng, cfg, run.label) as b:
            await warm_up(b, min(eng.info.vocab_size, 512))
            out = await replay(b, w, args.rows, _say, args.timeout_s)
            assert b.loop is not None and b.loop.batcher is not None
            c = b.loop.batcher.mem.stats().get("state_events")
            if c is not None:
                counters.update(states_evicted=c["evicted"], forks_inserted=c["fork_inserted"],
                                forks_skipped=c["fork_skipped"], donated=c["donated"])
            return out

    _say(f"-- {run.label}")
    records, duration = asyncio.run(go())
    # Warm-up requests are not in the records; the trace's own requests are.
    m: RunMetrics = summarize(run.label, records, duration)
    r = Result(run.label, m.cache_hit_rate or 0.0, m.reuse_vs_ideal or 0.0, m.requests, m.failed, duration,
               m.total_throughput, counters.get("states_evicted", 0), counters.get("forks_inserted", 0),
               counters.get("forks_skipped", 0), counters.get("donated", 0))
    _say(f"   hit rate {r.hit_rate:.1%}, reuse {r.reuse_vs_ideal:.1%} of ideal, {r.requests} ok / {r.failed} "
         f"failed in {duration:.0f}s, {r.state_evictions} states evicted")
    return r


def table(results: list[Result], dense: Result) -> str:
    rows = ["| run | hit rate | vs dense | reuse / ideal | states evicted | forks in tree | forks skipped | "
            "states donated | requests | s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.label} | {r.hit_rate:.1%} | {r.hit_rate / dense.hit_rate:.3f} | {r.reuse_vs_ideal:.1%} | "
                    f"{r.state_evictions} | {r.forks_inserted} | {r.forks_skipped} | {r.donated} | "
                    f"{r.requests} ok / {r.failed} failed | {r.seconds:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense", type=Path, default=Path("models/qwen3-bench"))
    p.add_argument("--hybrid", type=Path, default=Path("models/qwen3-next-bench"))
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--request-len", type=int, default=64, help="new tokens per turn")
    p.add_argument("--output-len", type=int, default=16, help="answer tokens per turn")
    p.add_argument("--rows", type=int, default=32, help="worker rows = requests running at once")
    p.add_argument("--tight-states", type=int, nargs="*", default=[],
                   help="state pools of the policy comparison; default: rows + clients and rows + clients / 2")
    p.add_argument("--oneoffs", type=int, default=0,
                   help="one-off requests of the mixed trace; 0 = 2 × clients × rounds")
    p.add_argument("--oneoff-len", type=int, default=48, help="prompt tokens of a one-off request")
    p.add_argument("--oneoff-parallel", type=int, default=8, help="one-offs open at once")
    p.add_argument("--max-prefill-tokens", type=int, default=512)
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/bench/hybrid.json"))
    args = p.parse_args(argv)
    args.oneoffs = args.oneoffs or 2 * args.clients * args.rounds
    for model in (args.dense, args.hybrid):
        if not (model / "config.json").exists():
            p.error(f"{model} is not a model directory (make bench-hybrid generates both)")
    vocab = min(_vocab(args.dense), _vocab(args.hybrid))
    spec = MultiTurnSpec(clients=args.clients, rounds=args.rounds, request_len=args.request_len,
                         output_len=args.output_len, max_parallel=args.clients)
    w = multi_turn_workload(spec, vocab, args.seed)
    mixed = mixed_workload(w, args, vocab)
    tights = args.tight_states or [args.rows + args.clients, args.rows + args.clients // 2]
    runs = [
        Run("dense Qwen3 · radix", args.dense),
        Run("hybrid Qwen3-Next · Marconi · default states", args.hybrid),
    ]
    for tight in tights:
        runs += [
            Run(f"mixed · hybrid · Marconi · {tight} states", args.hybrid, True, "marconi", tight),
            Run(f"mixed · hybrid · LRU · {tight} states", args.hybrid, True, "lru", tight),
        ]
    _say(f"workload {w.describe()}\nmixed workload {mixed.describe()}")
    t0 = time.perf_counter()
    results = [run_one(r, mixed if r.mixed else w, args) for r in runs]
    dense = results[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "workload": w.describe(),
        "mixed_workload": mixed.describe(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": [asdict(r) for r in results],
        "hybrid_vs_dense": results[1].hit_rate / dense.hit_rate,
        "marconi_vs_lru": [
            m.hit_rate / max(lru.hit_rate, 1e-9) for m, lru in zip(results[2::2], results[3::2], strict=True)
        ],
        "elapsed_s": time.perf_counter() - t0,
    }, indent=2) + "\n")
    print(table(results, dense))
    print(f"\nhybrid / dense hit rate: {results[1].hit_rate / dense.hit_rate:.3f} (goal >= 0.90)")
    for m, lru in zip(results[2::2], results[3::2], strict=True):
        print(f"{m.label}: Marconi / LRU hit rate {m.hit_rate / max(lru.hit_rate, 1e-9):.3f}")
    return 0 if results[1].hit_rate >= 0.9 * dense.hit_rate else 1


if __name__ == "__main__":
    raise SystemExit(main())
