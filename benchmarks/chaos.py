"""The chaos run of issue #29: two replicas under steady mixed load while, every 30 s, one service
is SIGKILLed or SIGSTOPped for 10 s; count what the clients lost and every service's RSS slope.

    python -m benchmarks.chaos --model models/qwen3-tiny --minutes 5 [--out docs/bench/chaos_short.json]
        [--plot docs/bench/chaos_short.png] [--run-dir .runs/chaos-short]

The stack is ``strata up --replicas 2 --restart on-failure`` (etcd, kvstore, worker + scheduler
twice, tokenizer; the hierarchical cache with L3 on), run as a user runs it: the supervisor
restarts every process it started, etcd included (on its ports and data directory, so keys and
leases survive). The rig checks that every SIGKILLed process comes back: a new process, and the
supervisor's ``<name> restarted at`` line.

Load (benchmarks/chaos_load.py): ``--grpc-clients`` and ``--http-clients`` loops (the official
``openai`` client for HTTP), each sending greedy streamed requests one after another: text, token
ids and chat messages over gRPC, completions and chat completions over HTTP; prompts of 2 to ~700
tokens, most sharing a document prefix with others. Every output is checked against transformers'
greedy output of the same ids (prompts with a near-tie anywhere on their greedy path are drawn
again), after one undisturbed pass over every prompt and front confirms the stack agrees.

Faults: at ``--first-s`` and every ``--every-s`` after, round robin over worker, scheduler,
tokenizer, kvstore, etcd; SIGKILL for the first five, SIGSTOP (``--stop-s``, then SIGCONT) for the
next five, and so on; worker and scheduler faults alternate between the two replicas. A 5-minute
run hits every (service, signal) pair once.

Measured (benchmarks/chaos_report.py): sent / completed / ok / duplicated / skipped / wrong /
failed (the client's connection on a killed tokenizer, or lost) with reasons, stalls and resume
latencies per kind of fault, every service's RSS (from /proc, every ``--rss-every-s``) and its
slope in MiB/h after each process's ``--warmup-s``. Writes ``--out`` (JSON), ``--plot`` (PNG) and
prints the markdown tables; exits 1 unless the issue's goal is met (0 lost but on a killed
tokenizer, 0 wrong or duplicated, every slope <= 10 MiB/h).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import psutil

from benchmarks.chaos_load import Endpoints, Outcome, Prompt, client_loop, make_prompts, reference, verify
from benchmarks.chaos_report import FaultRecord, RssSample, Summary, log_events, plot, summarize, tables

MiB = 1 << 20
TARGETS = ("worker", "scheduler", "tokenizer", "kvstore", "etcd")
REPLICATED = ("worker", "scheduler")  # one per replica: "worker", "worker-1"
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    minutes: float = 5.0  # of load; faults within it
    first_s: float = 15.0  # the first fault, after this much undisturbed load
    every_s: float = 30.0
    stop_s: float = 10.0  # SIGSTOP .. SIGCONT
    grpc_clients: int = 6
    http_clients: int = 4
    think_s: float = 0.2  # a client's pause between requests: up to this, uniform
    request_timeout_s: float = 120.0
    drain_s: float = 150.0  # after the load: how long the requests still in flight may take
    margin: float = 2e-3  # smallest top-1 minus top-2 logit along a prompt's greedy path
    rss_every_s: float = 2.0
    warmup_s: float = 30.0  # of each process's life, before its RSS counts toward the slope
    restart_deadline_s: float = 60.0
    kv_cache_bytes: str = "8MiB"  # per worker (~8k tokens of the tiny model): evicts, so L2 and L3 serve too
    host_cache_bytes: str = "16MiB"
    seed: int = 0
    # Services (comma-separated: "worker-1,tokenizer") that are only ever SIGSTOPped, their kills
    # turned into stops: they live the whole run, so their RSS slope spans it (`make chaos-long-lived`).
    spare: str = ""

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.every_s <= self.stop_s or self.grpc_clients + self.http_clients < 1:
            raise ValueError("need minutes > 0, every_s > stop_s and at least one client")
        known = {*TARGETS, *(f"{t}-1" for t in REPLICATED)}
        unknown = sorted(set(self.spared) - known)
        if unknown:
            raise ValueError(f"spare: unknown services {unknown}; known: {sorted(known)}")

    @property
    def spared(self) -> tuple[str, ...]:
        return tuple(x for x in self.spare.split(",") if x)


@dataclass(frozen=True, slots=True)
class Fault:
    at: float  # seconds after the load starts
    target: str  # a service name: "worker", "worker-1", "etcd", ...
    action: Literal["kill", "stop"]


def schedule(cfg: ChaosConfig) -> list[Fault]:
    """Fault ``k`` at ``first_s + k * every_s`` (within the run): target ``TARGETS[k % 5]``, kill for
    ``k // 5`` even and stop for odd; worker / scheduler on replica 0 or 1 so that every 20 faults
    cover every (service, replica, signal). A service in ``spare`` is stopped where it would be killed."""
    out: list[Fault] = []
    for k in itertools.count():
        at = cfg.first_s + k * cfg.every_s
        if at >= cfg.minutes * 60:
            return out
        target = TARGETS[k % len(TARGETS)]
        replica = (k // 5 + k // 10) % 2
        if target in REPLICATED and replica:
            target = f"{target}-1"
        kill = (k // 5) % 2 == 0 and target not in cfg.spared
        out.append(Fault(at, target, "kill" if kill else "stop"))
    return out


class Stack:
    """``strata up --replicas 2 --restart on-failure``, its own etcd included."""

    def __init__(self, model: Path, cfg: ChaosConfig, run_dir: Path) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        for old in run_dir.glob("*.log"):
            old.unlink()
        self.argv = [
            sys.executable, "-m", "services.cli", "up", "--model", str(model), "--replicas", "2",
            "--restart", "on-failure", "--port", "0", "--http-port", "-1", "--run-dir", str(run_dir),
            "--example", "", "--kv-cache-bytes", cfg.kv_cache_bytes, "--host-cache-bytes", cfg.host_cache_bytes,
        ]  # fmt: skip
        self.up: subprocess.Popen[str] | None = None
        self.lines: list[tuple[float, str]] = []  # strata up's output, with arrival times

    def start(self, say: Callable[[str], None], timeout_s: float = 300.0) -> Endpoints:
        self.up = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not any("Ctrl-C stops all services" in x for _, x in self.lines):
            if time.monotonic() > deadline or self.up.poll() is not None:
                raise RuntimeError("strata up did not start:\n" + self.output())
            time.sleep(0.2)
        text = self.output()
        grpc_addr = re.search(r"^tokenizer +(\S+)", text, re.M)
        http = re.search(r"^http +http://(\S+)/v1", text, re.M)
        model = re.search(r"\(model '([^']+)'\)", text)
        if grpc_addr is None or http is None or model is None:
            raise RuntimeError("strata up printed no tokenizer / http endpoint:\n" + text)
        say(text)
        return Endpoints(grpc_addr.group(1), http.group(1), model.group(1))

    def _read(self) -> None:
        assert self.up is not None and self.up.stdout is not None
        for line in iter(self.up.stdout.readline, ""):
            self.lines.append((time.monotonic(), line))

    def output(self) -> str:
        return "".join(x for _, x in self.lines)

    def pids(self) -> dict[str, int]:
        """Every service's current process: strata up's children by the log their stdout goes to
        (``<run_dir>/worker-1.log``), and its etcd by name."""
        out: dict[str, int] = {}
        assert self.up is not None
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.up.pid).children():
                with contextlib.suppress(OSError, psutil.NoSuchProcess):
                    if child.name() == "etcd":
                        out["etcd"] = child.pid
                        continue
                    log = Path(os.readlink(f"/proc/{child.pid}/fd/1"))
                    if log.parent == self.run_dir.resolve() and log.suffix == ".log":
                        out[log.stem] = child.pid
        return out

    def restarted_line(self, name: str, after: float) -> float | None:
        """When strata up said ``<name> restarted at`` after ``after`` (monotonic), if it did."""
        return next((t for t, x in self.lines if t > after and x.startswith(f"{name} restarted at ")), None)

    def stop(self) -> None:
        if self.up is not None and self.up.poll() is None:
            self.up.send_signal(signal.SIGINT)
            try:
                self.up.wait(60)
            except subprocess.TimeoutExpired:
                self.up.kill()


async def _inject(stack: Stack, cfg: ChaosConfig, f: Fault, t0: float, say: Callable[[str], None]) -> FaultRecord:
    pid = stack.pids().get(f.target, 0)
    if not pid:
        raise RuntimeError(f"{f.target} has no process to {f.action} at {f.at:.0f}s")
    now = time.monotonic()
    rec = FaultRecord(now - t0, f.target, f.action, pid, ended=now - t0)
    if f.action == "stop":
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(cfg.stop_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        rec.ended = time.monotonic() - t0
        say(f"{rec.at:6.1f}s  {f.target} (pid {pid}) stopped for {rec.ended - rec.at:.1f}s")
        return rec
    os.kill(pid, signal.SIGKILL)
    rec.restarted_by = "strata up"
    deadline = now + cfg.restart_deadline_s
    while time.monotonic() < deadline:  # a new process, and the supervisor saying it is ready
        new = stack.pids().get(f.target, 0)
        ready = stack.restarted_line(f.target, now)
        if new and new != pid and ready is not None:
            rec.new_pid, rec.restarted_s = new, ready - now
            break
        await asyncio.sleep(0.1)
    seen = f"back after {rec.restarted_s:.1f}s" if rec.restarted_s is not None else "NOT restarted"
    say(f"{rec.at:6.1f}s  {f.target} (pid {pid}) killed; {seen} ({rec.restarted_by})")
    return rec


async def _sample_rss(stack: Stack, t0: float, every_s: float, out: list[RssSample], stop: asyncio.Event) -> None:
    while not stop.is_set():
        now = time.monotonic()
        for name, pid in sorted(stack.pids().items()):
            with contextlib.suppress(psutil.NoSuchProcess):
                p = psutil.Process(pid)
                age = time.time() - p.create_time()
                out.append(RssSample(round(now - t0, 3), name, pid, round(age, 3), p.memory_info().rss / MiB))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


@dataclass(slots=True)
class ChaosRun:
    config: ChaosConfig
    prompts: list[Prompt]
    outcomes: list[Outcome]
    faults: list[FaultRecord]
    samples: list[RssSample]
    summary: Summary
    reference_problems: list[str]
    logs: dict[str, int]  # chaos_report.LOG_EVENTS counted in the services' logs
    wall_s: float

    def to_json(self) -> dict[str, object]:
        return {
            "config": asdict(self.config),
            "summary": self.summary.to_json(),
            "faults": [asdict(f) for f in self.faults],
            "reference_problems": self.reference_problems,
            "logs": self.logs,
            "prompts": [
                {
                    "key": p.key,
                    "kind": p.kind,
                    "prompt_tokens": len(p.ids),
                    "max_new_tokens": p.max_new_tokens,
                    "margin": round(p.margin, 5),
                }
                for p in self.prompts
            ],
            "rss": [asdict(s) for s in self.samples],
            "wall_s": self.wall_s,
        }


async def _load(stack: Stack, ep: Endpoints, cfg: ChaosConfig, prompts: list[Prompt], say: Callable[[str], None]
                ) -> tuple[list[Outcome], list[FaultRecord], list[RssSample], float, int]:  # fmt: skip
    outcomes: list[Outcome] = []
    faults: list[FaultRecord] = []
    samples: list[RssSample] = []
    numbers = itertools.count()
    t0 = time.monotonic()
    end = t0 + cfg.minutes * 60
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_rss(stack, t0, cfg.rss_every_s, samples, stop))
    rng = random.Random(cfg.seed)
    sides = ["grpc"] * cfg.grpc_clients + ["http"] * cfg.http_clients
    clients = [
        asyncio.create_task(client_loop(
            ep, side, prompts, random.Random(rng.random()), lambda: time.monotonic() < end,  # type: ignore[arg-type]
            outcomes.append, lambda: next(numbers), cfg.request_timeout_s, cfg.think_s,
        ))
        for side in sides
    ]  # fmt: skip

    async def faulting() -> None:
        for f in schedule(cfg):
            await asyncio.sleep(max(0.0, t0 + f.at - time.monotonic()))
            faults.append(await _inject(stack, cfg, f, t0, say))
            assert stack.up is not None
            if stack.up.poll() is not None:
                raise RuntimeError("strata up exited:\n" + stack.output()[-4000:])

    injector = asyncio.create_task(faulting())
    try:
        while time.monotonic() < end:
            await asyncio.sleep(min(30.0, max(0.0, end - time.monotonic())))
            n = len(outcomes)
            bad = sum(1 for o in outcomes if o.error or o.finish != "length")
            say(f"{time.monotonic() - t0:6.1f}s  {n} requests ended, {bad} without finishing")
            if injector.done():
                injector.result()  # raises what stopped it
        await injector
        _, pending = await asyncio.wait(clients, timeout=cfg.drain_s)
        for task in pending:  # a request still in flight after the drain: counted as lost
            task.cancel()
        ended = await asyncio.gather(*clients, return_exceptions=True)
        broken = [e for e in ended if isinstance(e, Exception)]  # a cancelled client is not one
        if broken:
            raise broken[0]
    finally:
        stop.set()
        await sampler
        injector.cancel()
    return outcomes, faults, samples, t0, len(pending)


def run_chaos(model: Path, cfg: ChaosConfig, run_dir: Path, say: Callable[[str], None] = print) -> ChaosRun:
    """Start the stack, fix the reference, run the load under faults, stop every process."""
    stack = Stack(model, cfg, run_dir)
    start = time.monotonic()
    try:
        ep = stack.start(say)
        prompts = make_prompts(random.Random(cfg.seed))
        reference(model, ep.http, prompts, random.Random(cfg.seed + 1), cfg.margin)
        problems = asyncio.run(verify(ep, prompts, cfg.request_timeout_s))
        for p in problems:
            say(f"reference: {p}")
        bad = {x.split()[0] for x in problems}
        kept = [p for p in prompts if p.key not in bad]
        if len(kept) < len(prompts) // 2:
            raise RuntimeError(f"the undisturbed stack disagrees with transformers on {len(bad)} prompts: {problems}")
        mean = sum(len(p.ids) for p in kept) / len(kept)
        least = min(p.margin for p in kept)
        say(f"reference: {len(kept)} prompts, {mean:.0f} tokens on average, greedy margins >= {least:.4f}")
        outcomes, faults, samples, t0, unfinished = asyncio.run(_load(stack, ep, cfg, kept, say))
    finally:
        stack.stop()
    summary = summarize(outcomes, {p.key: p for p in kept}, faults, samples, t0, cfg.warmup_s, unfinished)
    logs = log_events(run_dir)
    return ChaosRun(cfg, kept, outcomes, faults, samples, summary, problems, logs, time.monotonic() - start)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    d = ChaosConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("models/qwen3-tiny"))
    p.add_argument("--run-dir", type=Path, default=Path(".runs/chaos"))
    p.add_argument("--out", type=Path, default=Path("docs/bench/chaos.json"))
    p.add_argument("--plot", type=Path, default=None, help="write the RSS plot here (PNG)")
    for name, value in asdict(d).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the services on `kill` / `timeout` too
    cfg = ChaosConfig(**{k: getattr(args, k) for k in asdict(d)})
    run = run_chaos(args.model, cfg, args.run_dir, say=lambda m: print(m, file=sys.stderr, flush=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(run.to_json(), indent=1) + "\n")
    print(tables(run.summary, run.faults))
    print("\n" + "\n".join(f"- {label}: {n}" for label, n in run.logs.items()))
    if args.plot is not None:
        print(f"\nplot: {plot(run.samples, run.faults, args.plot, cfg.warmup_s)}")
    s = run.summary
    print(
        f"\n{s.sent} sent in {cfg.minutes:g} min under {len(run.faults)} faults; normal inter-token gap p99 "
        f"{s.normal_gap_p99_s * 1000:.0f} ms; goal {'met' if s.goal_met else 'NOT met'}"
    )
    for problem in run.reference_problems:
        print(f"reference problem (prompt left out): {problem}")
    return 0 if s.goal_met and not run.reference_problems else 1


if __name__ == "__main__":
    sys.exit(main())
