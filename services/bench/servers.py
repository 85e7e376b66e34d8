"""Server vs server over HTTP: Strata's OpenAI front against ``transformers serve --continuous-batching``.

    strata bench --only servers [--repeats 3] [--quick]     (make bench-servers)

Both servers run on the same checkpoint, each in its own processes, up for the whole run (each
idles while the other is measured), and are driven by the same client, ``OpenAIBackend``:

1. **Strata HTTP vs transformers serve** on a shared-prefix and a random workload. transformers
   serve takes text prompts only, so both get ``decode(ids)`` (the model's tokenizer) and both
   re-tokenize it with that same tokenizer; throughput counts the prompt tokens each server reports.
   Repeat i runs seed + i on both sides (no cache is shared between the servers), A B A B ...
2. **Strata HTTP vs Strata gRPC** on one stack, the shared-prefix workload at ``--concurrency``,
   token ids on both sides, at least five alternated pairs. The sides share the stack's prefix
   cache, so they get different seeds (same shapes).

Each side is reported as the median (min–max) over the repeats of total tokens/s, TTFT and ITL
(median and p99 of each run); each ratio is the median of the paired runs' ratios. Writes
``<out-dir>/servers.json`` and prints markdown tables.
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from services.bench.hf_serve import NO_EOS_BODY, TransformersServe
from services.bench.metrics import BenchResults, Comparison, Percentiles, RunMetrics, summarize
from services.bench.openai_backend import OpenAIBackend
from services.bench.runner import Backend, GrpcBackend, Say, replay, warm_up
from services.bench.workloads import RandomSpec, SharedPrefixSpec, Workload, random_workload, shared_prefix_workload

HTTP_VS_GRPC_GOAL = 0.95
OVERHEAD_MIN_REPEATS = 5  # pairs of the HTTP vs gRPC part (cheap runs, a noisy ratio)
_OVERHEAD_SEED = 1000  # seeds of part 2 start here: its system prompts must not be part 1's


@dataclass(frozen=True, slots=True)
class ServersConfig:
    model: Path
    repeats: int = 3
    concurrency: int = 64
    seed: int = 0
    # Sized for transformers serve on 2 CPU cores (~300-500 tokens/s): under a minute per run.
    shared: SharedPrefixSpec = field(default_factory=lambda: SharedPrefixSpec(groups=4, prompts_per_group=8))
    random: RandomSpec = field(default_factory=lambda: RandomSpec(count=32))
    overhead: SharedPrefixSpec = field(default_factory=SharedPrefixSpec)  # 64 requests: the stack section's
    kv_cache_bytes: int = 384 << 20
    max_rows: int = 64
    max_prefill_tokens: int = 2048
    run_dir: Path | None = None
    run_timeout_s: float = 600.0
    peer_args: tuple[str, ...] = ()  # extra flags of transformers serve (e.g. --cb-num-blocks)


@dataclass(slots=True)
class Side:
    """The runs of one server on one workload, in order."""

    workload: str
    server: str
    runs: list[RunMetrics] = field(default_factory=list)
    cpu: list[dict[str, float]] = field(default_factory=list)  # CPU seconds per run, by process


class StrataStack(NamedTuple):
    grpc: str  # the tokenizer's gRPC address
    http: str  # OpenAI base URL
    model: str  # served model name
    pids: dict[str, int]  # service -> process id


class CpuMeter:
    """CPU seconds (user + system) used by this process (the client) and by each service."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._procs = {name: psutil.Process(pid) for name, pid in pids.items()}

    def read(self) -> dict[str, float]:
        own = resource.getrusage(resource.RUSAGE_SELF)
        out = {"client": own.ru_utime + own.ru_stime}
        for name, proc in self._procs.items():
            t = proc.cpu_times()
            out[name] = t.user + t.system
        return out


def _spread(values: list[float], scale: float = 1.0, fmt: str = ".0f") -> str:
    if not values:
        return "–"
    v = [x * scale for x in values]
    return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}–{max(v):{fmt}})"


