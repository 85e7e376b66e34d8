"""Server vs server over HTTP: Strata's OpenAI front against ``transformers serve --continuous-batching``
and against vLLM's CPU build.

    strata bench --only servers [--peer transformers|vllm|both] [--repeats 3] [--quick]
                                                    (make bench-servers, make bench-vllm)

Both servers run on the same checkpoint, each in its own processes, up for the whole run (each
idles while the other is measured), and are driven by the same client, ``OpenAIBackend``:

1. **Strata HTTP vs transformers serve** on a shared-prefix and a random workload. transformers
   serve takes text prompts only, so both get ``decode(ids)`` (the model's tokenizer) and both
   re-tokenize it with that same tokenizer; throughput counts the prompt tokens each server reports.
   Repeat i runs seed + i on both sides (no cache is shared between the servers), A B A B ...
2. **Strata HTTP vs Strata gRPC** on one stack, the shared-prefix workload at ``--concurrency``,
   token ids on both sides, at least five alternated pairs. The sides share the stack's prefix
   cache, so they get different seeds (same shapes).
3. **Strata HTTP vs vLLM HTTP** (``--peer vllm``, vLLM from its own venv: ``vllm_serve.py``), token
   ids on both sides, seed + i on both, A B A B: on the bench model a shared-prefix, a random and a
   long-agent-context workload (both servers up for the part); then, on a fresh pair of servers on
   the one-layer null model, the control plane: 256 streams x 256 tokens at concurrency 256. Each
   workload first gets one unrecorded run per side, and every run starts after ``SETTLE_S`` of
   quiet (see there). Every run also measures the CPU seconds of each process of both servers and
   of the client: a side's own processes per output token, and what the idle other server burned.

Each side is reported as the median (min–max) over the repeats of total tokens/s, TTFT and ITL
(median and p99 of each run); each ratio is the median of the paired runs' ratios. Writes
``<out-dir>/servers.json`` (``servers_vllm.json`` with ``--peer vllm``) and prints markdown tables.
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
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from services.bench.hf_serve import NO_EOS_BODY, PeerError, TransformersServe
from services.bench.metrics import BenchResults, Comparison, Percentiles, RunMetrics, summarize
from services.bench.openai_backend import OpenAIBackend
from services.bench.runner import Backend, GrpcBackend, Say, replay, warm_up
from services.bench.vllm_serve import CPU_HEAD_SIZES, VLLM_WORKLOADS, VllmServe, head_dim, with_head_dim
from services.bench.workloads import (
    AgentSpec,
    RandomSpec,
    SharedPrefixSpec,
    Workload,
    agent_workload,
    random_workload,
    shared_prefix_workload,
)

HTTP_VS_GRPC_GOAL = 0.95
OVERHEAD_MIN_REPEATS = 5  # pairs of the HTTP vs gRPC part (cheap runs, a noisy ratio)
_OVERHEAD_SEED = 1000  # seeds of part 2 start here: its system prompts must not be part 1's
NO_EOS = {"ignore_eos": True}  # Strata's and vLLM's
# Part 3 waits this long before each run: after its last request vLLM's worker spins on its
# shared-memory queue for 1 s (shm_broadcast.SpinCondition, busy_loop_s=1), and on 2 cores that
# spin slowed the Strata run that followed it by up to 7x (OpenMP threads contending for a core).
SETTLE_S = 3.0
_WARM_SEED = 10_000  # part 3's unrecorded first run of each workload replays seed + this
Spec = SharedPrefixSpec | RandomSpec | AgentSpec


@dataclass(frozen=True, slots=True)
class VllmPeer:
    """Part 3 (issue #26): where vLLM is and what both servers run."""

    python: Path  # the python of vLLM's own venv
    null_model: Path = Path("models/qwen3-null")  # the control plane's model
    shared: SharedPrefixSpec = field(
        default_factory=lambda: SharedPrefixSpec(groups=4, prompts_per_group=16, system_len=768, output_len=48)
    )
    random: RandomSpec = field(default_factory=lambda: RandomSpec(count=64, input_len=256, output_len=32))
    agent: AgentSpec = field(default_factory=AgentSpec)
    # One stream alone (issue #26's single-stream ITL row): its ITL is the decode step's wall time.
    single: RandomSpec = field(default_factory=lambda: RandomSpec(count=1, input_len=512, output_len=128))
    control: RandomSpec = field(default_factory=lambda: RandomSpec(count=256, input_len=32, output_len=256))
    workloads: tuple[str, ...] = VLLM_WORKLOADS  # which of the above run, in this order
    control_concurrency: int = 256
    max_model_len: int = 4096
    kvcache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE
    args: tuple[str, ...] = ()  # extra flags of vLLM's server


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
    transformers: bool = True  # parts 1 and 2
    vllm: VllmPeer | None = None  # part 3


@dataclass(slots=True)
class Side:
    """The runs of one server on one workload, in order."""

    workload: str
    server: str
    runs: list[RunMetrics] = field(default_factory=list)
    cpu: list[dict[str, float]] = field(default_factory=list)  # CPU seconds per run, by process
    own: str = ""  # part 3: the prefix of this side's processes in ``cpu`` (the others are the idle peer's)


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
    def strata(
        self, model: Path | None = None, rows: int = 0, kv_cache_bytes: int = 0, name: str = "strata"
    ) -> Iterator[StrataStack]:
        """A Strata stack with its OpenAI HTTP front (default: the config's model and sizes)."""
        from services.common.etcd_proc import free_port
        from services.supervisor import start_stack

        c = self.cfg
        model, rows, kv = model or c.model, rows or c.max_rows, kv_cache_bytes or c.kv_cache_bytes
        self.say(f"  starting the Strata stack on {model} (logs in {self.run_dir / name})")
        st = start_stack(
            model, free_port(), self.run_dir / name, http_port=free_port(),
            worker_args=("--kv-cache-bytes", str(kv), "--max-rows", str(rows)),
            scheduler_args=("--cache", "radix", "--max-prefill-tokens", str(c.max_prefill_tokens),
                            "--max-running", str(rows)),
            say=lambda line: self.say("    " + line), grammar_preload=False,
        )  # fmt: skip
        try:
            tok = st.child("tokenizer")
            http = tok.extra["http"].removeprefix("http://").removesuffix("/v1")
            pids = {n: proc.pid for n in ("tokenizer", "scheduler", "worker") if (proc := st.child(n).proc)}
            yield StrataStack(tok.address, f"http://{http}/v1", model.name, pids)
        finally:
            st.stop()

    @contextmanager
    def vllm(self, v: VllmPeer, model: Path, max_num_seqs: int, name: str) -> Iterator[VllmServe]:
        """vLLM's server on ``model``; its command line and start-up time go to the notes."""
        if head_dim(model) not in CPU_HEAD_SIZES:
            raise PeerError(f"{model}: head_dim {head_dim(model)} has no vLLM CPU attention kernel "
                            f"(it takes {', '.join(map(str, CPU_HEAD_SIZES))})")  # fmt: skip
        log = self.run_dir / f"{name}.log"
        self.say(f"  starting vLLM on {model} (log in {log}; 1-2 min)")
        peer = VllmServe(v.python, model, log, max_model_len=v.max_model_len, max_num_seqs=max_num_seqs,
                         kvcache_gib=v.kvcache_gib, extra_args=v.args)  # fmt: skip
        with peer:
            self.say(f"    vLLM ready in {peer.startup_s:.0f}s")
            self.results.notes.append(f"vLLM on {model.name}, ready in {peer.startup_s:.0f}s: {peer.shell_line()}")
            yield peer

    def run(self) -> BenchResults:
        t0 = time.perf_counter()
        c = self.cfg
        log = self.run_dir / "transformers-serve.log"
        # Against vLLM, Strata's KV pool gets vLLM's KV memory (VLLM_CPU_KVCACHE_SPACE): what each
        # server's cache keeps between requests is then a property of the server, not of its budget.
        kv = max(c.kv_cache_bytes, c.vllm.kvcache_gib << 30) if c.vllm is not None else 0
        with self.strata(kv_cache_bytes=kv) as stack:
            if c.transformers:
                self.say(f"  starting transformers serve (log in {log})")
                with TransformersServe(c.model, log, c.peer_args) as peer:
                    note = "peer: transformers " + " ".join(peer.command[3:]) + " (HF_HUB_OFFLINE=1)"
                    self.results.notes.append(note)
                    asyncio.run(self.versus_peer(stack, peer))
                asyncio.run(self.http_vs_grpc(stack))
            if c.vllm is not None:
                v = c.vllm
                named: dict[str, tuple[str, Spec]] = {
                    "shared": ("shared prefix", v.shared), "random": ("random", v.random), "agent": ("agent", v.agent),
                    "single": ("one stream", v.single)}  # fmt: skip
                specs = [named[w] for w in v.workloads if w in named]
                if specs:
                    with self.vllm(v, c.model, c.max_rows, "vllm-bench") as vllm:
                        asyncio.run(self.versus_vllm(stack, vllm, specs, c.concurrency))
        if c.vllm is not None and "control" in c.vllm.workloads:
            self.control_plane(c.vllm)
        self.results.elapsed_s = time.perf_counter() - t0
        return self.results

    def control_plane(self, v: VllmPeer) -> None:
        """Part 3 on the null model: its own pair of servers, sized for ``control_concurrency`` streams."""
        model, n = v.null_model, v.control_concurrency
        if head_dim(model) not in CPU_HEAD_SIZES:  # vLLM's CPU attention has no kernel for it
            model = with_head_dim(model, model.with_name(f"{model.name}-hd32"), 32)
            self.results.notes.append(f"{v.null_model.name} has head_dim {head_dim(v.null_model)}, which vLLM's "
                                      f"CPU attention refuses: both servers ran {model.name} (head_dim 32, "
                                      "same other weights)")  # fmt: skip
        tokens = n * (v.control.input_len + v.control.output_len + 64)
        kv = max(2 * tokens * _kv_bytes_per_token(model), 64 << 20)
        with self.strata(model, rows=n, kv_cache_bytes=kv, name="strata-null") as stack, \
                self.vllm(v, model, n, "vllm-null") as vllm:  # fmt: skip
            tag = f"control plane ({model.name}, concurrency {n})"
            asyncio.run(self.versus_vllm(stack, vllm, [(tag, v.control)], n))

    async def versus_vllm(
        self, stack: StrataStack, peer: VllmServe, specs: list[tuple[str, Spec]], concurrency: int
    ) -> None:
        """Strata HTTP vs vLLM HTTP on each spec, token ids on both sides, A B A B; every run meters
        both servers' processes and the client."""
        c = self.cfg
        vocab = _vocab_size(Path(peer.model_name))
        ours = OpenAIBackend(stack.http, stack.model, "Strata HTTP", extra_body=NO_EOS, timeout_s=c.run_timeout_s)
        theirs = OpenAIBackend(peer.base_url, peer.model_name, "vLLM HTTP", extra_body=NO_EOS,
                               timeout_s=c.run_timeout_s)  # fmt: skip
        meter = CpuMeter({**{f"strata {k}": p for k, p in stack.pids.items()},
                          **{f"vllm {k}": p for k, p in peer.pids().items()}})  # fmt: skip
        try:
            for backend in (ours, theirs):
                await self._warm(backend, vocab, concurrency)
            for tag, spec in specs:
                self.say(f"== {tag}: {_workload(spec, vocab, c.seed).describe()}, token ids, concurrency "
                         f"{concurrency} ==")  # fmt: skip
                self.say("  one unrecorded run of each side first (first-call costs of the workload's shapes)")
                for backend in (ours, theirs):
                    await asyncio.sleep(SETTLE_S)
                    await replay(backend, _workload(spec, vocab, c.seed + _WARM_SEED), concurrency, None,
                                 c.run_timeout_s)  # fmt: skip
                    backend.reset()
                a, b = Side(tag, ours.label, own="strata "), Side(tag, theirs.label, own="vllm ")
                await self.alternate(a, ours, b, theirs, partial(_seeded, spec, vocab, c.seed), c.repeats, meter,
                                     concurrency, SETTLE_S)  # fmt: skip
                self._compare(paired_ratio(f"{tag}: Strata HTTP / vLLM HTTP", a, b, None))
            self.results.notes += [ours.describe(), theirs.describe()]
        finally:
            await ours.close()
            await theirs.close()

    async def measure(
        self, side: Side, backend: Backend, workload: Workload, repeat: int, meter: CpuMeter | None,
        concurrency: int = 0, settle_s: float = 0.0,
    ) -> None:
        label = f"{side.workload} · {side.server} #{repeat + 1}"
        await asyncio.sleep(settle_s)
        before = meter.read() if meter is not None else {}
        records, duration = await replay(backend, workload, concurrency or self.cfg.concurrency, self.say,
                                         self.cfg.run_timeout_s)  # fmt: skip
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
        meter: CpuMeter | None = None, concurrency: int = 0, settle_s: float = 0.0,
    ) -> None:
        """A B A B ...: run i of side k replays ``w(i, k)``, each after ``settle_s`` of quiet."""
        for i in range(repeats):
            await self.measure(a, a_b, w(i, 0), i, meter, concurrency, settle_s)
            await self.measure(b, b_b, w(i, 1), i, meter, concurrency, settle_s)
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

    async def _warm(self, backend: Backend, vocab: int = 0, requests: int = 0) -> None:
        """As many small requests at once as a run has in flight: first-call costs, and for HTTP
        the connections a run opens, stay out of the runs."""
        await warm_up(backend, vocab or self.vocab, requests=requests or self.cfg.concurrency)
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


