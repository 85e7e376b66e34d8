"""Speculative decoding on and off, side by side: ITL, throughput and acceptance by batch size.

    make bench-spec        (python -m benchmarks.spec --model models/qwen3-bench)

Three stacks of the same checkpoint run at once (an idle stack costs next to nothing) and take
turns, ``--repeats`` times: speculation **off**, **on** (``--speculative-algorithm ngram`` with
its defaults: it stops drafting above ``--speculative-max-batch`` decoding requests, at batch
sizes where it measured drafting slower than plain decode, and backs off for requests whose
drafts keep failing) and **forced** (no batch limit, no pacer, no back-off for rejected drafts:
what drafting costs where it does not pay). Each serves three workloads at batch
(concurrency) 1, 8 and 64:

- **loop**: prompts that repeat a short phrase (1, 2, 4 or 8 tokens: a list, a log) — the model's
  answer falls into a loop that prompt lookup drafts;
- **edit**: a passage, an instruction, then the passage again, cut off (restate it) — a trained
  model would copy the passage, the case prompt lookup is for; random weights do not copy, so
  this measures what drafting costs when its drafts fail;
- **random**: random token prompts (little to look up).

``--draft-model DIR`` adds a **draft** side (``--speculative-algorithm draft`` with that checkpoint,
the defaults otherwise); ``python -m benchmarks.draft_pair`` writes a target / draft pair whose
agreement is set by construction (``make bench-spec-draft``). The **mtp** side drafts with the
checkpoint's own MTP head (``--speculative-algorithm mtp``, a Qwen3-Next with ``mtp.*`` weights;
``python -m benchmarks.draft_pair --mtp`` writes one whose head agrees by construction, ``make
bench-spec-mtp``): asked for with ``--sides``, which runs a subset.

Per run: TPOT (the time per output token after the first, per request: what a streaming user
sees; ITL percentiles mislead here, tokens arrive in bursts), output tokens/s, the acceptance
(drafts kept / drafts sent, from the scheduler's metrics) and CPU per output token of the worker
and the scheduler (from /proc). Greedy with ``ignore_eos``, so every side produces exactly the
same tokens. Writes ``--out`` (JSON) and prints a markdown table of medians (min–max).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from services.bench.metrics import RequestRecord, summarize  # noqa: E402
from services.bench.runner import GrpcBackend, replay, warm_up  # noqa: E402
from services.bench.servers import CpuMeter  # noqa: E402
from services.bench.workloads import FIRST_ID, Turn, Workload  # noqa: E402

SIDES = {
    "off": (),
    "on": ("--speculative-algorithm", "ngram"),
    "forced": (
        "--speculative-algorithm", "ngram", "--speculative-max-batch", "100000", "--speculative-min-accepted", "0",
        "--speculative-adaptive", "false",
    ),
}
DRAFT_SIDE = ("--speculative-algorithm", "draft")  # with the workers' --speculative-draft-model (--draft-model)
MTP_SIDE = ("--speculative-algorithm", "mtp")  # with the workers' --speculative-mtp true
BATCHES = (1, 8, 64)
WORKLOADS = ("loop", "edit", "random")
LOOP_PERIODS = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class Config:
    model: Path
    output_len: int = 128
    prompt_len: int = 256
    repeats: int = 3
    batches: tuple[int, ...] = BATCHES
    out: Path | None = None
    device: str = "cpu"  # the workers' --device (cuda on a lent GPU machine)
    workloads: tuple[str, ...] = WORKLOADS
    sides: tuple[str, ...] = tuple(SIDES)  # and "draft" with --draft-model


@dataclass(slots=True)
class Run:
    side: str
    workload: str
    batch: int
    repeat: int
    output_tokens: int
    failed: int
    tokens_per_s: float
    tpot_ms: float  # median over requests of (finish - first token) / (tokens - 1)
    acceptance: float  # drafts kept / drafts sent in the run (nan: none sent)
    drafts: int
    cpu_us_per_token: dict[str, float] = field(default_factory=dict)


def workload(kind: str, batch: int, cfg: Config, vocab: int, seed: int) -> Workload:
    """``batch`` requests (at least 4: batch 1 runs them one after the other) of ``cfg.prompt_len`` tokens."""
    rng = random.Random(f"spec/{kind}/{seed}")
    convs = []
    for i in range(max(4, batch)):
        if kind == "random":
            prompt = [rng.randrange(FIRST_ID, vocab) for _ in range(cfg.prompt_len)]
        elif kind == "loop":  # a short phrase over and over (a list, a log): the answer loops too
            phrase = [rng.randrange(FIRST_ID, vocab) for _ in range(LOOP_PERIODS[i % len(LOOP_PERIODS)])]
            prompt = (phrase * cfg.prompt_len)[: cfg.prompt_len]
        else:  # "edit": a passage, an instruction, then the passage again up to a point (restate it)
            passage = [rng.randrange(FIRST_ID, vocab) for _ in range(cfg.prompt_len // 2 - 8)]
            instruction = [rng.randrange(FIRST_ID, vocab) for _ in range(8)]
            prompt = (passage + instruction + passage)[: cfg.prompt_len - 16] + passage[:16]
        convs.append((Turn((), tuple(prompt), cfg.output_len),))
    return Workload("random", f"{kind} batch={batch}", tuple(convs), seed=seed)


def _tpot_ms(records: list[RequestRecord]) -> float:
    per = [
        (r.finished - r.first_token) / (r.output_tokens - 1)
        for r in records
        if r.ok and r.first_token is not None and r.finished is not None and r.output_tokens > 1
    ]
    return statistics.median(per) * 1e3 if per else float("nan")


def _spec_counts(metrics_addr: str) -> tuple[int, int]:
    """(drafts sent, drafts kept) so far, from the scheduler's Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10).read().decode()
    got = {"draft_tokens": 0.0, "accepted_tokens": 0.0}
    for fam in text_string_to_metric_families(text):
        if fam.name == "strata_scheduler_spec_events":
            for s in fam.samples:
                if s.name.endswith("_total") and s.labels.get("event") in got:
                    got[s.labels["event"]] = s.value
    return int(got["draft_tokens"]), int(got["accepted_tokens"])


