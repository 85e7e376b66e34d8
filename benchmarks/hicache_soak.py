"""Hierarchical-cache soak (issue #7): a multi-turn load with the L3 tier on, repeated; the RSS of
every service must stay flat after warm-up and the kvstore must stay under its cap.

    python -m benchmarks.hicache_soak --model models/qwen3-tiny [--clients 24] [--rounds 12]
        [--request-tokens 2048] [--parallel 0] [--repetitions 20] [--warmup 4]
        [--device-tokens 8192] [--host-tokens 16384] [--l3-tokens 65536] [--out docs/bench/hicache_soak.json]

The load has bench_multiturn's shape: ``clients`` conversations run concurrently for ``rounds``
rounds each; a round's prompt is the previous prompt, its answer and ``turn_tokens`` new user
tokens (token ids, so lengths are exact), and asks for ``max_new_tokens`` (1). A conversation that
would pass ``request_tokens`` (prompt + output) starts over. Each repetition draws new token ids,
so the kvstore keeps receiving new keys: whatever any tier keeps per key must be bounded by its
eviction, which is what the soak checks.

Pools are sized in tokens against one repetition's working set (``clients × request_tokens``):
the device and host pools are a fraction of it (both evict, so prefixes come back from L3 through
the lookup, prefetch and host load), the kvstore holds ``l3_tokens`` (a bit more than one
repetition: it evicts from the second on and reaches its RSS plateau within the warm-up).

After each repetition and a short settle (trailing backups and puts): the RSS of each service
process and the kvstore's Stats; during the load the Stats are also polled every ``POLL_S``. The
report gives, per service, over the samples after ``warmup`` repetitions: the least-squares slope
of RSS (MiB per hour and per 1,000 requests) and its growth (median of the last third minus median
of the first third), judged against the load's bars (``FULL_BARS_MIB``, ``SCALED_BARS_MIB``); and
the kvstore's largest used bytes against its cap. Writes ``--out`` (JSON) and prints a markdown
table; exits 1 unless every request completed, the kvstore stayed under its cap and every service
was flat. A repetition with failed requests (a stalled server) ends the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import psutil

from services.common.etcd_proc import free_port
from services.kvstore.backends import BackendStats
from services.kvstore.client import KVStoreClient
from services.supervisor import Stack, start_stack
from services.worker.tiny import WORDS
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc
from strata.worker.v1 import worker_pb2 as wpb
from strata.worker.v1 import worker_pb2_grpc as wgrpc

MiB = 1 << 20
SERVICES = ("kvstore", "worker", "scheduler", "tokenizer")
FIRST_ID = 3  # prompts avoid the low ids (pad, bos, eos of the tiny models)
POLL_S = 0.25


# Flatness bars on ``Trend.growth_mib``, per service, set from the noise of clean runs on a shared
# 2-core box (~2x the worst growth seen): a median of thirds rather than last minus first, so one
# allocator step or trim at an end of the window does not decide the verdict.
#
# Scaled load (tests/services/test_hicache_soak.py, 512-token requests): the Python services' growth stayed
# within ±1.8 MiB (7 runs of 20-40 repetitions; kvstore: its 4 MiB of pages churn through pymalloc
# and glibc arenas; scheduler +0.1..+0.2; tokenizer ±0.2). The worker moved in glibc heap steps
# (+4.2 MiB, or -24 MiB when it trimmed) until issue #19 (one engine thread, 2 arenas, a periodic
# trim: see services/worker/host_malloc.py); since, +0.16 and +0.34 MiB (dense, hybrid).
SCALED_BARS_MIB = {"kvstore": 4.0, "worker": 6.0, "scheduler": 4.0, "tokenizer": 4.0}
# Full load (24 x 12 x 2,048 tokens, warm-up 4): before issue #19 the worker's RSS after a
# repetition scattered over 65-93 MiB and its growth was +8.5..+32 MiB (5 runs of 13-34
# repetitions; +11.8 MiB in the 10-minute run of docs/benchmarks.md); with one engine thread and 2
# arenas +5.2 MiB. kvstore scatter ~16 MiB around its 64 MiB of pages, growth -0.7..+6.2; tokenizer
# -1.7..+3.2; scheduler +0.5..+1.2. What they catch: the thirds' medians are ~11 repetitions
# (~3,200 requests, ~8,000 kvstore puts) apart, so 24 MiB is 7.7 KiB per request, 10 MiB is 1.3 KiB
# per page put, 4 MiB is 1.3 KiB per request; the L3 leak of issue #7 (~10 GB/hour) is ~100 KiB
# per request here.
FULL_BARS_MIB = {"kvstore": 10.0, "worker": 24.0, "scheduler": 4.0, "tokenizer": 12.0}
# Issue #19's bars on the slope over the last half of a run of --minutes (an hour): a flat
# process, not only one whose thirds agree.
HOUR_SLOPE_BARS = {"kvstore": 10.0, "worker": 20.0, "scheduler": 10.0, "tokenizer": 10.0}


@dataclass(frozen=True, slots=True)
class SoakConfig:
    clients: int = 24
    rounds: int = 12
    request_tokens: int = 2048  # prompt + output cap of one request
    max_new_tokens: int = 1
    parallel: int = 0  # requests in flight at once (bench_multiturn's --max-parallel); 0 = every client
    repetitions: int = 20
    warmup: int = 4  # repetitions before the measured window
    device_tokens: int = 8192  # worker KV pool (~1/6 of one repetition's working set)
    host_tokens: int = 16384  # host pool (~1/3)
    l3_tokens: int = 65536  # kvstore cap (~1.3x: evicts from the second repetition on)
    host_page_tokens: int = 64
    settle_s: float = 1.0  # after a repetition, before sampling: trailing backups and puts
    request_timeout_s: float = 300.0  # a request not finished by then is an error (a stall, not slowness)
    bars_mib: dict[str, float] = field(default_factory=lambda: dict(FULL_BARS_MIB))  # see FULL_BARS_MIB
    # Bars on the RSS slope over the last half of the run, MiB per hour (empty: not judged). Only
    # a long run makes an hourly slope meaningful: a 4 MiB allocator step in a 30 s run is 480 MiB/h.
    slope_bars_mib_per_hour: dict[str, float] = field(default_factory=dict)
    minutes: float = 0.0  # > 0: repeat until this long has passed (repetitions is then ignored)
    worker_threads: int = 0  # the worker's intra-op threads (0 = torch's default: one per core)
    seed: int = 0
    # Chat messages of English words instead of token ids: the tokenizer's text path (chat template,
    # tokenization, incremental detokenization of every answer) carries the load. Lengths are then
    # approximate: a turn has turn_tokens / 2 words, and a conversation starts over once the last
    # prompt's real token count plus twice the new words would pass prompt_cap.
    text: bool = False
    l3: bool = True  # False: the host pool only, no kvstore traffic (to split a growth by caller)

    def __post_init__(self) -> None:
        if min(self.clients, self.rounds, self.max_new_tokens, self.repetitions) < 1:
            raise ValueError("clients, rounds, max_new_tokens and repetitions must be >= 1")
        if self.parallel < 0:
            raise ValueError("parallel must be >= 0 (0 = every client at once)")
        if self.minutes < 0:
            raise ValueError("minutes must be >= 0 (0 = run `repetitions` repetitions)")
        if not self.minutes and not 0 <= self.warmup <= self.repetitions - 2:
            raise ValueError(f"warmup must leave >= 2 measured repetitions (got {self.warmup} of {self.repetitions})")
        if self.turn_tokens < 1:
            raise ValueError(f"request_tokens {self.request_tokens} leaves no room for {self.rounds} rounds")
        if self.device_tokens < self.request_tokens:
            raise ValueError("device_tokens must hold one whole request")
        if set(self.bars_mib) != set(SERVICES):
            raise ValueError(f"bars_mib needs exactly one bar per service {SERVICES}, got {sorted(self.bars_mib)}")
        if self.slope_bars_mib_per_hour and set(self.slope_bars_mib_per_hour) != set(SERVICES):
            raise ValueError(f"slope_bars_mib_per_hour needs one bar per service {SERVICES} (or none)")

    def done(self, repetitions: int, seconds: float) -> bool:
        """Whether the run is over after ``repetitions`` repetitions and ``seconds`` of load."""
        return seconds >= self.minutes * 60 if self.minutes else repetitions >= self.repetitions

    @property
    def prompt_cap(self) -> int:
        return self.request_tokens - self.max_new_tokens

    @property
    def turn_tokens(self) -> int:
        """New user tokens per round: the last round's prompt just fits under ``prompt_cap``."""
        return (self.prompt_cap - (self.rounds - 1) * self.max_new_tokens) // self.rounds


