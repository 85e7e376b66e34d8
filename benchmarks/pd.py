"""Prefill/decode disaggregation against two co-located replicas: decode ITL under long prompts.

    make bench-pd        (python -m benchmarks.pd --model models/qwen3-bench)

Three stacks on the same machine, alternated ``--repeats`` times: **pd** (``strata up
--prefill-replicas 1 --decode-replicas 1``: one replica prefills, hands each request over through
the kvstore after its first token, the other decodes), **pd-direct** (the same, with
``--handoff-outbox-bytes``: the decode worker reads the pages straight from the prefill worker's
outbox) and **colocated** (``--replicas 2``: both prefill and decode, the router spreading
requests by cache and load). All with the hierarchical cache on (host pool + kvstore), greedy,
``ignore_eos``.

Each run: ``--streams`` decode streams (``--short-len``-token prompts, ``--stream-tokens`` out,
each restarted when it ends) run for ``--phase-s`` seconds alone (**quiet**), then for
``--phase-s`` more while a ``--long-len``-token prompt (``--long-tokens`` out) arrives every
``--interval-s`` (**burst**). Reported per configuration, median over repeats: the decode
streams' inter-token latency p50 / p99 in each phase (gaps between a stream's token messages,
divided by the tokens in the later one; from the second token on), the gap after each stream's
first token apart (with PD: the hand-over), the burst / quiet ratio of p99 (the issue's goal: PD's
<= 1.5), the long prompts' TTFT and the gap after their first token (the hand-over's cost with
PD), the prefill scheduler's wait from a first token to the hand-over (the prompt's pages stored:
``handoff_seconds``), bytes moved between processes per long-prompt token (host pages put to L3 +
pages read back, from the schedulers' ``hicache_events``; the decode streams' pages count too; a
put into the prefill worker's own outbox is a copy in its memory and does not count), and each
process's CPU.

On a 2-core machine both replicas share the same cores in both configurations: what PD can
separate is the step (a decode step never waits for a prefill chunk), not the processors, unless
``--pin`` gives each replica's worker cores of its own (the workers' ``--cpus``: one core each on
2 cores, as a device each would on a GPU host; the other services are not pinned). ``--threads``
sets each replica's forward threads instead (``strata up --worker-threads``; "0;1": replica 1, the
decode one with PD, on one thread, replica 0 on every core), the same list in every configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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

import grpc  # noqa: E402
import torch  # noqa: E402

from benchmarks.gpu_step import kv_slot_bytes  # noqa: E402
from services.common.etcd_proc import free_port  # noqa: E402
from services.supervisor import Stack, start_stack  # noqa: E402
from strata.v1 import strata_pb2 as pb  # noqa: E402
from strata.v1 import strata_pb2_grpc as pgrpc  # noqa: E402

CONFIGS = ("pd", "pd-direct", "colocated")
HOST_PAGE_TOKENS = 64
GOAL_P99_RATIO = 1.5  # issue #31: PD's ITL p99 under the burst over its quiet ITL p99


@dataclass(frozen=True, slots=True)
class Config:
    model: Path
    streams: int = 8
    short_len: int = 64
    stream_tokens: int = 64
    long_len: int = 4096
    long_tokens: int = 8
    interval_s: float = 1.0
    phase_s: float = 20.0
    repeats: int = 2
    kv_cache_bytes: str = "512MiB"
    host_cache_bytes: str = "1GiB"
    max_prefill_tokens: int = 2048
    pin: str = ""  # "0;1": replica 0's worker (PD: the prefill one) on CPU 0, replica 1's on CPU 1
    threads: str = ""  # "0;1": replica 0's worker on every core (0), replica 1's (PD: the decode one) on one thread
    device: str = "cpu"  # the workers' --device: on a lent GPU machine both share the one GPU


@dataclass(slots=True)
class Run:
    config: str
    repeat: int
    itl_quiet_ms: dict[str, float] = field(default_factory=dict)  # p50, p99
    itl_burst_ms: dict[str, float] = field(default_factory=dict)
    p99_ratio: float = 0.0
    stream_second_token_ms: float = 0.0  # median gap after a decode stream's first token (PD: the hand-over)
    long_requests: int = 0
    long_ttft_ms: float = 0.0  # median
    long_second_token_ms: float = 0.0  # median gap after the first token (PD: the hand-over)
    kv_bytes_per_long_token: float = 0.0
    handoff_wait_ms: float = 0.0  # mean, prefill scheduler: first token -> pages stored (PD only)
    decode_tokens: int = 0
    failed: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _stack(cfg: Config, name: str, run_dir: Path) -> Stack:
    worker = ("--kv-cache-bytes", cfg.kv_cache_bytes, "--host-cache-bytes", cfg.host_cache_bytes, "--l3", "true",
              "--device", cfg.device)
    scheduler = ("--max-prefill-tokens", str(cfg.max_prefill_tokens))
    roles = ("prefill", "decode") if name.startswith("pd") else ()
    own: list[tuple[str, ...]] = [("--cpus", c) for c in cfg.pin.split(";")] if cfg.pin else [(), ()]
    for i, t in enumerate(cfg.threads.split(";") if cfg.threads else ()):
        own[i] += ("--threads", t)
    if name == "pd-direct":  # replica 0 prefills
        own[0] += ("--outbox-bytes", cfg.host_cache_bytes)
    return start_stack(cfg.model, free_port(), run_dir / name, worker_args=worker, scheduler_args=scheduler,
                       common_args=("--metrics-port", "0"), replicas=2, roles=roles, replica_worker_args=own,
                       say=lambda _: None)  # fmt: skip


def _scheduler_metrics(stack: Stack, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{stack.child(name).extra['metrics']}/metrics", timeout=5).read()
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.decode().splitlines() if ln[:1] != "#")}


def _moved(stack: Stack, name: str) -> tuple[float, float, float]:
    """(host pages moved between processes, hand-overs' summed wait in s, hand-overs) so far, over
    both schedulers (their cumulative ``hicache_events`` and ``handoff_seconds``). The "scheduler"
    replica is the prefill one; with ``pd-direct`` its puts stay in its worker's outbox."""
    pages = wait = count = 0.0
    for sched in ("scheduler", "scheduler-1"):
        m = _scheduler_metrics(stack, sched)
        pages += m.get('strata_scheduler_hicache_events_total{event="prefetched_pages"}', 0.0)
        if not (name == "pd-direct" and sched == "scheduler"):
            pages += m.get('strata_scheduler_hicache_events_total{event="put_pages"}', 0.0)
        wait += m.get("strata_scheduler_handoff_seconds_sum", 0.0)
        count += m.get("strata_scheduler_handoff_seconds_count", 0.0)
    return pages, wait, count


def _cpu(stack: Stack) -> dict[str, float]:
    import psutil

    out = {}
    for child in stack.children:
        if child.proc is not None and child.proc.poll() is None:
            t = psutil.Process(child.proc.pid).cpu_times()
            out[child.name] = t.user + t.system
    return out


async def _one(stub: pgrpc.StrataStub, ids: list[int], n: int) -> list[tuple[float, int]]:
    """(arrival time, tokens) of each message of a greedy stream of ``n`` tokens."""
    sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    req = pb.GenerateRequest(input_ids=pb.TokenIds(ids=ids), stream=True, sampling=sampling)
    out = [(time.perf_counter(), 0)]
    async for m in stub.Generate(req, timeout=600):
        if m.token_ids:
            out.append((time.perf_counter(), len(m.token_ids)))
    return out


async def _measure(cfg: Config, stack: Stack, name: str, repeat: int, rng: random.Random) -> Run:
    run = Run(name, repeat)
    vocab = json.loads((cfg.model / "config.json").read_text())["vocab_size"]
    ids = lambda n: [rng.randrange(3, min(vocab, 8000)) for _ in range(n)]  # noqa: E731
    t0 = time.perf_counter()
    burst_at, end_at = t0 + cfg.phase_s, t0 + 2 * cfg.phase_s
    gaps: dict[str, list[float]] = {"quiet": [], "burst": []}
    second: list[float] = []  # each decode stream's gap after its first token (PD: the hand-over)
    longs: list[list[tuple[float, int]]] = []
    cpu0, moved0 = _cpu(stack), _moved(stack, name)
    async with grpc.aio.insecure_channel(stack.child("tokenizer").address) as ch:
        stub = pgrpc.StrataStub(ch)

        async def stream_loop() -> None:
            while time.perf_counter() < end_at:
                try:
                    msgs = await _one(stub, ids(cfg.short_len), cfg.stream_tokens)
                except grpc.aio.AioRpcError:
                    run.failed += 1
                    continue
                run.decode_tokens += sum(n for _, n in msgs)
                if len(msgs) > 2:
                    second.append(msgs[2][0] - msgs[1][0])
                for (ta, _), (tb, n) in itertools.pairwise(msgs[2:]):  # decoding (the first gap: above)
                    gaps["burst" if ta >= burst_at else "quiet"].append((tb - ta) / n)

        async def burst_loop() -> None:
            await asyncio.sleep(max(burst_at - time.perf_counter(), 0))
            tasks = []
            while time.perf_counter() < end_at - cfg.interval_s:
                tasks.append(asyncio.create_task(_one(stub, ids(cfg.long_len), cfg.long_tokens)))
                await asyncio.sleep(cfg.interval_s)
            for t in tasks:
                try:
                    longs.append(await t)
                except grpc.aio.AioRpcError:
                    run.failed += 1

        await asyncio.gather(burst_loop(), *(stream_loop() for _ in range(cfg.streams)))
    cpu1 = _cpu(stack)
    run.cpu_s = {k: round(cpu1[k] - cpu0.get(k, 0.0), 2) for k in cpu1}
    for phase, out in (("quiet", run.itl_quiet_ms), ("burst", run.itl_burst_ms)):
        out |= {"p50": _pct(gaps[phase], 0.5) * 1e3, "p99": _pct(gaps[phase], 0.99) * 1e3}
    run.p99_ratio = run.itl_burst_ms["p99"] / run.itl_quiet_ms["p99"] if run.itl_quiet_ms["p99"] else 0.0
    run.stream_second_token_ms = statistics.median(second) * 1e3 if second else 0.0
    run.long_requests = len(longs)
    if longs:
        run.long_ttft_ms = statistics.median(m[1][0] - m[0][0] for m in longs if len(m) > 1) * 1e3
        seconds = [m[2][0] - m[1][0] for m in longs if len(m) > 2]
        run.long_second_token_ms = statistics.median(seconds) * 1e3 if seconds else 0.0
        config = json.loads((cfg.model / "config.json").read_text())
        page_bytes = HOST_PAGE_TOKENS * kv_slot_bytes(config, torch.float32)
        moved1 = _moved(stack, name)
        run.kv_bytes_per_long_token = (moved1[0] - moved0[0]) * page_bytes / (len(longs) * cfg.long_len)
        if moved1[2] > moved0[2]:
            run.handoff_wait_ms = (moved1[1] - moved0[1]) / (moved1[2] - moved0[2]) * 1e3
    return run


def table(runs: list[Run]) -> str:
    rows = ["| config | ITL p50 quiet / burst ms | ITL p99 quiet / burst ms | p99 burst / quiet | long TTFT ms | "
            "gap after 1st token ms: streams / long | hand-over wait ms | bytes moved per long-prompt token | "
            "decode tokens | failed |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in CONFIGS:
        rs = [r for r in runs if r.config == name]
        if not rs:
            continue

        def med(f: Any, rs: list[Run] = rs) -> float:
            return statistics.median(f(r) for r in rs)

        ratios = sorted(r.p99_ratio for r in rs)
        rows.append(
            f"| {name} | {med(lambda r: r.itl_quiet_ms['p50']):.1f} / {med(lambda r: r.itl_burst_ms['p50']):.1f} | "
            f"{med(lambda r: r.itl_quiet_ms['p99']):.1f} / {med(lambda r: r.itl_burst_ms['p99']):.1f} | "
            f"{med(lambda r: r.p99_ratio):.2f} ({ratios[0]:.2f}–{ratios[-1]:.2f}) | "
            f"{med(lambda r: r.long_ttft_ms):.0f} | "
            f"{med(lambda r: r.stream_second_token_ms):.0f} / {med(lambda r: r.long_second_token_ms):.0f} | "
            f"{med(lambda r: r.handoff_wait_ms):.0f} | {med(lambda r: r.kv_bytes_per_long_token):.0f} | "
            f"{med(lambda r: r.decode_tokens):.0f} | {sum(r.failed for r in rs)} |"
        )  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Config(Path())
    p.add_argument("--model", type=Path, default=ROOT / "models" / "qwen3-bench")
    for name in ("streams", "short_len", "stream_tokens", "long_len", "long_tokens", "repeats", "max_prefill_tokens"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("interval_s", "phase_s"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--kv-cache-bytes", default=d.kv_cache_bytes)
    p.add_argument("--host-cache-bytes", default=d.host_cache_bytes)
    p.add_argument("--pin", default="", help="each replica's worker on CPUs of its own, as the worker's --cpus "
                   "lists separated by ';' (replica 0 first: the prefill one with PD), e.g. '0;1'; default: not pinned")
    p.add_argument("--threads", default="", help="each replica's worker's forward threads, ';'-separated (replica 0 "
                   "first), e.g. '0;1' (0: one per core); default: every worker one per core")
    p.add_argument("--only", choices=CONFIGS, default=None, help="one configuration")
    p.add_argument("--out", type=Path, default=None, help="write the runs as JSON here")
    p.add_argument("--run-dir", type=Path, default=None, help="the services' logs (default: a temporary folder)")
    p.add_argument("--device", default=d.device, help="the workers' --device (cpu, cuda: both on the one GPU)")
    a = p.parse_args(argv)
    cfg = Config(a.model, a.streams, a.short_len, a.stream_tokens, a.long_len, a.long_tokens, a.interval_s,
                 a.phase_s, a.repeats, a.kv_cache_bytes, a.host_cache_bytes, a.max_prefill_tokens, a.pin,
                 a.threads, a.device)  # fmt: skip
    run_dir = a.run_dir or Path(tempfile.mkdtemp(prefix="strata-pd-"))
    names = [a.only] if a.only else list(CONFIGS)
    runs: list[Run] = []
    rng = random.Random(0)
    for repeat in range(cfg.repeats):
        for name in names if repeat % 2 == 0 else reversed(names):  # A B B A: alternated
            print(f"[pd] {name} #{repeat + 1}: starting the stack (logs in {run_dir / name})", flush=True)
            stack = _stack(cfg, name, run_dir)
            try:
                asyncio.run(_measure(cfg, stack, name, repeat, random.Random(rng.random())))  # warm-up, unrecorded
                run = asyncio.run(_measure(cfg, stack, name, repeat, random.Random(rng.random())))
            finally:
                stack.stop()
            runs.append(run)
            print(f"[pd] {name} #{repeat + 1}: ITL p99 quiet {run.itl_quiet_ms['p99']:.1f} ms, burst "
                  f"{run.itl_burst_ms['p99']:.1f} ms ({run.p99_ratio:.2f}x); {run.long_requests} long prompts, "
                  f"TTFT {run.long_ttft_ms:.0f} ms, failed {run.failed}", flush=True)  # fmt: skip
            if a.out is not None:  # after every run: a cut-off bench keeps what it measured
                a.out.parent.mkdir(parents=True, exist_ok=True)
                a.out.write_text(json.dumps({"config": {k: str(v) for k, v in asdict(cfg).items()},
                                             "runs": [asdict(r) for r in runs]}, indent=1) + "\n")  # fmt: skip
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