def _pcts(runs: list[RunMetrics], pick: Callable[[RunMetrics], Percentiles | None]) -> list[Percentiles]:
    return [p for p in map(pick, runs) if p is not None]


def paired_ratio(name: str, a: Side, b: Side, goal: float | None) -> Comparison:
    """a / b in total tokens/s: the median of the ratios of runs adjacent in time."""
    pairs = [x.total_throughput / y.total_throughput if y.total_throughput else float("nan")
             for x, y in zip(a.runs, b.runs, strict=True)]  # fmt: skip
    metric = f"total tokens/s, median of {len(pairs)} paired runs (spread {min(pairs):.3f}–{max(pairs):.3f})"
    value = statistics.median(pairs) if all(p == p for p in pairs) else float("nan")  # nan: a side did nothing
    return Comparison(name, metric, a.server, b.server, value, goal)


class ServersBench:
    """Runs parts 1 and 2; ``sides`` holds every side's runs for the table."""

    def __init__(self, cfg: ServersConfig, machine: dict[str, Any], say: Say = print) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.say = say
        self.results = BenchResults(config=_config_json(cfg), machine=machine)
        self.sides: list[Side] = []
        self.vocab = _vocab_size(cfg.model)
        self._tok = AutoTokenizer.from_pretrained(str(cfg.model))
        self.run_dir = cfg.run_dir or Path(tempfile.mkdtemp(prefix="strata-bench-servers-"))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))

    @contextmanager
    def strata(self) -> Iterator[StrataStack]:
        """A Strata stack with its OpenAI HTTP front."""
        from services.common.etcd_proc import free_port
        from services.supervisor import start_stack

        c = self.cfg
        self.say(f"  starting the Strata stack (logs in {self.run_dir / 'strata'})")
        st = start_stack(
            c.model, free_port(), self.run_dir / "strata", http_port=free_port(),
            worker_args=("--kv-cache-bytes", str(c.kv_cache_bytes), "--max-rows", str(c.max_rows)),
            scheduler_args=("--cache", "radix", "--max-prefill-tokens", str(c.max_prefill_tokens),
                            "--max-running", str(c.max_rows)),
            say=lambda line: self.say("    " + line),
        )  # fmt: skip
        try:
            tok = st.child("tokenizer")
            http = tok.extra["http"].removeprefix("http://").removesuffix("/v1")
            pids = {n: proc.pid for n in ("tokenizer", "scheduler", "worker") if (proc := st.child(n).proc)}
            yield StrataStack(tok.address, f"http://{http}/v1", c.model.name, pids)
        finally:
            st.stop()

    def run(self) -> BenchResults:
        t0 = time.perf_counter()
        log = self.run_dir / "transformers-serve.log"
        with self.strata() as stack:
            self.say(f"  starting transformers serve (log in {log})")
            with TransformersServe(self.cfg.model, log, self.cfg.peer_args) as peer:
                self.results.notes.append("peer: transformers " + " ".join(peer.command[3:]) + " (HF_HUB_OFFLINE=1)")
                asyncio.run(self.versus_peer(stack, peer))
            asyncio.run(self.http_vs_grpc(stack))
        self.results.elapsed_s = time.perf_counter() - t0
        return self.results

    async def measure(
        self, side: Side, backend: Backend, workload: Workload, repeat: int, meter: CpuMeter | None
    ) -> None:
        label = f"{side.workload} · {side.server} #{repeat + 1}"
        before = meter.read() if meter is not None else {}
        records, duration = await replay(backend, workload, self.cfg.concurrency, self.say, self.cfg.run_timeout_s)
        if meter is not None:
            side.cpu.append({k: v - before[k] for k, v in meter.read().items()})
        reports_cache = not isinstance(backend, OpenAIBackend) or backend.reports_cache
        m = summarize(label, records, duration, reports_cache)
        errors = sorted({r.error for r in records if r.error})
        if errors:  # every failed request is reported with its reason
            self.results.notes.append(f"{label}: {m.failed} failed: " + "; ".join(errors))
        side.runs.append(m)
        self.results.runs.append(m)
        ttft = f"{m.ttft_s.median * 1e3:.0f} ms" if m.ttft_s else "–"
        self.say(f"  {label}: {m.requests} ok / {m.failed} failed in {m.duration_s:.1f}s, "
                 f"{m.total_throughput:.0f} tok/s total, TTFT median {ttft}")  # fmt: skip

    async def alternate(
        self, a: Side, a_b: Backend, b: Side, b_b: Backend, w: Callable[[int, int], Workload], repeats: int,
        meter: CpuMeter | None = None,
    ) -> None:
        """A B A B ...: run i of side k replays ``w(i, k)``."""
        for i in range(repeats):
            await self.measure(a, a_b, w(i, 0), i, meter)
            await self.measure(b, b_b, w(i, 1), i, meter)
        self.sides += [a, b]

    async def versus_peer(self, stack: StrataStack, peer: TransformersServe) -> None:
        c = self.cfg
        ours = OpenAIBackend(stack.http, stack.model, "Strata HTTP", decode=self.decode,
                             extra_body={"ignore_eos": True}, timeout_s=c.run_timeout_s)
        theirs = OpenAIBackend(peer.base_url, peer.model_name, "transformers serve", decode=self.decode,
                               extra_body=NO_EOS_BODY, timeout_s=c.run_timeout_s)  # fmt: skip
        try:
            for backend in (ours, theirs):
                await self._warm(backend)
            for spec in (c.shared, c.random):
                await self._versus_peer_on(spec, ours, theirs)
            self.results.notes += [ours.describe(), theirs.describe()]
        finally:
            await ours.close()
            await theirs.close()

    async def _versus_peer_on(self, spec: SharedPrefixSpec | RandomSpec, ours: Backend, theirs: Backend) -> None:
        c = self.cfg
        first = _workload(spec, self.vocab, c.seed)
        self.say(f"== {first.describe()}, text prompts, concurrency {c.concurrency} ==")
        tag = first.kind.replace("_", " ")
        a, b = Side(tag, ours.label), Side(tag, theirs.label)
        # Repeat i: seed + i on both sides (the servers share no cache).
        await self.alternate(a, ours, b, theirs, lambda i, _: _workload(spec, self.vocab, c.seed + i), c.repeats)
        self._compare(paired_ratio(f"{tag}: Strata HTTP / transformers serve", a, b, None))

    async def http_vs_grpc(self, stack: StrataStack) -> None:
        """Also measures the CPU seconds of the client and of each service per run: where HTTP's
        extra cost goes (the OpenAI front lives in the tokenizer process)."""
        c = self.cfg
        base = c.seed + _OVERHEAD_SEED
        self.say(f"== HTTP vs gRPC: {shared_prefix_workload(c.overhead, self.vocab, base).describe()}, "
                 f"token ids, concurrency {c.concurrency} ==")  # fmt: skip
        http = OpenAIBackend(stack.http, stack.model, "Strata HTTP (ids)", extra_body={"ignore_eos": True},
                             timeout_s=c.run_timeout_s)  # fmt: skip
        grpc_b = GrpcBackend(stack.grpc, "Strata gRPC")
        try:
            for backend in (http, grpc_b):
                await self._warm(backend)
            a, g = Side("shared prefix, ids", http.label), Side("shared prefix, ids", grpc_b.label)
            # One stack, one prefix cache: the two sides replay different prompts of the same shape.
            # A run takes ~5 s, about what a neighbour's burst shifts it by: at least five pairs.
            await self.alternate(a, http, g, grpc_b,
                                 lambda i, k: shared_prefix_workload(c.overhead, self.vocab, base + 2 * i + k),
                                 max(c.repeats, OVERHEAD_MIN_REPEATS), CpuMeter(stack.pids))
            self._compare(paired_ratio(f"Strata HTTP / Strata gRPC at concurrency {c.concurrency}", a, g,
                                       HTTP_VS_GRPC_GOAL))  # fmt: skip
            self.results.notes += [http.describe(), *(cpu_line(x) for x in (a, g))]
        finally:
            await http.close()
            await grpc_b.close()

    async def _warm(self, backend: Backend) -> None:
        """As many small requests at once as a run has in flight: first-call costs, and for HTTP
        the connections a run opens, stay out of the runs."""
        await warm_up(backend, self.vocab, requests=self.cfg.concurrency)
        if isinstance(backend, OpenAIBackend):
            backend.reset()

    def _compare(self, c: Comparison) -> None:
        self.results.comparisons.append(c)
        verdict = "" if c.met is None else ("  goal met" if c.met else f"  GOAL MISSED (goal {c.goal})")
        self.say(f"  => {c.name}: {c.value:.3f}{verdict}")