def cpu_per_token(side: Side) -> dict[str, list[float]]:
    """Per process of the side (``own`` prefix dropped), plus ``total`` (its processes), ``client``
    and ``idle peer`` (the other server's processes): CPU µs per output token of each run."""
    out: dict[str, list[float]] = {}
    for run, cpu in zip(side.runs, side.cpu, strict=True):
        per = 1e6 / max(run.output_tokens, 1)
        own = {k.removeprefix(side.own): v for k, v in cpu.items() if k.startswith(side.own)}
        rows = {**own, "total": sum(own.values()), "client": cpu.get("client", 0.0),
                "idle peer": sum(v for k, v in cpu.items() if k != "client" and not k.startswith(side.own))}
        for k, v in rows.items():
            out.setdefault(k, []).append(v * per)
    return out


def cpu_markdown(sides: list[Side]) -> list[str]:
    """The CPU table of part 3 (no lines when no side has ``own``)."""
    metered = [s for s in sides if s.own and s.cpu]
    if not metered:
        return []
    lines = ["", "CPU µs per output token, median (min–max) over the repeats: the side's processes "
             "(total, then each), the client, and the other server while it idled.", "",
             "| workload | server | total | per process | client | idle peer |", "|---|---|---|---|---|---|"]
    for s in metered:
        per = cpu_per_token(s)
        procs = ", ".join(f"{k} {_spread(v)}" for k, v in per.items() if k not in ("total", "client", "idle peer"))
        lines.append(f"| {s.workload} | {s.server} | {_spread(per['total'])} | {procs} | {_spread(per['client'])} "
                     f"| {_spread(per['idle peer'])} |")
    return lines


