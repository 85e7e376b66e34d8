"""Many replicas, one cache (issue #20): KV-aware routing vs round-robin vs least-load over N
scheduler + worker replicas, side by side in one run, and the router's own cost.

    python -m benchmarks.replicas --model models/qwen3-bench [--replicas 4] [--repeats 2]
        [--setups single,kv,round_robin,least_load,round_robin+l3] [--clients 16] [--turns 6]
        [--turn-tokens 160] [--answer-tokens 32] [--groups 8] [--group-requests 8] [--system-tokens 1024]
        [--user-tokens 64] [--shared-concurrency 8] [--out docs/bench/replicas.json]     (make bench-replicas)

**Setups** (``--setups``): ``kv``, ``round_robin``, ``least_load`` are the tokenizer's
``--router-policy`` over ``--replicas`` replicas with the hierarchical cache off
(``--host-cache-bytes 0``); ``single`` is one replica serving the whole trace (the hit-rate
reference); a ``+l3`` suffix runs the same on replicas with a host pool and the shared L3 on
(``round_robin+l3``: what the L3 alone recovers of what round-robin scatters).

**Processes**: one stack (``start_stack(..., replicas=N)``) per cache mode (without / with L3), up
for the whole run. Each setup has its own tokenizer on it: the stack's own for the first policy,
the others started beside it against the same etcd (``single``: a tokenizer pinned to the first
replica with ``--scheduler``). So the setups alternate run by run on the same processes (the order
rotates each repeat) without restarting a stack (~20-30 s for four replicas on 2 cores). Every run
draws fresh token ids of the same shapes, so no run reuses what another computed; each worker's KV
pool holds a whole run's working set (``--kv-cache-bytes``, default 1.25x it), so the single
replica never evicts what its trace reuses. Workers run ``--worker-threads`` torch threads (1: four
replicas share two cores).

**Workloads**, token ids through the public gRPC API (``Strata/Generate``, ``input_ids``, streamed,
greedy, ``ignore_eos``):

- multi-turn: ``clients`` conversations at once, ``turns`` turns each, in order; a turn's prompt is
  the previous prompt + its answer + ``turn_tokens`` new user tokens; answers of ``answer_tokens``;
- shared prefix: ``groups`` system prompts of ``system_tokens``, ``group_requests`` requests each
  (+ ``user_tokens`` of their own, answers of ``answer_tokens``), ``shared_concurrency`` in flight,
  in a seeded shuffled order: interleaved groups would let round-robin send every group to the same
  replica whenever the groups are a multiple of the replicas. Requests of a group in flight at once
  are what the kv router's *expected* pages are for: the first's pages reach its index only once
  that replica has prefilled them.

**Sizes.** The defaults (16 clients × 6 turns × 160 new tokens, histories of 1,120 prompt tokens
on the last turn; 8 groups × 8 requests of 1,024 + 64 tokens; 32-token answers; 2 repeats) are
sized for about 8 minutes on a 2-core machine (7.7 min measured). The issue's full
size is ``--clients 32 --turns 6 --turn-tokens 320 --answer-tokens 32``: histories reach 2,080
prompt tokens on the last turn and each worker holds a 1.3 GiB KV pool; roughly 3x as long.

**Reported** per setup and workload, median (min–max) over ``repeats``: hit rate (Σ
``usage.cached_tokens`` / Σ prompt tokens, and as a fraction of ``single``'s), output and total
tokens/s, TTFT p50 / p99, and the requests each replica served (the tokenizer's
``strata_tokenizer_routed_requests_total``, summed over the repeats). Goals of issue #20: ``kv``
hit rate ≥ 95 % of ``single``'s, ``kv`` throughput ≥ 1.5x ``round_robin``'s (the median of the
ratios of runs adjacent in time).

**Router cost** (in process, no servers): a ``KvIndex`` of ``router_pages`` page keys over
``replicas`` replicas, built from one snapshot and then one stored batch per prompt for each
replica; ``apply`` per page (snapshot, stored, removed) and ``Chooser.choose`` per
``router_prompt_tokens``-token prompt (held by one replica / by none), medians of many timings.

Writes ``--out`` (JSON) and prints markdown tables; progress goes to stderr. Exits 1 when a request
failed; goals are reported met or missed, not enforced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import grpc

from benchmarks.hicache_soak import kv_bytes_per_token
from services.bench.metrics import summarize
from services.bench.runner import GrpcBackend, replay, warm_up
from services.bench.workloads import (
    FIRST_ID,
    MultiTurnSpec,
    SharedPrefixSpec,
    Workload,
    max_context_needed,
    multi_turn_workload,
    shared_prefix_workload,
)
from services.common.etcd_proc import free_port
from services.common.page_hash import PageKeying
from services.scheduler.cache_events import ROUTE_PAGE_TOKENS
from services.supervisor import Child, Stack, start_stack
from services.tokenizer.kv_index import POLICIES, Chooser, KvIndex, Policy
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc

MiB = 1 << 20
HIT_GOAL = 0.95  # kv hit rate / single's
SPEED_GOAL = 1.5  # kv throughput / round_robin's
WORKLOADS = ("multi_turn", "shared_prefix")
DEFAULT_SETUPS = ("single", "kv", "round_robin", "least_load", "round_robin+l3")
KV_POOL_MARGIN = 1.25  # default KV pool per worker: this times a run's working set
L3_MARGIN = 2.0  # default kvstore capacity: this times a run's working set
ROUTER_VOCAB = 8192  # token ids of the router-cost prompts (the bench model's vocabulary)
SNAPSHOT_REPEATS = 5  # router cost: snapshots timed on this many fresh indexes
SETTLE_S = 0.5  # after a run: the tokenizers count a request just after its last response
Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Setup:
    name: str
    policy: Policy | None  # None: one replica (a tokenizer pinned to the first)
    l3: bool

    @staticmethod
    def parse(name: str) -> Setup:
        base, plus, mode = name.partition("+")
        if (plus and mode != "l3") or (base != "single" and base not in POLICIES):
            raise ValueError(f"setup {name!r}: one of single, {', '.join(POLICIES)}, each optionally with +l3")
        return Setup(name, None if base == "single" else cast(Policy, base), bool(plus))


@dataclass(frozen=True, slots=True)
class ReplicasConfig:
    model: Path
    replicas: int = 4
    setups: tuple[str, ...] = DEFAULT_SETUPS
    repeats: int = 2
    clients: int = 16
    turns: int = 6
    turn_tokens: int = 160
    answer_tokens: int = 32
    groups: int = 8
    group_requests: int = 8
    system_tokens: int = 1024
    user_tokens: int = 64
    shared_concurrency: int = 8
    worker_threads: int = 1
    kv_cache_bytes: int = 0  # per worker; 0 = KV_POOL_MARGIN x a run's working set
    host_cache_bytes: int = 128 * MiB  # per worker, +l3 setups (staging for L3 puts and prefetches)
    l3_bytes: int = 0  # kvstore capacity, +l3 setups; 0 = L3_MARGIN x a run's working set
    router_pages: int = 100_000
    router_prompt_tokens: int = 2000
    router_lookups: int = 2000
    run_timeout_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        sizes = (self.replicas, self.repeats, self.clients, self.turns, self.turn_tokens, self.answer_tokens,
                 self.groups, self.group_requests, self.system_tokens, self.user_tokens, self.shared_concurrency,
                 self.worker_threads, self.router_pages, self.router_prompt_tokens, self.router_lookups)  # fmt: skip
        if min(sizes) < 1:
            raise ValueError("every size and count must be >= 1")
        if min(self.kv_cache_bytes, self.l3_bytes) < 0 or self.host_cache_bytes < 1:
            raise ValueError("kv_cache_bytes, l3_bytes: >= 0 (0 = sized from the trace); host_cache_bytes: > 0")
        names = [Setup.parse(s).name for s in self.setups]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"setups: need one or more distinct setups, got {self.setups}")

    def working_set_tokens(self) -> int:
        """Tokens one replica serving a whole run keeps cached at its end (the larger workload's)."""
        multi = self.clients * self.turns * (self.turn_tokens + self.answer_tokens)
        shared = self.groups * (self.system_tokens + self.group_requests * (self.user_tokens + self.answer_tokens))
        return max(multi, shared)


def shuffled(w: Workload, rng: random.Random) -> Workload:
    """``w``'s single-turn requests in ``rng``'s order; the first request of each prefix is then
    the one that cannot reuse it."""
    convs = list(w.conversations)
    rng.shuffle(convs)
    seen: set[tuple[int, ...]] = set()
    out = []
    for (turn,) in convs:
        out.append((replace(turn, shared_prefix_reusable=turn.prefix in seen),))
        seen.add(turn.prefix)
    return replace(w, name=f"{w.name} shuffled", conversations=tuple(out))


def make_workload(kind: str, cfg: ReplicasConfig, vocab: int, seed: int, repeat: int) -> Workload:
    """Fresh ids per ``seed``; the shared-prefix order depends on the repeat only, so every setup
    of a repeat sees the same pattern of groups."""
    if kind == "multi_turn":
        spec = MultiTurnSpec(cfg.clients, cfg.turns, cfg.turn_tokens, cfg.answer_tokens, max_parallel=cfg.clients)
        return multi_turn_workload(spec, vocab, seed)
    shared = SharedPrefixSpec(cfg.groups, cfg.group_requests, cfg.system_tokens, cfg.user_tokens, cfg.answer_tokens)
    return shuffled(shared_prefix_workload(shared, vocab, seed), random.Random(f"order/{cfg.seed}/{repeat}"))


# -- results ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunResult:
    setup: str
    workload: str
    repeat: int
    requests: int  # completed
    failed: int
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    ideal_tokens: int  # what an unbounded single cache could reuse
    output_tokens: int
    hit_rate: float  # cached / prompt
    output_tps: float
    total_tps: float  # (prompt + output) / s
    ttft_p50_ms: float
    ttft_p99_ms: float
    per_replica: dict[str, int]  # requests finished on each replica (r0, r1, ...)


@dataclass(frozen=True, slots=True)
class Spread:
    median: float
    min: float
    max: float

    @staticmethod
    def of(xs: list[float]) -> Spread:
        return Spread(statistics.median(xs), min(xs), max(xs))

    def fmt(self, scale: float = 1.0, spec: str = ".0f") -> str:
        m, lo, hi = (x * scale for x in (self.median, self.min, self.max))
        return f"{m:{spec}} ({lo:{spec}}–{hi:{spec}})"


@dataclass(frozen=True, slots=True)
class Summary:
    setup: str
    workload: str
    hit_rate: Spread
    hit_vs_single: float | None  # median hit rate / single's median (None: no single setup)
    output_tps: Spread
    total_tps: Spread
    ttft_p50_ms: Spread
    ttft_p99_ms: Spread
    per_replica: dict[str, int]  # summed over the repeats
    failed: int


@dataclass(frozen=True, slots=True)
class Goal:
    name: str
    workload: str
    value: float
    goal: float
    met: bool
    detail: str


@dataclass(frozen=True, slots=True)
class RouterCost:
    pages: int  # page keys in the index while choosing
    replicas: int
    page_tokens: int
    prompt_tokens: int
    lookups: int
    snapshot_us_per_page: float  # apply(snapshot): every replica's, per page, median over fresh indexes
    stored_us_per_page: float  # apply of a stored batch (one prompt's pages), median
    removed_us_per_page: float  # apply of a removed batch, median
    choose_hit_us: float  # Chooser.choose (kv) of a prompt one replica holds, median
    choose_miss_us: float  # of a prompt no replica holds, median
    keys_us: float  # of which: the prompt's chained page keys, median
    routed_to_holder: float  # share of held prompts sent to their holder with their whole prefix predicted


@dataclass(slots=True)
class Report:
    config: dict[str, Any]
    machine: dict[str, Any]
    workloads: dict[str, str] = field(default_factory=dict)
    runs: list[RunResult] = field(default_factory=list)
    summaries: list[Summary] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    router_cost: RouterCost | None = None
    elapsed_s: float = 0.0

    @property
    def failed(self) -> int:
        return sum(r.failed for r in self.runs)


def summaries(runs: list[RunResult], setups: list[str]) -> list[Summary]:
    out = []
    single = {w: statistics.median(r.hit_rate for r in runs if r.setup == "single" and r.workload == w)
              for w in WORKLOADS if any(r.setup == "single" and r.workload == w for r in runs)}  # fmt: skip
    for w in WORKLOADS:
        for s in setups:
            rs = [r for r in runs if r.setup == s and r.workload == w]
            if not rs:
                continue
            hit = Spread.of([r.hit_rate for r in rs])
            per: dict[str, int] = {}
            for r in rs:
                for k, v in r.per_replica.items():
                    per[k] = per.get(k, 0) + v
            ref = single.get(w)
            out.append(Summary(
                s, w, hit, hit.median / ref if ref else None, Spread.of([r.output_tps for r in rs]),
                Spread.of([r.total_tps for r in rs]), Spread.of([r.ttft_p50_ms for r in rs]),
                Spread.of([r.ttft_p99_ms for r in rs]), dict(sorted(per.items())), sum(r.failed for r in rs),
            ))  # fmt: skip
    return out


def goals(runs: list[RunResult], sums: list[Summary]) -> list[Goal]:
    """The two goals of issue #20 per workload, where the setups they compare were run."""
    out = []
    by = {(s.setup, s.workload): s for s in sums}
    for w in WORKLOADS:
        kv = by.get(("kv", w))
        if kv is not None and kv.hit_vs_single is not None:
            v = kv.hit_vs_single
            detail = f"medians {kv.hit_rate.median:.1%} / {kv.hit_rate.median / v if v else 0:.1%}"
            out.append(Goal("kv hit rate / single replica's", w, v, HIT_GOAL, v >= HIT_GOAL, detail))
        pairs = [a.output_tps / b.output_tps if b.output_tps else math.nan
                 for a, b in zip(_runs(runs, "kv", w), _runs(runs, "round_robin", w), strict=False)]  # fmt: skip
        if pairs:
            v = statistics.median(pairs)
            detail = f"median of {len(pairs)} paired runs, {min(pairs):.2f}–{max(pairs):.2f}"
            out.append(Goal("kv throughput / round_robin's", w, v, SPEED_GOAL, v >= SPEED_GOAL, detail))
    return out


def _runs(runs: list[RunResult], setup: str, workload: str) -> list[RunResult]:
    return sorted((r for r in runs if r.setup == setup and r.workload == workload), key=lambda r: r.repeat)


# -- the stacks ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Deployment:
    """One stack and a tokenizer per setup on it."""

    stack: Stack
    routers: dict[str, Child]  # setup name -> its tokenizer
    replicas: dict[str, str]  # scheduler address -> r0, r1, ...


def deploy(cfg: ReplicasConfig, setups: list[Setup], l3: bool, run_dir: Path, say: Say) -> Deployment:
    bpt = kv_bytes_per_token(cfg.model)
    ws = cfg.working_set_tokens() * bpt
    kv = cfg.kv_cache_bytes or math.ceil(ws * KV_POOL_MARGIN / MiB) * MiB
    worker: tuple[str, ...] = ("--kv-cache-bytes", str(kv), "--threads", str(cfg.worker_threads))
    worker += ("--host-cache-bytes", str(cfg.host_cache_bytes), "--l3", "true") if l3 else ("--host-cache-bytes", "0")
    kvstore = ("--capacity-bytes", str(cfg.l3_bytes or math.ceil(ws * L3_MARGIN / MiB) * MiB)) if l3 else ()
    first = next((s for s in setups if s.policy is not None), None)
    say(f"starting {cfg.replicas} replicas{' with the shared L3' if l3 else ''}: {kv / MiB:.0f} MiB KV pool each "
        f"(logs in {run_dir})")  # fmt: skip
    stack = start_stack(
        cfg.model, free_port(), run_dir, replicas=cfg.replicas, worker_args=worker, kvstore_args=kvstore,
        common_args=("--metrics-port", "0"), tokenizer_args=("--router-policy", (first and first.policy) or "kv"),
        say=lambda _: None,
    )  # fmt: skip
    try:
        routers = {first.name: stack.child("tokenizer")} if first else {}
        for s in setups:
            if s.name not in routers:
                routers[s.name] = add_tokenizer(stack, cfg.model, s)
    except BaseException:
        stack.stop()
        raise
    names = ["scheduler", *(f"scheduler-{i}" for i in range(1, cfg.replicas))]
    return Deployment(stack, routers, {stack.child(n).address: f"r{i}" for i, n in enumerate(names)})


def add_tokenizer(stack: Stack, model: Path, setup: Setup) -> Child:
    """Another tokenizer on ``stack`` for ``setup``: its own router over the same replicas (or
    pinned to the first one); stopped with the stack."""
    if setup.policy is None:
        route: tuple[str, ...] = ("--scheduler", stack.child("scheduler").address)
    else:
        route = ("--router-policy", setup.policy)
    name = f"tokenizer-{setup.name.replace('+', '-')}"
    argv = [sys.executable, "-m", "services.tokenizer", "--model", str(model), "--port", "0",
            "--http-port", "0", "--etcd", stack.etcd_endpoint, "--metrics-port", "0", *route]  # fmt: skip
    child = Child(name, argv, stack.run_dir / f"{name}.log")
    stack.children.append(child)
    child.start(dict(os.environ, PYTHONUNBUFFERED="1"))
    child.wait_ready(120.0)
    return child


def routed_requests(metrics_address: str) -> dict[str, float]:
    """A tokenizer's ``strata_tokenizer_routed_requests_total``, by replica address."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.labels["replica"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "strata_tokenizer_routed_requests"
        for s in family.samples
        if s.name.endswith("_total")
    }


async def measure(
    dep: Deployment, setups: list[Setup], cfg: ReplicasConfig, report: Report, t0: float, say: Say
) -> None:
    """Every repeat, workload and setup on ``dep``; the setups' order rotates each repeat."""
    index = {name: i for i, name in enumerate(cfg.setups)}
    backends = {s.name: GrpcBackend(dep.routers[s.name].address, s.name) for s in setups}
    try:
        async with grpc.aio.insecure_channel(dep.routers[setups[0].name].address) as ch:
            info = await pgrpc.StrataStub(ch).GetModelInfo(pb.GetModelInfoRequest())
        for kind in WORKLOADS:
            w = make_workload(kind, cfg, info.vocab_size, cfg.seed, 0)
            report.workloads[kind] = w.describe()
            if max_context_needed(w) > info.context_length:
                raise ValueError(f"{kind}: requests of {max_context_needed(w)} tokens exceed the model's context "
                                 f"length {info.context_length}")  # fmt: skip
        for b in backends.values():  # first-call costs of every replica stay out of the runs
            await warm_up(b, info.vocab_size, requests=4 * cfg.replicas)
        for rep in range(cfg.repeats):
            k = rep % len(setups)
            for kind in WORKLOADS:
                for s in setups[k:] + setups[:k]:
                    seed = cfg.seed + 1000 * rep + index[s.name]  # fresh ids: nothing cached from another run
                    w = make_workload(kind, cfg, info.vocab_size, seed, rep)
                    r = await _run(dep, s.name, backends[s.name], w, kind, rep, cfg, say)
                    report.runs.append(r)
                    hit = f"{r.hit_rate:.1%}"
                    say(f"[{(time.monotonic() - t0) / 60:4.1f} min] repeat {rep + 1}/{cfg.repeats} · {s.name} · "
                        f"{kind}: {r.requests} ok / {r.failed} failed in {r.seconds:.0f}s, hit {hit}, "
                        f"{r.output_tps:.0f} out tok/s, TTFT p50 {r.ttft_p50_ms:.0f} ms, "
                        f"per replica {'/'.join(map(str, r.per_replica.values()))}")  # fmt: skip
    finally:
        for b in backends.values():
            await b.close()


async def _run(
    dep: Deployment, setup: str, backend: GrpcBackend, w: Workload, kind: str, rep: int, cfg: ReplicasConfig, say: Say
) -> RunResult:
    metrics = dep.routers[setup].extra["metrics"]
    before = await asyncio.to_thread(routed_requests, metrics)
    concurrency = cfg.clients if kind == "multi_turn" else cfg.shared_concurrency
    records, duration = await replay(backend, w, concurrency, say, cfg.run_timeout_s)
    await asyncio.sleep(SETTLE_S)
    after = await asyncio.to_thread(routed_requests, metrics)
    per = {name: int(after.get(a, 0) - before.get(a, 0)) for a, name in dep.replicas.items()}
    m = summarize(f"{setup} {kind} #{rep + 1}", records, duration)
    ttft = m.ttft_s
    return RunResult(
        setup, kind, rep, m.requests, m.failed, duration, m.prompt_tokens, m.cached_tokens, m.ideal_reuse,
        m.output_tokens, m.cache_hit_rate or 0.0, m.output_throughput, m.total_throughput,
        ttft.median * 1e3 if ttft else 0.0, ttft.p99 * 1e3 if ttft else 0.0, per,
    )  # fmt: skip


def run_bench(cfg: ReplicasConfig, run_dir: Path, say: Say = print) -> Report:
    """Run every setup (a stack per cache mode), then the router-cost microbenchmark."""
    from services.bench.cli import machine_info

    t0 = time.monotonic()
    cfgd = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    report = Report(cfgd, {**machine_info(cfg.model), "torch_threads": cfg.worker_threads})  # per worker
    setups = [Setup.parse(s) for s in cfg.setups]
    for l3 in (False, True):
        group = [s for s in setups if s.l3 == l3]
        if not group:
            continue
        dep = deploy(cfg, group, l3, run_dir / ("l3" if l3 else "no-l3"), say)
        try:
            asyncio.run(measure(dep, group, cfg, report, t0, say))
        finally:
            dep.stack.stop()
    report.summaries = summaries(report.runs, list(cfg.setups))
    report.goals = goals(report.runs, report.summaries)
    say(f"router cost: {cfg.router_pages} pages over {cfg.replicas} replicas")
    report.router_cost = router_cost(cfg.router_pages, cfg.replicas, cfg.router_prompt_tokens, cfg.router_lookups,
                                     cfg.seed)  # fmt: skip
    report.machine["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    report.elapsed_s = time.monotonic() - t0
    return report


# -- router cost -----------------------------------------------------------------------------------


def router_cost(
    pages: int = 100_000, replicas: int = 4, prompt_tokens: int = 2000, lookups: int = 2000, seed: int = 0
) -> RouterCost:
    """Build a ``KvIndex`` of ``pages`` page keys over ``replicas`` replicas from prompts of
    ``prompt_tokens``, prompt j held by replica j % replicas (half of each replica's prompts come in
    its snapshot, the rest one stored batch per prompt); time ``choose`` at that size; then remove
    one batch per prompt. Snapshots are timed on ``SNAPSHOT_REPEATS`` fresh indexes (median)."""
    keying = PageKeying(ROUTE_PAGE_TOKENS, "router-cost", "bench")
    rng = random.Random(f"router-cost/{seed}")
    per_prompt = max(prompt_tokens // keying.page_tokens, 1)
    ids = range(FIRST_ID, ROUTER_VOCAB)
    prompts = [rng.choices(ids, k=per_prompt * keying.page_tokens) for _ in range(math.ceil(pages / per_prompt))]
    keys = [keying.keys(p) for p in prompts]
    keys[-1] = keys[-1][: pages - per_prompt * (len(prompts) - 1)]  # exactly `pages` keys
    addresses = [f"replica-{i}" for i in range(replicas)]
    mine = [list(range(i, len(prompts), replicas)) for i in range(replicas)]
    snapshots = [[k for j in js[: len(js) // 2] for k in keys[j]] for js in mine]
    batches = [(a, j) for a, js in zip(addresses, mine, strict=True) for j in js[len(js) // 2 :]]

    def timed(index: KvIndex, a: str, event_id: int, stored: list[bytes], removed: list[bytes]) -> float:
        """µs per page of one apply (event id 0: a snapshot)."""
        t = time.perf_counter_ns()
        ok = index.apply(a, epoch=1, event_id=event_id, snapshot=not event_id, stored=stored, removed=removed,
                         keying=keying if not event_id else None)  # fmt: skip
        dt = (time.perf_counter_ns() - t) / 1e3
        assert ok, "the batches follow each other"
        return dt / max(len(stored) + len(removed), 1)

    snapshot_us = []
    for _ in range(SNAPSHOT_REPEATS):  # the last index is the one used below
        index = KvIndex()
        total = sum(timed(index, a, 0, snap, []) * len(snap) for a, snap in zip(addresses, snapshots, strict=True))
        snapshot_us.append(total / max(sum(map(len, snapshots)), 1))
    events = dict.fromkeys(addresses, 0)

    def next_id(a: str) -> int:
        events[a] += 1
        return events[a]

    stored_us = [timed(index, a, next_id(a), keys[j], []) for a, j in batches]
    held = index.pages
    assert held == pages, (held, pages)

    chooser = Chooser(index, "kv")
    full = [j for j in range(len(prompts)) if len(keys[j]) == per_prompt]
    misses = [rng.choices(ids, k=prompt_tokens) for _ in range(min(lookups, 64))]
    hit_us, miss_us, keys_us, right = [], [], [], 0
    for i in range(lookups):
        j = full[rng.randrange(len(full))]
        t = time.perf_counter_ns()
        c = chooser.choose(addresses, prompts[j])
        hit_us.append((time.perf_counter_ns() - t) / 1e3)
        right += c.address == addresses[j % replicas] and c.overlap_tokens == len(prompts[j]) - 1
        miss = misses[i % len(misses)]
        t = time.perf_counter_ns()
        chooser.choose(addresses, miss)
        miss_us.append((time.perf_counter_ns() - t) / 1e3)
        t = time.perf_counter_ns()
        keying.keys(miss)
        keys_us.append((time.perf_counter_ns() - t) / 1e3)

    removed_us = [timed(index, a, next_id(a), [], keys[j]) for a, js in zip(addresses, mine, strict=True) for j in js]
    assert index.pages == 0
    return RouterCost(
        held, replicas, keying.page_tokens, per_prompt * keying.page_tokens, lookups,
        statistics.median(snapshot_us), statistics.median(stored_us) if stored_us else 0.0,
        statistics.median(removed_us), statistics.median(hit_us), statistics.median(miss_us),
        statistics.median(keys_us), right / lookups,
    )  # fmt: skip


# -- output ----------------------------------------------------------------------------------------


def markdown(report: Report) -> str:
    m, c = report.machine, report.config
    lines = [
        f"Measured {m.get('date', '?')} on {m.get('cpu', '?')} ({m.get('cores', '?')} cores, load average "
        f"{m.get('load_start', '?')} at the start, {m.get('load_end', '?')} at the end); model `{c['model']}` "
        f"({m.get('params_m', '?')} M parameters); {c['replicas']} replicas, {c['repeats']} repeats, "
        f"{c['worker_threads']} torch thread(s) per worker; whole run {report.elapsed_s / 60:.1f} min.",
        "",
        *(f"- {kind}: {desc}" for kind, desc in report.workloads.items()),
        "",
        "| workload | setup | hit rate | vs single | out tok/s | total tok/s | TTFT p50 ms | TTFT p99 ms "
        "| requests per replica | failed |",
        "|---|---|---|---|---|---|---|---|---|---:|",
    ]
    for s in report.summaries:
        vs = f"{s.hit_vs_single:.3f}" if s.hit_vs_single is not None else "–"
        lines.append(
            f"| {s.workload.replace('_', ' ')} | {s.setup} | {s.hit_rate.fmt(100, '.1f')} % | {vs} "
            f"| {s.output_tps.fmt()} | {s.total_tps.fmt()} | {s.ttft_p50_ms.fmt()} | {s.ttft_p99_ms.fmt()} "
            f"| {' / '.join(map(str, s.per_replica.values()))} | {s.failed} |"
        )
    if report.goals:
        lines += ["", "| goal | workload | value | bar | verdict |", "|---|---|---:|---|---|"]
        for g in report.goals:
            lines.append(f"| {g.name} ({g.detail}) | {g.workload.replace('_', ' ')} | {g.value:.3f} | ≥ {g.goal:g} "
                         f"| {'met' if g.met else '**missed**'} |")  # fmt: skip
    rc = report.router_cost
    if rc is not None:
        lines += [
            "",
            f"Router cost: `KvIndex` of {rc.pages:,} page keys ({rc.page_tokens} tokens each) over {rc.replicas} "
            f"replicas, {rc.prompt_tokens}-token prompts, {rc.lookups} lookups; held prompts routed to their "
            f"holder: {rc.routed_to_holder:.0%}.",
            "",
            "| operation | µs |",
            "|---|---:|",
            f"| `apply`, snapshot, per page | {rc.snapshot_us_per_page:.2f} |",
            f"| `apply`, stored batch, per page (median) | {rc.stored_us_per_page:.2f} |",
            f"| `apply`, removed batch, per page (median) | {rc.removed_us_per_page:.2f} |",
            f"| `Chooser.choose` (kv), prompt held by one replica (median) | {rc.choose_hit_us:.0f} |",
            f"| `Chooser.choose` (kv), prompt held by none (median) | {rc.choose_miss_us:.0f} |",
            f"| of which the prompt's page keys (median) | {rc.keys_us:.0f} |",
        ]
    return "\n".join(lines) + "\n"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    d = ReplicasConfig(Path("models/qwen3-bench"))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=d.model)
    p.add_argument("--run-dir", type=Path, default=Path(".runs/bench-replicas"))
    p.add_argument("--out", type=Path, default=Path("docs/bench/replicas.json"))
    p.add_argument("--setups", default=",".join(d.setups), help="comma-separated: single, kv, round_robin, "
                   "least_load, each optionally with +l3")  # fmt: skip
    sizes = ("replicas", "repeats", "clients", "turns", "turn_tokens", "answer_tokens", "groups", "group_requests",
             "system_tokens", "user_tokens", "shared_concurrency", "worker_threads", "kv_cache_bytes",
             "host_cache_bytes", "l3_bytes", "router_pages", "router_prompt_tokens", "router_lookups",
             "seed")  # fmt: skip
    for name in sizes:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--run-timeout-s", type=float, default=d.run_timeout_s)
    args = p.parse_args(argv)
    if not (args.model / "config.json").exists():
        p.error(f"{args.model} is not a model directory (make {args.model}/config.json generates the bench model)")
    signal.signal(signal.SIGTERM, _interrupt)  # stop the services on `kill` / `timeout` too
    fields = {k: v for k, v in vars(args).items() if k not in ("run_dir", "out", "setups")}
    try:
        cfg = ReplicasConfig(**fields, setups=tuple(s.strip() for s in args.setups.split(",") if s.strip()))
    except ValueError as e:
        p.error(str(e))
    report = run_bench(cfg, args.run_dir, say=lambda msg: print(msg, file=sys.stderr, flush=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(report), indent=1) + "\n")
    print(markdown(report))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