def cpu_line(side: Side) -> str:
    """Median CPU seconds per run of each process, for the notes."""
    names = side.cpu[0].keys() if side.cpu else ()
    parts = [f"{n} {statistics.median(x[n] for x in side.cpu):.2f}" for n in names]
    return f"{side.server}: CPU seconds per run (median of {len(side.cpu)}): " + ", ".join(parts)


def _workload(spec: SharedPrefixSpec | RandomSpec, vocab: int, seed: int) -> Workload:
    if isinstance(spec, RandomSpec):
        return random_workload(spec, vocab, seed)
    return shared_prefix_workload(spec, vocab, seed)


def markdown(results: BenchResults, sides: list[Side]) -> str:
    """Side-by-side table (median (min–max) over the repeats) and the ratios."""
    m = results.machine
    lines = [
        f"Measured {m.get('date', '?')} on {m.get('cpu', '?')} ({m.get('cores', '?')} cores, load average "
        f"{m.get('load_start', '?')} at the start); model `{results.config.get('model')}` "
        f"({m.get('params_m', '?')} M parameters); {results.config.get('repeats')} repeats, "
        f"concurrency {results.config.get('concurrency')}; whole run {results.elapsed_s / 60:.1f} min.",
        "",
        "| workload | server | total tok/s | out tok/s | TTFT median ms | TTFT p99 ms | ITL median ms "
        "| ITL p99 ms | cache hit | failed |",
        "|---|---|---|---|---|---|---|---|---|---:|",
    ]
    for s in sides:
        ttft, itl = _pcts(s.runs, lambda r: r.ttft_s), _pcts(s.runs, lambda r: r.itl_s)
        hits = [r.cache_hit_rate for r in s.runs if r.cache_hit_rate is not None]
        lines.append(
            f"| {s.workload} | {s.server} | {_spread([r.total_throughput for r in s.runs])} "
            f"| {_spread([r.output_throughput for r in s.runs])} "
            f"| {_spread([p.median for p in ttft], 1e3)} | {_spread([p.p99 for p in ttft], 1e3)} "
            f"| {_spread([p.median for p in itl], 1e3, '.1f')} | {_spread([p.p99 for p in itl], 1e3, '.1f')} "
            f"| {_spread(hits, 100, '.0f') + ' %' if hits else '–'} | {sum(r.failed for r in s.runs)} |"
        )
    lines += ["", "| comparison | metric | value | goal |", "|---|---|---:|---|"]
    for c in results.comparisons:
        goal = "–" if c.goal is None else (f"≥ {c.goal:g}: " + ("met" if c.met else "**missed**"))
        lines.append(f"| {c.name} | {c.metric} | {c.value:.3f} | {goal} |")
    lines += ["", *[f"- {n}" for n in results.notes]]
    return "\n".join(lines) + "\n"


def _vocab_size(model: Path) -> int:
    import json

    cfg = json.loads((model / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


def _config_json(cfg: ServersConfig) -> dict[str, Any]:
    from dataclasses import asdict

    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
