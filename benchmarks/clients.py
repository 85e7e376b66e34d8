"""An OpenAI-compatible load generator against Strata (issue #28): GuideLLM on the bench model.

    make bench-clients      (python -m benchmarks.clients --guidellm .venv-guidellm/bin/guidellm)

Starts a Strata stack (``start_stack``: etcd, kvstore, worker, scheduler, tokenizer with its OpenAI
HTTP front) on ``--model``, its worker on ``--worker-threads`` torch threads (1: GuideLLM shares the
machine's cores), and points GuideLLM's ``openai_http`` backend at it: ``/v1/completions``,
streamed, synthetic prompts of ``--prompt-tokens`` tokens (GuideLLM's own generator, counted with
the model's tokenizer) asking for ``--output-tokens`` tokens each (it sends ``ignore_eos``), at each
concurrency of ``--streams`` for ``--seconds`` seconds. GuideLLM runs from its own venv, never this
one (``make bench-clients`` makes it: ``.venv-guidellm``, the pinned GUIDELLM_VERSION and the CPU
torch wheel). Its raw JSON report goes to ``--out``; the summary printed (and written to
``--summary``) is read back from that report, nothing measured here: per concurrency, requests/s,
TTFT and ITL (median and p99, ms, over the requests that finished) and output tokens/s (every
token streamed in the window). The first ``warmup_s`` of each level are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from services.common.etcd_proc import free_port  # noqa: E402
from services.supervisor import start_stack  # noqa: E402


@dataclass(frozen=True, slots=True)
class Workload:
    prompt_tokens: int = 256
    output_tokens: int = 64
    streams: tuple[int, ...] = (1, 4, 16)
    seconds: float = 45.0  # per concurrency, warm-up included
    warmup_s: float = 5.0  # left out of the figures: the first requests of each level
    seed: int = 42


@dataclass(frozen=True, slots=True)
class Row:
    """One concurrency level as GuideLLM reported it."""

    streams: int
    requests: int
    errored: int
    requests_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    itl_ms_p50: float
    itl_ms_p99: float
    output_tokens_per_s: float


def scenario(w: Workload, target: str, model_name: str, tokenizer: Path, out: Path) -> dict[str, Any]:
    """GuideLLM's scenario file (``guidellm run --scenario``): every setting of the run in one place."""
    return {
        "spec": {
            "backend": {"kind": "openai_http", "target": target, "model": model_name,
                        "request_format": "/v1/completions", "stream": True, "timeout": 120.0},
            "profile": {"kind": "concurrent", "streams": list(w.streams),
                        "warmup": {"value": w.warmup_s, "mode": "duration"}},
            "constraints": [{"kind": "max_duration", "seconds": w.seconds}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "data": [{"kind": "synthetic_text", "prompt_tokens": w.prompt_tokens, "output_tokens": w.output_tokens}],
            "seed": {"kind": "static", "value": w.seed},
            # statistics of every request, but no prompt or output text kept: a report of ~100 KB
            "metrics": {"kind": "generative", "sample_size": 0},
            "outputs": [{"kind": "json", "path": str(out)}, {"kind": "console"}],
        }
    }  # fmt: skip


def _dig(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _stat(metrics: dict[str, Any], name: str, field: str, scope: str = "successful") -> float:
    """A statistic of a metric over the requests of ``scope`` (successful, total: with those cut off
    at the end of the window)."""
    m = metrics.get(name, {})
    m = m.get(scope, m)
    if field in ("p50", "p99"):
        v = _dig(m, "percentiles", field)
        if v is None and field == "p50":
            v = m.get("median")
    else:
        v = m.get(field)
    return float("nan") if v is None else float(v)


def summarize(report: dict[str, Any]) -> list[Row]:
    """The figures of each benchmark (one per concurrency) of GuideLLM's JSON report."""
    rows = []
    for b in report["benchmarks"]:
        metrics = b["metrics"]
        totals = _dig(metrics, "request_totals") or {}
        streams = _dig(b, "config", "strategy", "streams") or _dig(b, "scheduler_state", "strategy", "streams") or 0
        rows.append(Row(
            streams=int(streams),
            requests=int(totals.get("successful", 0)),
            errored=int(totals.get("errored", 0)),
            requests_per_s=_stat(metrics, "requests_per_second", "mean"),
            ttft_ms_p50=_stat(metrics, "time_to_first_token_ms", "p50"),
            ttft_ms_p99=_stat(metrics, "time_to_first_token_ms", "p99"),
            itl_ms_p50=_stat(metrics, "inter_token_latency_ms", "p50"),
            itl_ms_p99=_stat(metrics, "inter_token_latency_ms", "p99"),
            # every token streamed in the window, as GuideLLM's "Server Throughput" table counts them
            output_tokens_per_s=_stat(metrics, "output_tokens_per_second", "mean", "total"),
        ))  # fmt: skip
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| streams | requests (errors) | req/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | output tok/s |",
             "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.streams} | {r.requests} ({r.errored}) | {r.requests_per_s:.2f} | "
                     f"{r.ttft_ms_p50:.0f} / {r.ttft_ms_p99:.0f} | {r.itl_ms_p50:.1f} / {r.itl_ms_p99:.1f} | "
                     f"{r.output_tokens_per_s:.0f} |")  # fmt: skip
    return "\n".join(lines)


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def guidellm_version(guidellm: Path) -> str:
    out = subprocess.run([str(guidellm), "--version"], capture_output=True, text=True, check=True)
    return out.stdout.strip().rsplit(" ", 1)[-1]


def run(model: Path, guidellm: Path, w: Workload, out: Path, summary: Path, run_dir: Path,
        worker_threads: int = 1) -> list[Row]:
    version = guidellm_version(guidellm)
    print(f"GuideLLM {version} ({guidellm}) against Strata on {model}")
    up = start_stack(model.resolve(), free_port(), run_dir / "stack", http_port=free_port(),
                     worker_args=("--kv-cache-bytes", "512MiB", "--max-rows", "64", "--threads", str(worker_threads)),
                     say=lambda line: print("  " + line))  # fmt: skip
    try:
        target = up.child("tokenizer").extra["http"].removeprefix("http://").removesuffix("/v1")
        spec = scenario(w, f"http://{target}", model.name, model.resolve(), out.resolve())
        path = run_dir / "scenario.json"
        path.write_text(json.dumps(spec, indent=1))
        out.parent.mkdir(parents=True, exist_ok=True)
        # CPU seconds of the client and of each service over the run: on a small machine the client
        # takes its share of the same cores, and the figures are the whole system's.
        pids = {c.name: c.proc.pid for c in up.children if c.proc is not None}
        cpu0 = {n: _cpu_s(pid) for n, pid in pids.items()}
        client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        subprocess.run([str(guidellm), "run", "--scenario", str(path), "--disable-progress"], check=True,
                       cwd=run_dir)  # fmt: skip
        wall = time.perf_counter() - t0
        client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = {n: round(_cpu_s(pid) - cpu0[n], 1) for n, pid in pids.items()}
        cpu["guidellm"] = round(client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime, 1)
        load = (round(load0, 2), round(os.getloadavg()[0], 2))
    finally:
        up.stop()
    rows = summarize(json.loads(out.read_text()))
    summary.write_text(json.dumps({
        "tool": f"guidellm {version}", "model": model.name, "workload": asdict(w), "wall_s": round(wall, 1),
        "worker_threads": worker_threads, "cpu_s": cpu, "cores": os.cpu_count(), "loadavg_1m_start_end": load,
        "report": str(out.relative_to(ROOT)) if out.resolve().is_relative_to(ROOT) else str(out),
        "rows": [asdict(r) for r in rows],
    }, indent=1) + "\n")  # fmt: skip
    print(f"\nGuideLLM {version}, {w.prompt_tokens}-token prompts -> {w.output_tokens} tokens, "
          f"{w.seconds:g} s per concurrency ({wall:.0f} s in all):\n{table(rows)}")  # fmt: skip
    print(f"CPU seconds over the run ({os.cpu_count()} cores, 1-min load {load[0]} -> {load[1]}): "
          + ", ".join(f"{n} {s:g}" for n, s in cpu.items()))
    return rows


def main(argv: list[str] | None = None) -> int:
    d = Workload()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--guidellm", type=Path, required=True, help="the guidellm executable of its own venv")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--output-tokens", type=int, default=d.output_tokens)
    p.add_argument("--streams", default=",".join(map(str, d.streams)), help="concurrencies, comma-separated")
    p.add_argument("--seconds", type=float, default=d.seconds, help="per concurrency")
    p.add_argument("--worker-threads", type=int, default=1, help=(
        "the worker's torch threads; 0 = one per core. 1 by default: the client runs on the same cores, and "
        "a worker with a thread per core then waits on whichever of its threads the client preempts"))
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "guidellm.json")
    p.add_argument("--summary", type=Path, default=ROOT / "docs" / "bench" / "clients.json")
    p.add_argument("--run-dir", type=Path, default=None)
    a = p.parse_args(argv)
    w = Workload(a.prompt_tokens, a.output_tokens, tuple(int(s) for s in a.streams.split(",")), a.seconds)
    run_dir = a.run_dir or Path(tempfile.mkdtemp(prefix="strata-bench-clients-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = run(a.model, a.guidellm, w, a.out, a.summary, run_dir, a.worker_threads)
    return 0 if rows and all(r.requests and not r.errored for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
