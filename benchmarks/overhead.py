"""The control plane's cost per output token: CPU of each process on the token path, per token.

    make bench-overhead        (python benchmarks/overhead.py --model models/qwen3-null)

A near-null model (``strata model tiny --size null``: one layer of width 64) makes the forward
almost free, so what a served token costs is the token path itself: the tokenizer (gRPC and
OpenAI HTTP fronts, detokenization), the scheduler (planning, commits, streaming to the
tokenizer) and the worker (step decoding, bookkeeping, sampling, the result). One stack serves
``--streams`` concurrent greedy streams of ``--tokens`` tokens each (``ignore_eos``), through the
gRPC front and through the HTTP front (the streamed ``/v1/completions`` of the official ``openai``
client), alternated, ``--repeats`` times each.

For each run: CPU seconds (user + system, from /proc via psutil) of every service and of the
client during the run, divided by the output tokens; output tokens/s; the mean step time (the
scheduler's steps in the run over the run's wall time). The goal (issue #26, DESIGN §7) is
≤ 30 µs of CPU per output token in each of worker, scheduler and tokenizer.

``--profile DIR``: one more gRPC and one HTTP run under ``py-spy record`` (every service at once,
``--format raw``), with the top self-time frames of each service printed and written beside.
Writes ``--out`` (JSON) and prints a markdown table of medians (min–max).

``--front-processes N``: the tokenizer serves its ports from N processes (its
``--front-processes``); its CPU is then their sum, and ``tokenizer_each`` each one's, per output
token of the whole run. ``--client-processes K``: the streams are split over K client processes
(8 gRPC channels each, so that connections spread over the front processes), where one client
process would be the limit (a host with many cores); the client's CPU is their sum.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import psutil  # noqa: E402

from services.bench.metrics import summarize  # noqa: E402
from services.bench.openai_backend import OpenAIBackend  # noqa: E402
from services.bench.runner import GrpcBackend, replay  # noqa: E402
from services.bench.servers import CpuMeter  # noqa: E402
from services.bench.workloads import RandomSpec, Workload, random_workload  # noqa: E402

SERVICES = ("tokenizer", "scheduler", "worker")
GOAL_US = 30.0
CLIENT_CHANNELS = 8  # gRPC channels (connections) per client process, with --client-processes > 1


@dataclass(frozen=True, slots=True)
class Config:
    model: Path
    streams: int = 256
    tokens: int = 256
    prompt_len: int = 32
    repeats: int = 3
    out: Path | None = None
    profile: Path | None = None
    run_dir: Path | None = None
    fronts: int = 1
    clients: int = 1
    only: tuple[str, ...] = ("grpc", "http")  # the fronts measured, in this order


@dataclass(slots=True)
class Run:
    front: str  # "grpc" | "http"
    repeat: int
    output_tokens: int
    failed: int
    duration_s: float
    tokens_per_s: float
    steps: int
    step_ms: float
    ttft_p50_ms: float
    itl_p50_ms: float
    cpu_us_per_token: dict[str, float] = field(default_factory=dict)
    tokenizer_each: list[float] = field(default_factory=list)  # each front process's µs per output token


async def _steps(stub: Any) -> int:
    from strata.scheduler.v1 import scheduler_pb2 as spb

    return int((await stub.GetLoad(spb.GetLoadRequest())).steps)


def _backend(front: str, target: str, model: str, channels: int = 1) -> GrpcBackend | OpenAIBackend:
    if front == "grpc":
        return GrpcBackend(target, "gRPC", channels)
    return OpenAIBackend(target, model, "HTTP", extra_body={"ignore_eos": True})


def _shard(front: str, target: str, model: str, workload: Workload, concurrency: int) -> tuple[list[Any], float, float]:
    """In a client process: replay ``workload``; its records and its start and end (monotonic
    clock, which every process on the host shares)."""

    async def run() -> tuple[list[Any], float]:
        backend = _backend(front, target, model, CLIENT_CHANNELS)
        try:
            return await replay(backend, workload, concurrency, None, 600.0)
        finally:
            await backend.close()

    start = time.perf_counter()
    records, _ = asyncio.run(run())
    return records, start, time.perf_counter()


class Load:
    """The client side: this process's backends, or ``clients`` processes each replaying a share."""

    def __init__(self, cfg: Config, targets: dict[str, str]) -> None:
        self.cfg = cfg
        self.targets = targets
        self.backends = {f: _backend(f, t, cfg.model.name) for f, t in targets.items()} if cfg.clients == 1 else {}
        ctx = multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(cfg.clients, mp_context=ctx) if cfg.clients > 1 else None

    def pids(self) -> dict[str, int]:
        """The client processes (started on first use: call after ``warm_up``)."""
        procs = getattr(self.pool, "_processes", None) or {}
        return {f"client-{i + 1}": pid for i, pid in enumerate(sorted(procs))}

    async def warm_up(self, vocab: int) -> None:
        """Every stream at once for a few tokens, through each front: the decode batches of the
        runs (on a GPU: their CUDA graphs recorded and Triton kernels compiled) happen here first.
        With 32 small requests the first run on a fresh GPU machine ran slower (docs/benchmarks.md)."""
        spec = RandomSpec(count=self.cfg.streams, input_len=self.cfg.prompt_len, output_len=4)
        for front in self.targets:
            await self.replay(front, random_workload(spec, vocab, seed=7))

    async def replay(self, front: str, workload: Workload) -> tuple[list[Any], float]:
        if self.pool is None:
            return await replay(self.backends[front], workload, self.cfg.streams, None, 600.0)
        k = self.cfg.clients
        shards = [dataclasses.replace(workload, conversations=workload.conversations[i::k]) for i in range(k)]
        loop = asyncio.get_running_loop()
        done = await asyncio.gather(*(
            loop.run_in_executor(self.pool, _shard, front, self.targets[front], self.cfg.model.name, w,
                                 max(self.cfg.streams // k, 1))
            for w in shards
        ))  # fmt: skip
        records = [r for recs, _, _ in done for r in recs]
        return records, max(end for _, _, end in done) - min(start for _, start, _ in done)

    async def close(self) -> None:
        for b in self.backends.values():
            await b.close()
        if self.pool is not None:
            self.pool.shutdown()


async def measure(cfg: Config, front: str, load: Load, meter: CpuMeter, sched: Any, repeat: int) -> Run:
    vocab = json.loads((cfg.model / "config.json").read_text())["vocab_size"]
    spec = RandomSpec(count=cfg.streams, input_len=cfg.prompt_len, output_len=cfg.tokens)
    workload = random_workload(spec, vocab, seed=1000 * repeat + (front == "http"))
    steps0, cpu0 = await _steps(sched), meter.read()
    records, duration = await load.replay(front, workload)
    cpu1, steps1 = meter.read(), await _steps(sched)
    m = summarize(f"{front} #{repeat + 1}", records, duration)
    out = max(m.output_tokens, 1)
    steps = steps1 - steps0
    each = {k: (cpu1[k] - cpu0[k]) / out * 1e6 for k in cpu1}
    cpu = {s: sum(v for k, v in each.items() if k == s or k.startswith(f"{s}-")) for s in (*SERVICES, "client")}
    return Run(
        front=front, repeat=repeat, output_tokens=m.output_tokens, failed=m.failed, duration_s=duration,
        tokens_per_s=m.output_throughput, steps=steps, step_ms=duration / max(steps, 1) * 1e3,
        ttft_p50_ms=m.ttft_s.median * 1e3 if m.ttft_s else float("nan"),
        itl_p50_ms=m.itl_s.median * 1e3 if m.itl_s else float("nan"),
        cpu_us_per_token=cpu,
        tokenizer_each=[v for k, v in sorted(each.items()) if k == "tokenizer" or k.startswith("tokenizer-")],
    )  # fmt: skip


def _spread(values: list[float], fmt: str = ".0f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})" if values else "–"


def table(runs: list[Run]) -> str:
    """Medians (min–max) per front; with several front processes, the busiest one's µs per token."""
    several = any(len(r.tokenizer_each) > 1 for r in runs)
    rows = [
        "| front | output tok/s | step ms | TTFT p50 ms | ITL p50 ms | "
        + " | ".join(f"{s} µs/token" for s in (*SERVICES, "client"))
        + (" | busiest front process µs/token |" if several else " |"),
        "|---|---|---|---|---|" + "---|" * (len(SERVICES) + 1 + several),
    ]
    for front in ("grpc", "http"):
        rs = [r for r in runs if r.front == front]
        if not rs:
            continue
        cells = [
            _spread([r.tokens_per_s for r in rs]), _spread([r.step_ms for r in rs], ".1f"),
            _spread([r.ttft_p50_ms for r in rs]), _spread([r.itl_p50_ms for r in rs], ".1f"),
            *(_spread([r.cpu_us_per_token.get(s, 0.0) for r in rs]) for s in (*SERVICES, "client")),
            *([_spread([max(r.tokenizer_each, default=0.0) for r in rs])] if several else []),
        ]  # fmt: skip
        rows.append(f"| {front} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _top_frames(raw: Path, n: int = 15) -> list[tuple[str, float]]:
    """Self time of the ``n`` hottest leaf frames of a py-spy ``--format raw`` file (fraction of samples)."""
    leaves: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        leaves[leaf] += int(count)
        total += int(count)
    return [(frame, c / max(total, 1)) for frame, c in leaves.most_common(n)]


async def profiled(cfg: Config, front: str, load: Load, meter: CpuMeter, sched: Any,
                   pids: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    """One run with py-spy recording every service; returns each service's top frames."""
    assert cfg.profile is not None
    cfg.profile.mkdir(parents=True, exist_ok=True)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    procs = {
        name: subprocess.Popen(
            [
                spy,
                "record",
                "--format",
                "raw",
                "--rate",
                "200",
                "--nonblocking",
                "-p",
                str(pid),
                "-o",
                str(cfg.profile / f"{front}-{name}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    }
    await asyncio.sleep(1.0)
    run = await measure(cfg, front, load, meter, sched, 99)
    for p in procs.values():
        p.send_signal(2)  # SIGINT: py-spy writes its file and exits
    for p in procs.values():
        p.wait(30)
    out: dict[str, Any] = {"run": asdict(run)}
    for name in pids:
        raw = cfg.profile / f"{front}-{name}.txt"
        if raw.exists():
            out[name] = _top_frames(raw)
    return out


async def bench(cfg: Config, grpc_addr: str, http: str, sched_addr: str, pids: dict[str, int]) -> dict[str, Any]:
    from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc

    channel = grpc.aio.insecure_channel(sched_addr)
    sched = sgrpc.SchedulerStub(channel)
    vocab = json.loads((cfg.model / "config.json").read_text())["vocab_size"]
    load = Load(cfg, {f: {"grpc": grpc_addr, "http": http}[f] for f in cfg.only})
    try:
        await load.warm_up(vocab)
        meter = CpuMeter({**pids, **load.pids()})
        runs: list[Run] = []
        for i in range(cfg.repeats):
            for front in load.targets:
                r = await measure(cfg, front, load, meter, sched, i)
                runs.append(r)
                cpu = ", ".join(f"{k} {v:.0f}" for k, v in r.cpu_us_per_token.items())
                each = f" (each front: {', '.join(f'{v:.0f}' for v in r.tokenizer_each)})" if cfg.fronts > 1 else ""
                print(f"  {front} #{i + 1}: {r.output_tokens} tokens ({r.failed} failed) in {r.duration_s:.1f}s, "
                      f"{r.tokens_per_s:.0f} tok/s, step {r.step_ms:.1f} ms; CPU µs/token: {cpu}{each}",
                      flush=True)  # fmt: skip
        profiles = {}
        if cfg.profile is not None:
            for front in load.targets:
                profiles[front] = await profiled(cfg, front, load, meter, sched, pids)
    finally:
        await load.close()
        await channel.close()
    return {"runs": [asdict(r) for r in runs], "profiles": profiles}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "qwen3-null")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the runs as JSON here")
    p.add_argument("--profile", type=Path, default=None, help="py-spy every service in one more run per front")
    p.add_argument("--run-dir", type=Path, default=None, help="the services' logs (default: a temporary folder)")
    p.add_argument("--worker-arg", action="append", default=[], help="an extra worker flag (repeatable)")
    p.add_argument("--front-processes", type=int, default=1, help="the tokenizer's --front-processes")
    p.add_argument("--client-processes", type=int, default=1, help="client processes sharing the streams")
    p.add_argument("--fronts", default="grpc,http", help="the fronts measured, comma-separated: grpc, http")
    a = p.parse_args(argv)
    if a.front_processes < 1 or a.client_processes < 1:
        p.error("--front-processes and --client-processes must be >= 1")
    only = tuple(dict.fromkeys(f.strip() for f in a.fronts.split(",") if f.strip()))
    if not only or any(f not in ("grpc", "http") for f in only):
        p.error(f"--fronts: {a.fronts!r} names none or other than grpc, http")
    cfg = Config(a.model, a.streams, a.tokens, a.prompt_len, a.repeats, a.out, a.profile, a.run_dir,
                 a.front_processes, a.client_processes, only)  # fmt: skip

    from services.common.etcd_proc import free_port
    from services.supervisor import start_stack

    run_dir = cfg.run_dir or Path(tempfile.mkdtemp(prefix="strata-overhead-"))
    slots = cfg.streams * (cfg.prompt_len + cfg.tokens + 64)
    st = start_stack(
        cfg.model, free_port(), run_dir, http_port=free_port(),
        worker_args=("--max-rows", str(cfg.streams), "--kv-cache-bytes", str(max(slots * 1024, 64 << 20)),
                     *a.worker_arg),
        scheduler_args=("--max-running", str(cfg.streams), "--max-waiting", str(4 * cfg.streams)),
        tokenizer_args=("--front-processes", str(cfg.fronts)),
        say=lambda line: print("  " + line, flush=True), grammar_preload=False,
    )  # fmt: skip
    t0 = time.perf_counter()
    try:
        tok = st.child("tokenizer")
        http = "http://" + tok.extra["http"].removeprefix("http://").removesuffix("/v1") + "/v1"
        pids = {n: proc.pid for n in SERVICES if (proc := st.child(n).proc)}
        fronts = psutil.Process(pids["tokenizer"]).children()
        pids |= {f"tokenizer-{i + 1}": p.pid for i, p in enumerate(sorted(fronts, key=lambda p: p.pid))}
        result = asyncio.run(bench(cfg, tok.address, http, st.child("scheduler").address, pids))
    finally:
        st.stop()
    runs = [Run(**r) for r in result["runs"]]
    print()
    print(f"{cfg.streams} streams × {cfg.tokens} tokens on {cfg.model.name}, {cfg.repeats} alternated repeats, "
          f"median (min–max); goal ≤ {GOAL_US:.0f} µs of CPU per output token per service")  # fmt: skip
    print(table(runs))
    for front, prof in result["profiles"].items():
        for name in SERVICES:
            print(f"\npy-spy, {front}, {name}: top self-time frames")
            for frame, share in prof.get(name, [])[:10]:
                print(f"  {share * 100:5.1f}%  {frame}")
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"config": {k: str(v) for k, v in asdict(cfg).items()}, "elapsed_s": time.perf_counter() - t0}
        cfg.out.write_text(json.dumps({**meta, **result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