def kv_bytes_per_token(model: Path, dtype_bytes: int = 4) -> int:
    """K and V of every layer, as the worker's pools store them (fp32 by default)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * dtype_bytes


@dataclass(slots=True)
class RepLoad:
    """What one repetition's requests did."""

    requests: int = 0
    completed: int = 0  # finished with LENGTH (max_new_tokens reached), as asked
    prompt_tokens: int = 0
    cached_tokens: int = 0  # Usage.cached_tokens: reused from device, host or L3
    reusable_tokens: int = 0  # what a perfect cache could reuse: previous prompt + answer - 1
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(slots=True)
class Sample:
    """Taken after a repetition (and the settle)."""

    repetition: int
    seconds: float  # since the load started
    requests: int  # completed so far
    rss_mib: dict[str, float]
    kv_used_bytes: int
    kv_pages: int
    kv_hits: int
    kv_evictions: int
    worker: dict[str, float] = field(default_factory=dict)  # the worker's GetMemory, see worker_memory


def worker_memory(r: wpb.MemoryReport) -> dict[str, float]:
    """The worker's memory by owner, MiB (counts as they are)."""
    return {
        "heap_in_use_mib": r.heap_in_use_bytes / MiB,
        "heap_free_mib": r.heap_free_bytes / MiB,
        "heap_mmap_mib": r.heap_mmap_bytes / MiB,
        "arenas": float(len(r.arena_bytes)),
        "largest_thread_arena_mib": max(r.arena_bytes[1:], default=0) / MiB,
        "python_blocks": float(r.python_blocks),
        "tensors": float(r.tensors),
        "tensor_mib": r.tensor_bytes / MiB,
        "threads": float(r.threads),
    }