async def measure(side: str, kind: str, batch: int, repeat: int, cfg: Config, vocab: int, backend: GrpcBackend,
                  meter: CpuMeter, metrics_addr: str) -> Run:  # fmt: skip
    wl = workload(kind, batch, cfg, vocab, seed=repeat)
    d0, cpu0 = _spec_counts(metrics_addr), meter.read()
    records, duration = await replay(backend, wl, batch, None, 900.0)
    cpu1, d1 = meter.read(), _spec_counts(metrics_addr)
    m = summarize(f"{side} {kind} b{batch}", records, duration)
    out = max(m.output_tokens, 1)
    sent, kept = d1[0] - d0[0], d1[1] - d0[1]
    return Run(
        side=side, workload=kind, batch=batch, repeat=repeat, output_tokens=m.output_tokens, failed=m.failed,
        tokens_per_s=m.output_throughput, tpot_ms=_tpot_ms(records),
        acceptance=kept / sent if sent else float("nan"), drafts=sent,
        cpu_us_per_token={k: (cpu1[k] - cpu0[k]) / out * 1e6 for k in ("worker", "scheduler") if k in cpu1},
    )  # fmt: skip


def _spread(values: list[float], fmt: str = ".1f") -> str:
    values = [v for v in values if v == v]  # drop nan
    if not values:
        return "–"
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def _ratio(runs: list[Run], kind: str, batch: int, side: str, pick: str) -> list[float]:
    """Per repeat, ``pick`` of ``side`` against ``off`` (speed-up: off/side for TPOT, side/off for tok/s)."""
    out = []
    for rep in sorted({r.repeat for r in runs}):
        by = {r.side: r for r in runs if r.workload == kind and r.batch == batch and r.repeat == rep}
        if side in by and "off" in by:
            a, b = getattr(by[side], pick), getattr(by["off"], pick)
            out.append(b / a if pick == "tpot_ms" else a / b)
    return out