def sides_json(sides: list[Side]) -> list[dict[str, Any]]:
    """Each side's runs (labels) and CPU seconds by process per run, for the JSON beside ``runs``."""
    return [{"workload": s.workload, "server": s.server, "runs": [r.label for r in s.runs],
             "output_tokens": [r.output_tokens for r in s.runs], "cpu_s": s.cpu,
             "cpu_us_per_output_token": cpu_per_token(s) if s.own else None} for s in sides]  # fmt: skip


def _seeded(spec: Spec, vocab: int, seed: int, repeat: int, _side: int) -> Workload:
    """Repeat i of either side: seed + i (the servers share no cache)."""
    return _workload(spec, vocab, seed + repeat)


def _workload(spec: Spec, vocab: int, seed: int) -> Workload:
    if isinstance(spec, RandomSpec):
        return random_workload(spec, vocab, seed)
    if isinstance(spec, AgentSpec):
        return agent_workload(spec, vocab, seed)
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
    lines += cpu_markdown(sides)
    lines += ["", *[f"- {n}" for n in results.notes]]
    return "\n".join(lines) + "\n"


def _vocab_size(model: Path) -> int:
    import json

    cfg = json.loads((model / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


def _kv_bytes_per_token(model: Path) -> int:
    """fp32 K and V of every layer (a dense checkpoint)."""
    import json

    cfg = json.loads((model / "config.json").read_text())
    return 2 * 4 * int(cfg["num_hidden_layers"]) * int(cfg["num_key_value_heads"]) * head_dim(model)


def _config_json(cfg: ServersConfig) -> dict[str, Any]:
    from dataclasses import asdict

    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return str(v) if isinstance(v, Path) else v

    return {k: plain(v) for k, v in asdict(cfg).items()}