@dataclass(slots=True)
class Trend:
    """One service's RSS over the measured samples (those after the warm-up)."""

    slope_mib_per_hour: float  # least-squares, over the load's clock
    slope_mib_per_1k_requests: float  # least-squares, over completed requests
    growth_mib: float  # median of the last third minus median of the first third
    spread_mib: float  # max minus min
    bar_mib: float  # growth at or above it is not flat (SoakConfig.bars_mib)
    late_slope_mib_per_hour: float = 0.0  # least-squares over the last half of the run's clock
    slope_bar_mib_per_hour: float = 0.0  # 0: not judged (SoakConfig.slope_bars_mib_per_hour)

    @property
    def flat(self) -> bool:
        within = not self.slope_bar_mib_per_hour or self.late_slope_mib_per_hour <= self.slope_bar_mib_per_hour
        return self.growth_mib < self.bar_mib and within


@dataclass(slots=True)
class SoakReport:
    config: dict[str, object]
    kv_bytes_per_token: int
    kv_capacity_bytes: int
    kv_max_used_bytes: int = 0  # over every sample and poll
    kv_polls: int = 0
    loads: list[RepLoad] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    trends: dict[str, Trend] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.loads)

    @property
    def completed(self) -> int:
        return sum(r.completed for r in self.loads)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.loads)

    @property
    def errors(self) -> list[str]:
        return [e for r in self.loads for e in r.errors]

    @property
    def ok(self) -> bool:
        """Every request completed, the kvstore never above its cap, every service flat."""
        return (
            self.completed == self.requests
            and self.kv_max_used_bytes <= self.kv_capacity_bytes
            and all(t.flat for t in self.trends.values())
        )

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "requests": self.requests, "completed": self.completed, "ok": self.ok}


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 when xs do not vary)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def growth(ys: list[float]) -> float:
    """Median of the last third of ``ys`` minus the median of the first third (at least one each)."""
    k = max(len(ys) // 3, 1)
    return statistics.median(ys[-k:]) - statistics.median(ys[:k])


def trends(
    samples: list[Sample], warmup: int, bars: dict[str, float], slope_bars: dict[str, float] | None = None
) -> dict[str, Trend]:
    """Per service, over the samples of repetitions ``warmup`` and later (at least two); the late
    slope over those of the last half of the run (by the load's clock)."""
    w = [s for s in samples if s.repetition >= warmup]
    if len(w) < 2:
        raise ValueError(f"{len(w)} samples after a warm-up of {warmup} repetitions; need >= 2")
    half = samples[-1].seconds / 2
    late = [s for s in w if s.seconds >= half]
    late = late if len(late) >= 2 else w[-2:]
    out: dict[str, Trend] = {}
    for name in SERVICES:
        ys = [s.rss_mib[name] for s in w]
        out[name] = Trend(
            slope([s.seconds for s in w], ys) * 3600,
            slope([float(s.requests) for s in w], ys) * 1000,
            growth(ys),
            max(ys) - min(ys),
            bars[name],
            slope([s.seconds for s in late], [s.rss_mib[name] for s in late]) * 3600,
            (slope_bars or {}).get(name, 0.0),
        )
    return out


async def _conversation(
    api: pgrpc.StrataStub,
    cfg: SoakConfig,
    vocab: int,
    rep: int,
    client: int,
    load: RepLoad,
    slots: asyncio.Semaphore,
) -> None:
    rng = random.Random(f"{cfg.seed}/{rep}/{client}")
    sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens, ignore_eos=True)
    hist: list[int] = []  # the conversation's token ids (ids mode)
    chat: list[pb.ChatMessage] = []  # its messages (text mode)
    held = 0  # tokens of the conversation so far (the last prompt and its answer)
    for rnd in range(cfg.rounds):
        if cfg.text:
            words = [rng.choice(WORDS) for _ in range(max(cfg.turn_tokens // 2, 1))]
            if held + 2 * len(words) > cfg.prompt_cap:
                held, chat = 0, []
            chat.append(pb.ChatMessage(role="user", content=" ".join(words)))
            what: dict[str, object] = {"messages": pb.ChatMessages(messages=chat)}
        else:
            new = [rng.randrange(FIRST_ID, vocab) for _ in range(cfg.turn_tokens)]
            if held + len(new) > cfg.prompt_cap:
                held, hist = 0, []  # past the cap: a new conversation, as bench_multiturn does
            what = {"input_ids": pb.TokenIds(ids=hist + new)}
        load.requests += 1
        load.reusable_tokens += max(held - 1, 0)
        req = pb.GenerateRequest(request_id=f"soak-{rep}-{client}-{rnd}", sampling=sampling, **what)  # type: ignore[arg-type]
        last: pb.GenerateResponse | None = None
        answer: list[int] = []
        text: list[str] = []
        try:
            async with slots:  # FIFO: a finished conversation's next round queues behind the others
                async for resp in api.Generate(req, timeout=cfg.request_timeout_s):
                    answer.extend(resp.token_ids)
                    text.append(resp.text)
                    last = resp
        except grpc.aio.AioRpcError as e:
            load.errors.append(f"{req.request_id}: {e.code().name} {e.details()}")
            return
        if last is None or last.finish_reason != pb.FINISH_REASON_LENGTH or len(answer) != cfg.max_new_tokens:
            why = "no response" if last is None else f"{pb.FinishReason.Name(last.finish_reason)} {last.error}"
            load.errors.append(f"{req.request_id}: {why}")
            return
        load.completed += 1
        load.prompt_tokens += last.usage.prompt_tokens
        load.cached_tokens += last.usage.cached_tokens
        held = last.usage.prompt_tokens + len(answer)
        if cfg.text:
            chat.append(pb.ChatMessage(role="assistant", content="".join(text)))
        else:
            hist = list(req.input_ids.ids) + answer


def _kv_figures(s: BackendStats) -> tuple[int, int, int, int]:
    return s.used_bytes, s.pages, s.hits, s.evictions


async def _poll_kvstore(kv: KVStoreClient, report: SoakReport, stop: asyncio.Event) -> None:
    while not stop.is_set():
        s = await kv.stats()
        report.kv_polls += 1
        report.kv_max_used_bytes = max(report.kv_max_used_bytes, s.used_bytes)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_S)


async def _drive(stack: Stack, cfg: SoakConfig, report: SoakReport, say: Callable[[str], None]) -> None:
    procs = {name: psutil.Process(stack.child(name).proc.pid) for name in SERVICES}  # type: ignore[union-attr]
    async with (
        grpc.aio.insecure_channel(stack.child("tokenizer").address) as channel,
        grpc.aio.insecure_channel(stack.child("worker").address) as worker_channel,
        KVStoreClient(stack.child("kvstore").address) as kv,
    ):
        api = pgrpc.StrataStub(channel)
        worker = wgrpc.WorkerStub(worker_channel)
        info = await api.GetModelInfo(pb.GetModelInfoRequest())
        if cfg.request_tokens > info.context_length:
            raise ValueError(f"request_tokens {cfg.request_tokens} > context length {info.context_length}")
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_kvstore(kv, report, stop))
        t0 = time.monotonic()
        try:
            for rep in itertools.count():
                if cfg.done(rep, time.monotonic() - t0):
                    break
                load = RepLoad()
                start = time.monotonic()
                slots = asyncio.Semaphore(cfg.parallel or cfg.clients)
                await asyncio.gather(
                    *(_conversation(api, cfg, info.vocab_size, rep, c, load, slots) for c in range(cfg.clients))
                )
                load.seconds = time.monotonic() - start
                report.loads.append(load)
                await asyncio.sleep(cfg.settle_s)
                s = await kv.stats()
                report.kv_max_used_bytes = max(report.kv_max_used_bytes, s.used_bytes)
                rss_mib = {n: p.memory_info().rss / MiB for n, p in procs.items()}
                mem = worker_memory(await worker.GetMemory(wpb.GetMemoryRequest()))
                sample = Sample(rep, time.monotonic() - t0, report.completed, rss_mib, *_kv_figures(s), mem)
                report.samples.append(sample)
                rss = " ".join(f"{n}={v:.1f}" for n, v in sample.rss_mib.items())
                say(
                    f"rep {rep} ({sample.seconds / 60:.1f} min): {load.completed}/{load.requests} ok in "
                    f"{load.seconds:.1f}s, cached {load.cached_tokens}/{load.reusable_tokens}, kvstore "
                    f"{s.used_bytes / MiB:.1f}/{s.capacity_bytes / MiB:.1f} MiB ({s.hits} hits, {s.evictions} "
                    f"evictions), RSS MiB {rss}; worker heap in use {mem['heap_in_use_mib']:.1f} free "
                    f"{mem['heap_free_mib']:.1f} mmap {mem['heap_mmap_mib']:.1f} MiB in {mem['arenas']:.0f} "
                    f"arenas, {mem['python_blocks']:.0f} Python blocks, {mem['tensors']:.0f} tensors "
                    f"{mem['tensor_mib']:.1f} MiB"
                )
                if load.errors:  # a stalled or failing server: later repetitions would only wait longer
                    say(f"stopping after repetition {rep}: {len(load.errors)} requests failed, e.g. {load.errors[0]}")
                    break
        finally:
            stop.set()
            await poller
        report.wall_s = time.monotonic() - t0


def run_soak(model: Path, cfg: SoakConfig, run_dir: Path, say: Callable[[str], None] = print) -> SoakReport:
    """Start the services with the hierarchical cache on, run the load, stop every process."""
    bpt = kv_bytes_per_token(model)
    report = SoakReport(asdict(cfg), bpt, cfg.l3_tokens * bpt)
    worker = (
        "--kv-cache-bytes", str(cfg.device_tokens * bpt),
        "--host-cache-bytes", str(cfg.host_tokens * bpt),
        "--host-page-tokens", str(cfg.host_page_tokens),
        "--l3", "true" if cfg.l3 else "false",
        *(("--threads", str(cfg.worker_threads)) if cfg.worker_threads else ()),
    )  # fmt: skip
    kvstore = ("--capacity-bytes", str(report.kv_capacity_bytes))
    stack = start_stack(model, free_port(), run_dir, worker_args=worker, kvstore_args=kvstore, say=lambda _: None)
    try:
        asyncio.run(_drive(stack, cfg, report, say))
    finally:
        stack.stop()
    report.trends = trends(report.samples, cfg.warmup, cfg.bars_mib, cfg.slope_bars_mib_per_hour)
    return report


def table(report: SoakReport) -> str:
    rows = [
        "| service | RSS first → last (MiB) | growth after warm-up (MiB) | bar (MiB) | MiB/hour | MiB/1k requests "
        "| MiB/hour, last half | bar (MiB/hour) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, t in report.trends.items():
        first, last = report.samples[0].rss_mib[name], report.samples[-1].rss_mib[name]
        rows.append(
            f"| {name} | {first:.1f} → {last:.1f} | {t.growth_mib:+.2f} | {t.bar_mib:.0f} "
            f"| {t.slope_mib_per_hour:+.1f} | {t.slope_mib_per_1k_requests:+.3f} | {t.late_slope_mib_per_hour:+.1f} "
            f"| {t.slope_bar_mib_per_hour or '-'} |"
        )
    return "\n".join(rows)


def plot(report: SoakReport, path: Path) -> Path:
    """RSS of every service over the run (left) and the worker's memory by owner (right)."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    xs = [s.seconds / 60 for s in report.samples]
    fig = Figure(figsize=(12, 4.5))
    ax, bx = fig.subplots(1, 2)
    for name in SERVICES:
        ax.plot(xs, [s.rss_mib[name] for s in report.samples], label=name)
    ax.set_yscale("log")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB, log scale)")
    ax.set_title("RSS after each repetition")
    ax.legend()
    parts = {
        "RSS": [s.rss_mib["worker"] for s in report.samples],
        "heap in use": [s.worker.get("heap_in_use_mib", 0.0) for s in report.samples],
        "heap free": [s.worker.get("heap_free_mib", 0.0) for s in report.samples],
        "tensors": [s.worker.get("tensor_mib", 0.0) for s in report.samples],
    }
    for label, ys in parts.items():
        bx.plot(xs, ys, label=label)
    bx.set_xlabel("minutes")
    bx.set_ylabel("MiB")
    bx.set_title("Worker memory by owner")
    bx.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return path


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("models/qwen3-tiny"))
    p.add_argument("--run-dir", type=Path, default=Path(".runs/hicache-soak"))
    p.add_argument("--out", type=Path, default=Path("docs/bench/hicache_soak.json"))
    ints = ("clients", "rounds", "request_tokens", "max_new_tokens", "parallel", "repetitions", "warmup",
            "device_tokens", "host_tokens", "l3_tokens", "host_page_tokens", "worker_threads", "seed")  # fmt: skip
    for name in ints:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--minutes", type=float, default=d.minutes,
                   help="repeat until this long has passed (judged on the last half's slope too)")
    p.add_argument("--plot", type=Path, default=None, help="write the RSS plot here (PNG)")
    p.add_argument("--no-l3", dest="l3", action="store_false",
                   help="no kvstore traffic: the host pool only (the kvstore still runs, idle)")
    p.add_argument("--text", action="store_true",
                   help="chat messages of words instead of token ids (the tokenizer's text path)")
    p.add_argument("--settle-s", type=float, default=d.settle_s)
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the services on `kill` / `timeout` too
    slope_bars = dict(HOUR_SLOPE_BARS) if args.minutes else {}
    skip = ("model", "run_dir", "out", "plot")
    cfg = SoakConfig(**{k: v for k, v in vars(args).items() if k not in skip}, slope_bars_mib_per_hour=slope_bars)
    report = run_soak(args.model, cfg, args.run_dir, say=lambda m: print(m, file=sys.stderr))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    print(table(report))
    if args.plot is not None:
        print(f"plot: {plot(report, args.plot)}")
    print(
        f"\n{report.completed}/{report.requests} requests in {report.wall_s:.0f}s; kvstore max "
        f"{report.kv_max_used_bytes / MiB:.2f} MiB of a {report.kv_capacity_bytes / MiB:.2f} MiB cap"
    )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