def table(runs: list[Run]) -> str:
    rows = [
        "| workload | batch | side | TPOT ms | speed-up (TPOT) | output tok/s | speed-up (tok/s) | acceptance | "
        "worker µs/token | scheduler µs/token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    sides = [side for side in (*SIDES, "draft", "mtp") if any(r.side == side for r in runs)]
    for kind in WORKLOADS:
        for batch in sorted({r.batch for r in runs}):
            for side in sides:
                rs = [r for r in runs if r.workload == kind and r.batch == batch and r.side == side]
                if not rs:
                    continue
                up_t = _spread(_ratio(runs, kind, batch, side, "tpot_ms"), ".2f") if side != "off" else ""
                up_s = _spread(_ratio(runs, kind, batch, side, "tokens_per_s"), ".2f") if side != "off" else ""
                cells = [
                    kind, str(batch), side, _spread([r.tpot_ms for r in rs]), up_t,
                    _spread([r.tokens_per_s for r in rs], ".0f"), up_s,
                    _spread([r.acceptance for r in rs], ".2f") if side != "off" else "",
                    _spread([r.cpu_us_per_token.get("worker", 0.0) for r in rs], ".0f"),
                    _spread([r.cpu_us_per_token.get("scheduler", 0.0) for r in rs], ".0f"),
                ]  # fmt: skip
                rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


async def bench(cfg: Config, stacks: dict[str, Any]) -> list[Run]:
    vocab = json.loads((cfg.model / "config.json").read_text())["vocab_size"]
    backends, meters, metrics = {}, {}, {}
    for side, st in stacks.items():
        backends[side] = GrpcBackend(st.child("tokenizer").address, side)
        meters[side] = CpuMeter({n: p.pid for n in ("worker", "scheduler") if (p := st.child(n).proc)})
        metrics[side] = st.child("scheduler").extra["metrics"].removeprefix("http://").split("/")[0]
        await warm_up(backends[side], vocab, prompt_len=64, requests=8)
    runs: list[Run] = []
    for rep in range(cfg.repeats):
        for kind in cfg.workloads:
            for batch in cfg.batches:
                sides = list(cfg.sides) if rep % 2 == 0 else list(reversed(cfg.sides))  # alternate who goes first
                for side in sides:
                    r = await measure(side, kind, batch, rep, cfg, vocab, backends[side], meters[side], metrics[side])
                    runs.append(r)
                    print(f"  #{rep + 1} {kind:10} b{batch:<3} {side:6}: {r.tokens_per_s:7.0f} tok/s, TPOT "
                          f"{r.tpot_ms:6.2f} ms, acceptance {r.acceptance:.2f} ({r.drafts} drafts), "
                          f"{r.failed} failed", flush=True)  # fmt: skip
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "qwen3-bench")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated concurrencies")
    p.add_argument("--out", type=Path, default=None, help="write the runs as JSON here")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    p.add_argument("--device", default="cpu", help="the workers' --device (cpu, cuda)")
    p.add_argument("--draft-model", type=Path, default=None,
                   help="add a 'draft' side: --speculative-algorithm draft with this draft checkpoint "
                        "(python -m benchmarks.draft_pair writes a pair)")  # fmt: skip
    p.add_argument("--sides", default="", help="comma-separated, of off, on, forced, draft (with --draft-model) and "
                   "mtp (a checkpoint with an MTP head); default: off, on, forced, and draft with --draft-model")
    a = p.parse_args(argv)
    kinds = tuple(a.workloads.split(","))
    if bad := [k for k in kinds if k not in WORKLOADS]:
        p.error(f"--workloads: unknown {', '.join(bad)} (known: {', '.join(WORKLOADS)})")
    default = (*SIDES, "draft") if a.draft_model else tuple(SIDES)
    sides = tuple(a.sides.split(",")) if a.sides else default
    if bad := [x for x in sides if x not in (*SIDES, "draft", "mtp")]:
        p.error(f"--sides: unknown {', '.join(bad)} (known: {', '.join((*SIDES, 'draft', 'mtp'))})")
    if "off" not in sides:
        p.error("--sides: 'off' is what every speed-up is measured against")
    if "draft" in sides and a.draft_model is None:
        p.error("--sides: 'draft' needs --draft-model")
    if "mtp" in sides:
        from services.worker.models.qwen3_next_mtp import mtp_problem

        if problem := mtp_problem(a.model):
            p.error(f"--sides: 'mtp': {problem}")
    cfg = Config(a.model, a.output_len, a.prompt_len, a.repeats, tuple(int(b) for b in a.batches.split(",")), a.out,
                 a.device, kinds, sides)

    from services.common.etcd_proc import free_port
    from services.supervisor import start_stack

    run_dir = Path(tempfile.mkdtemp(prefix="strata-spec-"))
    rows = 2 * max(cfg.batches)
    kv = max(rows * (cfg.prompt_len + cfg.output_len + 64) * 8192, 256 << 20)
    stacks: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        for side in cfg.sides:
            args = {"draft": DRAFT_SIDE, "mtp": MTP_SIDE}.get(side) or SIDES[side]
            worker_side = {"draft": ("--speculative-draft-model", str(a.draft_model)),
                           "mtp": ("--speculative-mtp", "true")}.get(side, ())  # fmt: skip
            print(f"starting the '{side}' stack", flush=True)
            stacks[side] = start_stack(
                cfg.model, free_port(), run_dir / side,
                worker_args=("--max-rows", str(rows), "--kv-cache-bytes", str(kv), "--host-cache-bytes", "0",
                             "--device", cfg.device, *worker_side),
                scheduler_args=("--metrics-port", "0", "--max-running", str(rows), *args),
                say=lambda line: print("  " + line, flush=True),
            )  # fmt: skip
        runs = asyncio.run(bench(cfg, stacks))
    finally:
        for st in stacks.values():
            st.stop()
    print()
    print(f"{cfg.model.name}: prompts of {cfg.prompt_len} tokens, {cfg.output_len} out (greedy, ignore_eos), "
          f"{cfg.repeats} alternated repeats, median (min–max); speed-up = on / off per repeat")  # fmt: skip
    print(table(runs))
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"config": {k: str(v) for k, v in asdict(cfg).items()}, "elapsed_s": time.perf_counter() - t0}
        cfg.out.write_text(json.dumps({**meta, "runs": [asdict(r) for r in runs]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
