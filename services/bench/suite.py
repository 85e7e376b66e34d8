"""The side-by-side comparisons of one ``strata bench`` run, each against its DESIGN §6 bar.

    cache      random workload, in-process, prefix cache on vs off      throughput ratio  >= 0.98
               shared-prefix workload, cache on vs off                  cached / ideal    >= 0.95
    multi_turn multi-turn workload, cache on vs off                     cached / ideal    (reported)
    stack      shared-prefix workload at --concurrency, gRPC stack vs in-process
                                                                         throughput ratio  >= 0.90
    hf         shared-prefix and random workloads, Strata (gRPC stack) vs transformers generate
               (the better of its batch sizes, per repeat) and continuous batching
                                                                         throughput ratio  >= 2 / >= 1
    long_prefix the shared-prefix workload with a 2,048-token system prompt, the same comparison
                                                                         throughput ratio  >= 3
    prefill    TTFT of a cold 1,024- and 4,096-token prompt (in-process scheduler + engine) vs one
               transformers forward over the same ids                    time ratio        <= 1.1
    decode_floor a batch-64 decode step (shared-prefix shape) vs the machine's floor measured in
               the same run, for the reference, flat and cascade attention paths  time ratio <= 2.5
    profile    cProfile of one in-process run (engine stepped on the event-loop thread) and the
               share of engine time spent in attention                   share             <= 0.40

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

Section = Literal["cache", "multi_turn", "stack", "overlap", "hf", "long_prefix", "prefill", "decode_floor",
                  "profile"]
SECTIONS: tuple[Section, ...] = ("cache", "multi_turn", "stack", "overlap", "hf", "long_prefix", "prefill",
                                 "decode_floor", "profile")
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
    hf_batch_sizes: tuple[int, ...] = (16, 64)  # transformers generate runs each, the better one counts
    hf_continuous: bool = True
    random: RandomSpec = field(default_factory=RandomSpec)
    shared: SharedPrefixSpec = field(default_factory=SharedPrefixSpec)
    long_shared: SharedPrefixSpec = field(default_factory=lambda: SharedPrefixSpec(system_len=2048))
    prefill_lens: tuple[int, ...] = (1024, 4096)
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
        self, a: Callable[[int], RunMetrics], b: Callable[[int], RunMetrics], repeats: int | None = None
    ) -> tuple[list[RunMetrics], list[RunMetrics]]:
        runs_a: list[RunMetrics] = []
        runs_b: list[RunMetrics] = []
        for i in range(self.cfg.repeats if repeats is None else repeats):
            runs_a.append(a(i))
            runs_b.append(b(i))
        return runs_a, runs_b

    def ratio(self, name: str, a: list[RunMetrics], b: list[RunMetrics], goal: float | None) -> Comparison:
        """a / b in total tokens/s. Alternated runs are compared pair by pair (run i of a with run
        i of b, adjacent in time, so they saw the same load) and the median pair ratio is kept."""
        if len(a) == len(b) > 1:
            pairs = [x.total_throughput / y.total_throughput for x, y in zip(a, b, strict=True)]
            value = statistics.median(pairs)
            metric = f"total tokens/s, median of {len(a)} paired runs (spread {min(pairs):.3f}–{max(pairs):.3f})"
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
            say=lambda line: self.say("    " + line), grammar_preload=False,
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
        s_on, s_off = self.alternate(
            lambda i: self.in_process(f"shared prefix · in-process · cache on #{i + 1}", s, "radix"),
            lambda i: self.in_process(f"shared prefix · in-process · cache off #{i + 1}", s, "none"),
        )
        self.reuse("prefix reuse: shared prefix, in-process, cache on", s_on[0], 0.95)
        self.ratio("shared prefix speed-up, cache on / off", s_on, s_off, 2.0)

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

    def _hf_best(self, model: Any, workload: Workload, label: str) -> RunMetrics:
        """transformers generate at each batch size of the config; the faster run is returned (every
        run is recorded)."""
        runs = []
        for bs in self.cfg.hf_batch_sizes:
            recs, duration = hf.hf_batched(model, workload, bs, self.say)
            runs.append(self._record(f"{label} · transformers generate (batch {bs})", recs, duration, False))
        return max(runs, key=lambda m: m.total_throughput)

    def _versus_hf(
        self, name: str, model: Any, spec: SharedPrefixSpec | RandomSpec, goal: float, repeats: int | None = None
    ) -> None:
        """Strata (gRPC stack) and transformers generate alternated on the same prompts (seed + i
        on both sides in repeat i), compared pair by pair."""

        def w(i: int) -> Workload:
            if isinstance(spec, RandomSpec):
                return random_workload(spec, self.vocab, self.cfg.seed + i)
            return shared_prefix_workload(spec, self.vocab, self.cfg.seed + i)

        tag = w(0).name
        self.say(f"  workload {w(0).describe()}, concurrency {self.cfg.concurrency}")
        with self.stack() as address:
            strata, theirs = self.alternate(
                lambda i: self.over_grpc(f"{tag} · gRPC stack #{i + 1}", address, w(i)),
                lambda i: self._hf_best(model, w(i), f"{tag} #{i + 1}"),
                repeats,
            )
        self.ratio(name, strata, theirs, goal)

    def section_hf(self) -> None:
        model = hf.load_hf_model(self.cfg.model)
        self._versus_hf("shared prefix: Strata (gRPC stack) / transformers generate (best batch)", model,
                        self.cfg.shared, 2.0)
        self._versus_hf("random, no reuse: Strata (gRPC stack) / transformers generate (best batch)", model,
                        self.cfg.random, 1.0)
        if self.cfg.hf_continuous:
            s = shared_prefix_workload(self.cfg.shared, self.vocab, self.cfg.seed)
            strata = self._stack_runs
            if strata is None:
                with self.stack() as address:
                    strata = [self.over_grpc("shared prefix · gRPC stack #1", address, s)]
            try:
                recs, duration = hf.hf_continuous(model, s, self.say)
                cont = self._record("shared prefix · transformers continuous batching", recs, duration, False)
            except Exception as e:  # an optional reference: say why it could not run, keep going
                self.results.notes.append(f"transformers continuous batching failed: {e!r}")
                self.say(f"  transformers continuous batching failed: {e!r}")
            else:
                self.ratio("Strata (gRPC stack) / transformers continuous batching", strata, [cont], 3.0)

    def section_long_prefix(self) -> None:
        """One pair only: transformers takes minutes per run here (every prompt recomputes its 2k
        prefix), and a ratio this far from its goal does not need the repeats to be read."""
        model = hf.load_hf_model(self.cfg.model)
        self._versus_hf(
            f"{self.cfg.long_shared.system_len}-token shared prefix: Strata (gRPC stack) / transformers generate "
            "(best batch)", model, self.cfg.long_shared, 3.0, repeats=1,
        )

    def section_prefill(self) -> None:
        """Cold prompts (nothing cached, fresh ids each repeat) through the in-process scheduler and
        engine — TTFT from submission to the first token, chunked by the prefill budget — against one
        transformers forward over the same ids, alternated."""
        from services.bench.speed import hf_forward_s

        model = hf.load_hf_model(self.cfg.model)
        # A 1k-token prefill takes half a second here, about what a neighbour's burst shifts it by:
        # at least five pairs (each costs a few seconds) so that the median is worth reading.
        for n in self.cfg.prefill_lens:
            ratios, ours, theirs = [], [], []
            for i in range(max(self.cfg.repeats, 5)):
                w = random_workload(RandomSpec(count=1, input_len=n, output_len=1), self.vocab, self.cfg.seed + i)
                m = self.in_process(f"cold {n}-token prompt · in-process #{i + 1}", w, "radix", concurrency=1)
                ttft = m.ttft_s.mean if m.ttft_s is not None else float("nan")
                forward = hf_forward_s(model, w.conversations[0][0].prompt_for([]))
                self.say(f"    TTFT {ttft:.3f}s, one transformers forward {forward:.3f}s")
                ours.append(ttft)
                theirs.append(forward)
                ratios.append(ttft / forward)
            self.results.notes.append(
                f"cold {n}-token prompt: TTFT {_spread(ours)} s, transformers forward {_spread(theirs)} s, "
                f"ratio {_spread(ratios)}"
            )
            self._compare(Comparison(f"cold {n}-token prompt: TTFT / one transformers forward",
                                     f"seconds, median of {len(ratios)} paired runs (spread {_spread(ratios)})",
                                     "Strata in-process",
                                     "transformers forward", statistics.median(ratios), 1.1, lower_is_better=True))

    def section_decode_floor(self) -> None:
        from services.bench.speed import decode_floor, machine_rates

        for attention in ("reference", "flat", "cascade"):
            ratios = []
            for _ in range(self.cfg.repeats):
                gflops, gbs = machine_rates()
                f = decode_floor(self.cfg.model, attention, gflops, gbs, seed=self.cfg.seed)
                self.say(f"  decode step at batch {f.batch}, {f.describe()}")
                self.results.notes.append(f"decode step, batch {f.batch}, {f.describe()}")
                ratios.append(f.ratio)
            self._compare(Comparison(f"decode step at batch 64 / machine floor ({attention} attention)",
                                     f"seconds, median of {len(ratios)} (spread {_spread(ratios)})", attention,
                                     "floor", statistics.median(ratios), 2.5 if attention == "cascade" else None,
                                     lower_is_better=True))

    def section_profile(self) -> None:
        s = shared_prefix_workload(self.cfg.shared, self.vocab, self.cfg.seed)
        t0 = time.perf_counter()
        self.results.profile, share = profile_in_process(
            self._engine(),
            self._loop_cfg("radix"),
            s,
            self.cfg.concurrency,
            self.vocab,
            PROFILE_TOP,
            self.cfg.run_timeout_s,
        )
        self.say(f"  profiled the in-process shared-prefix run ({time.perf_counter() - t0:.1f}s)")
        self._compare(Comparison("attention share of engine time (shared-prefix profile)",
                                 "cumulative attention time / Engine.step time", "attention", "engine", share, 0.40,
                                 lower_is_better=True))


def _spread(values: list[float]) -> str:
    """``median (min–max)`` of ``values``."""
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


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
