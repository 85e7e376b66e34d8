"""The side-by-side comparisons of one ``strata bench`` run, each against its DESIGN §6 bar.

    cache      random workload, in-process, prefix cache on vs off      throughput ratio  >= 0.98
               shared-prefix workload, cache on vs off                  cached / ideal    >= 0.95
    multi_turn multi-turn workload, cache on vs off                     cached / ideal    (reported)
    stack      shared-prefix workload at --concurrency, gRPC stack vs in-process
                                                                         throughput ratio  >= 0.90
    hf         shared-prefix workload, Strata (gRPC stack) vs transformers generate and
               continuous batching                                       throughput ratio  >= 3
    profile    cProfile of one in-process run (engine stepped on the event-loop thread)

Sides of a ratio alternate ``repeats`` times (A B A B ...) and the median of each side is compared,
so slow drift of a shared machine hits both sides alike. Every in-process run gets a fresh engine.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from services.bench import hf
from services.bench.metrics import BenchResults, Comparison, RunMetrics, summarize
from services.bench.profile import profile_in_process
from services.bench.runner import (
    Backend,
    GrpcBackend,
    InProcessBackend,
    Say,
    replay,
    warm_up,
)
from services.bench.workloads import (
    MultiTurnSpec,
    RandomSpec,
    SharedPrefixSpec,
    Workload,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
)
from services.scheduler.loop import LoopConfig

Section = Literal["cache", "multi_turn", "stack", "overlap", "hf", "profile"]
SECTIONS: tuple[Section, ...] = ("cache", "multi_turn", "stack", "overlap", "hf", "profile")
PROFILE_TOP = 12  # functions listed per profile


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model: Path
    sections: tuple[Section, ...] = SECTIONS
    seed: int = 0
    concurrency: int = 64
    repeats: int = 3
    kv_cache_bytes: int = 384 << 20
    max_rows: int = 64
    max_prefill_tokens: int = 2048
    hf_batch_size: int = 16
    hf_continuous: bool = True
    random: RandomSpec = field(default_factory=RandomSpec)
    shared: SharedPrefixSpec = field(default_factory=SharedPrefixSpec)
    multi: MultiTurnSpec = field(default_factory=MultiTurnSpec)
    run_dir: Path | None = None  # stack logs; None = a temporary folder
    run_timeout_s: float = 600.0  # a run still going after this is cut off, its requests failed


class Suite:
    def __init__(self, cfg: BenchConfig, machine: dict[str, Any], say: Say = print) -> None:
        from services.worker.loader import load_model  # noqa: F401 (fail early without torch)

        self.cfg = cfg
        self.say = say
        self.results = BenchResults(config=_config_json(cfg), machine=machine)
        self.vocab = _vocab_size(cfg.model)
        self._stack_runs: list[RunMetrics] | None = None  # reused by the hf section
        self._scheduler_address = ""

    # -- plumbing -------------------------------------------------------------------------------
    def _loop_cfg(self, cache: str) -> LoopConfig:
        return LoopConfig(cache=cache, max_prefill_tokens=self.cfg.max_prefill_tokens, max_running=self.cfg.max_rows)

    def _engine(self) -> Any:
        from services.worker.engine import Engine, EngineConfig

        return Engine(self.cfg.model, EngineConfig(kv_cache_bytes=self.cfg.kv_cache_bytes, max_rows=self.cfg.max_rows))

    def _record(self, label: str, records: list[Any], duration: float, reports_cache: bool = True) -> RunMetrics:
        m = summarize(label, records, duration, reports_cache)
        self.results.runs.append(m)
        hit = f", cache hit {m.cache_hit_rate:.1%}" if m.cache_hit_rate is not None else ""
        self.say(
            f"  {label}: {m.requests} ok / {m.failed} failed in {m.duration_s:.1f}s, "
            f"{m.total_throughput:.0f} tok/s total, {m.output_throughput:.0f} tok/s out{hit}"
        )
        return m

    def in_process(self, label: str, workload: Workload, cache: str, concurrency: int | None = None) -> RunMetrics:
        async def go() -> tuple[list[Any], float]:
            async with InProcessBackend(self._engine(), self._loop_cfg(cache), label) as b:
                await warm_up(b, self.vocab)
                return await replay(b, workload, concurrency or self.cfg.concurrency, self.say, self.cfg.run_timeout_s)

        return self._record(label, *asyncio.run(go()))

    def over_grpc(self, label: str, address: str, workload: Workload) -> RunMetrics:
        async def go() -> tuple[list[Any], float]:
            b: Backend = GrpcBackend(address, label)
            try:
                await warm_up(b, self.vocab)
                return await replay(b, workload, self.cfg.concurrency, self.say, self.cfg.run_timeout_s)
            finally:
                await b.close()  # type: ignore[attr-defined]

        return self._record(label, *asyncio.run(go()))

    def alternate(
        self, a: Callable[[int], RunMetrics], b: Callable[[int], RunMetrics]
    ) -> tuple[list[RunMetrics], list[RunMetrics]]:
        runs_a: list[RunMetrics] = []
        runs_b: list[RunMetrics] = []
        for i in range(self.cfg.repeats):
            runs_a.append(a(i))
            runs_b.append(b(i))
        return runs_a, runs_b

    def ratio(self, name: str, a: list[RunMetrics], b: list[RunMetrics], goal: float | None) -> Comparison:
        """a / b in total tokens/s. Alternated runs are compared pair by pair (run i of a with run
        i of b, adjacent in time, so they saw the same load) and the median pair ratio is kept."""
        if len(a) == len(b) > 1:
            value = statistics.median(x.total_throughput / y.total_throughput for x, y in zip(a, b, strict=True))
            metric = f"total tokens/s, median of {len(a)} paired runs"
        else:
            med_a = statistics.median(m.total_throughput for m in a)
            med_b = statistics.median(m.total_throughput for m in b)
            value, metric = med_a / med_b, "total tokens/s (median of each side)"
        c = Comparison(name, metric, a[0].label.split(" #")[0], b[0].label.split(" #")[0], value, goal)
        self._compare(c)
        return c

    def _compare(self, c: Comparison) -> None:
        self.results.comparisons.append(c)
        verdict = "" if c.met is None else ("  goal met" if c.met else f"  GOAL MISSED (goal {c.goal})")
        self.say(f"  => {c.name}: {c.value:.3f}{verdict}")

    def reuse(self, name: str, m: RunMetrics, goal: float | None) -> None:
        value = m.reuse_vs_ideal if m.reuse_vs_ideal is not None else 0.0
        self._compare(Comparison(name, "Σcached / Σideal", m.label, "", value, goal))

    @contextmanager
    def stack(self, extra_sched: tuple[str, ...] = ()) -> Iterator[str]:
        from services.common.etcd_proc import free_port
        from services.supervisor import start_stack

        run_dir = self.cfg.run_dir or Path(tempfile.mkdtemp(prefix="strata-bench-"))
        worker = ("--kv-cache-bytes", str(self.cfg.kv_cache_bytes), "--max-rows", str(self.cfg.max_rows))
        sched = (
            "--cache",
            "radix",
            "--max-prefill-tokens",
            str(self.cfg.max_prefill_tokens),
            "--max-running",
            str(self.cfg.max_rows),
            *extra_sched,
        )
        self.say(f"  starting the gRPC stack (logs in {run_dir})")
        st = start_stack(
            self.cfg.model,
            free_port(),
            run_dir,
            worker_args=worker,
            scheduler_args=sched,
            say=lambda line: self.say("    " + line),
        )
        self._scheduler_address = st.child("scheduler").address
        try:
            yield st.child("tokenizer").address
        finally:
            st.stop()

    # -- sections -------------------------------------------------------------------------------
    def run(self) -> BenchResults:
        t0 = time.perf_counter()
        for section in self.cfg.sections:
            self.say(f"== {section} ==")
            getattr(self, f"section_{section}")()
        self.results.elapsed_s = time.perf_counter() - t0
        return self.results

    def section_cache(self) -> None:
        w = random_workload(self.cfg.random, self.vocab, self.cfg.seed)
        self.say(f"  workload {w.describe()}")
        on, off = self.alternate(
            lambda i: self.in_process(f"random · in-process · cache on #{i + 1}", w, "radix"),
            lambda i: self.in_process(f"random · in-process · cache off #{i + 1}", w, "none"),
        )
        self.ratio("prefix cache cost: random, cache on / off", on, off, 0.98)
        s = shared_prefix_workload(self.cfg.shared, self.vocab, self.cfg.seed)
        self.say(f"  workload {s.describe()}")
        m_on = self.in_process("shared prefix · in-process · cache on", s, "radix")
        m_off = self.in_process("shared prefix · in-process · cache off", s, "none")
        self.reuse("prefix reuse: shared prefix, in-process, cache on", m_on, 0.95)
        self._compare(
            Comparison(
                "shared prefix speed-up, cache on / off",
                "total tokens/s",
                m_on.label,
                m_off.label,
                m_on.total_throughput / m_off.total_throughput,
                None,
            )
        )

    def section_multi_turn(self) -> None:
        w = multi_turn_workload(self.cfg.multi, self.vocab, self.cfg.seed)
        self.say(f"  workload {w.describe()}")
        m_on = self.in_process("multi-turn · in-process · cache on", w, "radix")
        m_off = self.in_process("multi-turn · in-process · cache off", w, "none")
        self.reuse("prefix reuse: multi-turn, in-process, cache on", m_on, 0.95)
        self._compare(
            Comparison(
                "multi-turn speed-up, cache on / off",
                "total tokens/s",
                m_on.label,
                m_off.label,
                m_on.total_throughput / m_off.total_throughput,
                None,
            )
        )

    def section_stack(self) -> None:
        # Repeat i uses seed + i on both sides: the stack's cache outlives a run, so a repeat of
        # the same prompts would find its prefixes already cached.
        def w(i: int) -> Workload:
            return shared_prefix_workload(self.cfg.shared, self.vocab, self.cfg.seed + i)

        self.say(f"  workload {w(0).describe()}, concurrency {self.cfg.concurrency}")
        with self.stack() as address:
            grpc_runs, local = self.alternate(
                lambda i: self.over_grpc(f"shared prefix · gRPC stack #{i + 1}", address, w(i)),
                lambda i: self.in_process(f"shared prefix · in-process #{i + 1}", w(i), "radix"),
            )
        self.ratio(
            f"service overhead: gRPC stack / in-process at concurrency {self.cfg.concurrency}",
            grpc_runs,
            local,
            0.90,
        )
        best = max(grpc_runs, key=lambda m: m.total_throughput)
        self.reuse("prefix reuse: shared prefix, gRPC stack, cache on", best, 0.95)
        self._stack_runs = grpc_runs

    def section_overlap(self) -> None:
        """The same decode-heavy workload through the gRPC stack with overlap on and off: the
        worker's own idle time between steps, and throughput."""
        w = random_workload(self.cfg.random, self.vocab, self.cfg.seed)
        self.say(f"  workload {w.describe()}, concurrency {self.cfg.concurrency}")
        runs: dict[bool, RunMetrics] = {}
        busy: dict[bool, float] = {}
        for overlap in (True, False):
            with self.stack(("--overlap", str(overlap).lower())) as address:
                before = _load(self._scheduler_address)
                label = f"random · gRPC stack · overlap {'on' if overlap else 'off'}"
                runs[overlap] = self.over_grpc(label, address, w)
                after = _load(self._scheduler_address)
            b = after.worker_busy_s - before.worker_busy_s
            i = after.worker_idle_s - before.worker_idle_s
            busy[overlap] = b / (b + i) if b + i > 0 else 0.0
            self.say(f"  worker idle {i:.2f}s of {b + i:.2f}s ({1 - busy[overlap]:.1%}) with overlap {overlap}")
        self._compare(Comparison("worker busy fraction, overlap on", "busy / (busy + idle)",
                                 runs[True].label, "", busy[True], 0.95))  # fmt: skip
        self._compare(Comparison("worker busy fraction, overlap off", "busy / (busy + idle)",
                                 runs[False].label, "", busy[False], None))  # fmt: skip
        self.ratio("overlap: throughput on / off", [runs[True]], [runs[False]], None)

    def section_hf(self) -> None:
        s = shared_prefix_workload(self.cfg.shared, self.vocab, self.cfg.seed)
        strata = self._stack_runs
        if strata is None:
            with self.stack() as address:
                strata = [self.over_grpc("shared prefix · gRPC stack #1", address, s)]
        model = hf.load_hf_model(self.cfg.model)
        bs = self.cfg.hf_batch_size
        recs, duration = hf.hf_batched(model, s, bs, self.say)
        batched = self._record(f"shared prefix · transformers generate (batch {bs})", recs, duration, False)
        self.ratio("Strata (gRPC stack) / transformers generate", strata, [batched], 3.0)
        if self.cfg.hf_continuous:
            try:
                recs, duration = hf.hf_continuous(model, s, self.say)
                cont = self._record("shared prefix · transformers continuous batching", recs, duration, False)
            except Exception as e:  # an optional reference: say why it could not run, keep going
                self.results.notes.append(f"transformers continuous batching failed: {e!r}")
                self.say(f"  transformers continuous batching failed: {e!r}")
            else:
                self.ratio("Strata (gRPC stack) / transformers continuous batching", strata, [cont], 3.0)

    def section_profile(self) -> None:
        s = shared_prefix_workload(self.cfg.shared, self.vocab, self.cfg.seed)
        t0 = time.perf_counter()
        self.results.profile = profile_in_process(
            self._engine(),
            self._loop_cfg("radix"),
            s,
            self.cfg.concurrency,
            self.vocab,
            PROFILE_TOP,
            self.cfg.run_timeout_s,
        )
        self.say(f"  profiled the in-process shared-prefix run ({time.perf_counter() - t0:.1f}s)")


def _load(address: str) -> Any:
    import grpc

    from strata.scheduler.v1 import scheduler_pb2 as spb
    from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc

    with grpc.insecure_channel(address) as ch:
        return sgrpc.SchedulerStub(ch).GetLoad(spb.GetLoadRequest(), timeout=10)


def _vocab_size(model: Path) -> int:
    import json

    cfg = json.loads((model / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


def _config_json(cfg: BenchConfig) -> dict[str, Any]:
    from dataclasses import asdict

    d = asdict(cfg)
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}
