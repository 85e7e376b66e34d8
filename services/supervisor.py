"""``strata up``: start etcd and the four services as separate processes, health-gated, and stop
them all cleanly on Ctrl-C or as soon as one of them dies — or, with ``--restart on-failure``,
restart a service that crashed (exit code not 0) after a backoff, at the address it had, and the
etcd it started (not an ``--etcd`` endpoint), whatever way that ended, on its ports and data.

Each child is ``python -m services.<name>.server`` with flags; its output goes to
``<run_dir>/<name>.log`` and it announces readiness with one ``READY <name> <address>`` line.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from services.common.etcd_proc import EtcdError, EtcdProcess, free_port, tied
from services.common.tls import TlsFiles

ETCD = "etcd"  # the name etcd goes by among the restarts
RESTART_BACKOFF_S = (1.0, 30.0)  # wait before restarting a crashed service: first, most (doubling)
RESTART_RESET_S = 60.0  # a service that ran this long before crashing waits the first backoff again
RestartPolicy = Literal["no", "on-failure"]
READY_POLL_S = 0.1  # how often a starting service's log is read for its READY line


class StartError(RuntimeError):
    """A service did not become ready; the message includes the end of its log."""


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""
    extra: dict[str, str] = field(default_factory=dict)  # key=value fields of the READY line
    _offset: int = 0  # where this start's output begins in the (appended) log

    def start(self, env: dict[str, str]) -> None:
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        argv, preexec = tied(self.argv)
        self.proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=preexec
        )
        log.close()

    def ready(self) -> bool:
        """Whether this start has printed its READY line (then ``address`` and ``extra`` are set).

        Raises:
            StartError: the process has exited before it was ready.
        """
        with open(self.log_path, "rb") as f:  # only this start's lines: an old READY is stale
            f.seek(self._offset)
            lines = f.read().decode(errors="replace").splitlines()
        for line in lines:
            if line.startswith(f"READY {self.name.split('-')[0]} "):  # worker-1 prints "READY worker"
                words = line.split()
                self.address = words[2]
                self.extra = dict(w.split("=", 1) for w in words[3:] if "=" in w)
                return True
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise StartError(f"{self.name} exited with code {self.proc.returncode}:\n{self.tail()}")
        return False

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() >= deadline:
                raise StartError(f"{self.name} was not ready within {timeout_s:.0f}s:\n{self.tail()}")
            time.sleep(READY_POLL_S)
        return self.address

    def pin_ports(self) -> None:
        """Listen where this start listened (gRPC port, and the HTTP port when it serves one), so
        that a restart keeps the address its peers, clients and etcd key know."""
        for flag, address in (("--port", self.address), ("--http-port", self.extra.get("http", "")
                                                          or self.extra.get("https", ""))):
            if not address:
                continue
            port = address.rsplit(":", 1)[1]
            if flag in self.argv:
                self.argv[self.argv.index(flag) + 1] = port
            else:
                self.argv += [flag, port]

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join("    " + t for t in text[-lines:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass(slots=True)
class Stack:
    """The running services of one ``strata up``."""

    run_dir: Path
    etcd: EtcdProcess | None = None
    etcd_endpoint: str = ""
    children: list[Child] = field(default_factory=list)

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def stop(self) -> None:
        for c in reversed(self.children):
            c.stop()
        if self.etcd is not None:
            self.etcd.stop()

    def dead(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)


def _module(name: str) -> list[str]:
    # The tokenizer's package entry runs it without torch (services/tokenizer/torchless.py).
    return [sys.executable, "-m", "services.tokenizer" if name == "tokenizer" else f"services.{name}.server"]


def _scheduler_argv(stack: Stack, worker: str, base: list[str]) -> list[str]:
    """``base`` plus ``--worker`` the address of ``worker`` (a started child), unless empty."""
    return [*base, *(("--worker", stack.child(worker).address) if worker else ())]


@dataclass(frozen=True, slots=True)
class _Spec:
    """One service to start: its argv (or how to build it once ``after`` are ready)."""

    name: str
    argv: list[str] | Callable[[], list[str]]
    after: tuple[str, ...] = ()  # services that must be ready before this one starts


def _start_all(
    stack: Stack, specs: list[_Spec], env: dict[str, str], timeout_s: float, announce: Callable[[Child], None]
) -> None:
    """Start every spec as soon as the services it waits for are ready, side by side otherwise;
    return when all are ready. Each is announced once it and those listed before it are ready,
    so the start-up table keeps the order of ``specs``."""
    pending = list(specs)
    started: dict[str, float] = {}  # name -> when it started
    ready: set[str] = set()
    announced = 0
    while announced < len(specs):
        for spec in [p for p in pending if ready.issuperset(p.after)]:
            pending.remove(spec)
            child = Child(spec.name, spec.argv() if callable(spec.argv) else spec.argv,
                          stack.run_dir / f"{spec.name}.log")  # fmt: skip
            stack.children.append(child)
            child.start(env)
            started[spec.name] = time.monotonic()
        for child in stack.children:
            if child.name in started and child.name not in ready:
                if child.ready():
                    ready.add(child.name)
                elif time.monotonic() - started[child.name] > timeout_s:
                    raise StartError(f"{child.name} was not ready within {timeout_s:.0f}s:\n{child.tail()}")
        while announced < len(specs) and specs[announced].name in ready:
            announce(stack.child(specs[announced].name))
            announced += 1
        if announced < len(specs):
            time.sleep(READY_POLL_S)


def _announce(say: Callable[[str], None], width: int, child: Child) -> None:
    metrics = f"   metrics http://{child.extra['metrics']}/metrics" if "metrics" in child.extra else ""
    say(f"{child.name:<{width}} {child.address}{metrics}   (log: {child.log_path})")
    for scheme in ("http", "https"):
        if scheme in child.extra:
            say(f"{scheme:<{width}} {scheme}://{child.extra[scheme]}/v1   (OpenAI-compatible)")


def start_stack(
    model: Path,
    port: int,
    run_dir: Path,
    etcd: str = "",
    worker_args: tuple[str, ...] = (),
    scheduler_args: tuple[str, ...] = (),
    common_args: tuple[str, ...] = (),
    kvstore_args: tuple[str, ...] = (),
    tokenizer_args: tuple[str, ...] = (),
    http_port: int = 0,
    timeout_s: float = 120.0,
    say: Callable[[str], None] = print,
    replicas: int = 1,
    etcd_tls: TlsFiles | None = None,
    roles: tuple[str, ...] = (),
    replica_worker_args: Sequence[tuple[str, ...]] = (),
    grammar_preload: bool = True,
) -> Stack:
    """Start etcd (unless an endpoint is given), then the services, each as soon as what it needs
    is ready: kvstore, the first worker and the tokenizer at once; each scheduler once its worker
    is ready; each further worker once the one before it is. Returns when every service is ready;
    on any failure everything started is stopped.

    ``replicas`` > 1: that many worker + scheduler pairs (each scheduler drives its own worker;
    the first pair is named ``worker`` / ``scheduler``, the next ``worker-1`` / ``scheduler-1``,
    ...), one kvstore and one tokenizer routing over all of them. ``etcd_tls``: the etcd started
    here serves TLS and requires client certificates (the services then need ``--tls-*`` flags of
    the same CA in ``common_args``). ``roles``: one scheduler ``--role`` per replica (prefill /
    decode disaggregation; ``replicas`` is then ``len(roles)``); ``replica_worker_args[i]``: more
    flags for replica ``i``'s worker only (the prefill workers' ``--outbox-bytes``, each worker's
    ``--cpus``). ``grammar_preload=False``: each scheduler loads its grammar backend at its first
    constrained request, not in the background once its worker is attached (~4 s of CPU each,
    which a stack that sends no grammar, or measures CPU from its start, need not spend)."""
    replicas = len(roles) or replicas
    if not grammar_preload:
        scheduler_args = (*scheduler_args, "--grammar-preload", "false")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(run_dir)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        if etcd:
            stack.etcd_endpoint = etcd
        else:
            # A fresh member each time: a reused data dir would bring back the last run's
            # registrations (with dead addresses) until their leases expire.
            shutil.rmtree(run_dir / "etcd-data", ignore_errors=True)
            stack.etcd = EtcdProcess(
                run_dir / "etcd-data", client_port=free_port(), peer_port=free_port(), tied=True, tls=etcd_tls
            )
            stack.etcd.start()
            stack.etcd_endpoint = stack.etcd.endpoint
        width = 10 if replicas == 1 else 12  # "scheduler-1" is longer than the one-replica names
        say(f"{'etcd':<{width}} {stack.etcd_endpoint}")
        e = ("--etcd", stack.etcd_endpoint)
        specs = [_Spec("kvstore", [*_module("kvstore"), *e, *common_args, *kvstore_args])]
        # Workers start one after another: each sizes its pools from the memory left free.
        previous: tuple[str, ...] = ()
        for i in range(replicas):
            worker, scheduler = ("worker", "scheduler") if i == 0 else (f"worker-{i}", f"scheduler-{i}")
            role = ("--role", roles[i]) if roles else ()
            own = replica_worker_args[i] if i < len(replica_worker_args) else ()
            specs += [
                _Spec(worker, [*_module("worker"), "--model", str(model), *e, *common_args, *worker_args, *own],
                      previous),
                # Its worker's address is known once that worker is ready.
                _Spec(scheduler, functools.partial(
                    _scheduler_argv, stack, worker if replicas > 1 else "",
                    [*_module("scheduler"), "--tokenizer", str(model), *e, *common_args, *scheduler_args, *role],
                ), (worker,)),
            ]  # fmt: skip
            previous = (worker,)
        # The tokenizer needs no other service to start: it finds the schedulers in etcd as they
        # register, and reads the model's fingerprint from there when asked.
        specs.append(_Spec(
            "tokenizer",
            [*_module("tokenizer"), "--model", str(model), "--port", str(port),
             "--http-port", str(http_port), *e, *common_args, *tokenizer_args],
        ))  # fmt: skip
        _start_all(stack, specs, env, timeout_s, functools.partial(_announce, say, width))
    except BaseException:
        stack.stop()
        raise
    return stack


@dataclass(slots=True)
class _Restarts:
    """``--restart on-failure``: when each crashed service starts again, with doubling backoff."""

    stack: Stack
    say: Callable[[str], None]
    timeout_s: float = 120.0
    due: dict[str, float] = field(default_factory=dict)  # name -> when to start it again
    delay: dict[str, float] = field(default_factory=dict)  # name -> its last backoff
    started: dict[str, float] = field(default_factory=dict)  # name -> when it last started

    def crashed(self, child: Child) -> None:
        wait = self._schedule(child.name)
        assert child.proc is not None
        self.say(f"{child.name} exited with code {child.proc.returncode}; restarting it in {wait:g}s\n{child.tail()}")

    def etcd_exited(self) -> None:
        """etcd (ours, not an external endpoint) is gone: started again on its ports and data
        directory, so every key and lease it had comes back; the services' etcd clients reconnect."""
        self.say(f"etcd exited; restarting it in {self._schedule(ETCD):g}s")

    def _schedule(self, name: str) -> float:
        now = time.monotonic()
        last = self.delay.get(name)
        ran = now - self.started.get(name, 0.0)
        wait = RESTART_BACKOFF_S[0] if last is None or ran >= RESTART_RESET_S else min(2 * last, RESTART_BACKOFF_S[1])
        self.delay[name] = wait
        self.due[name] = now + wait
        return wait

    def run_due(self) -> None:
        now = time.monotonic()
        for name in [n for n, at in self.due.items() if at <= now]:
            del self.due[name]
            self.started[name] = time.monotonic()
            if name == ETCD:
                self._start_etcd()
                continue
            child = self.stack.child(name)
            child.pin_ports()
            child.start(dict(os.environ, PYTHONUNBUFFERED="1"))
            try:
                address = child.wait_ready(self.timeout_s)
            except StartError as e:
                child.stop()
                self.say(f"{name} did not start again: {e}")
                continue  # dead now: the next poll schedules it again, with a longer backoff
            self.say(f"{name} restarted at {address}")

    def _start_etcd(self) -> None:
        etcd = self.stack.etcd
        assert etcd is not None
        try:
            etcd.start()
        except EtcdError as e:
            self.say(f"etcd did not start again: {e}")  # not running: the next poll schedules it again
            return
        self.say(f"etcd restarted at {etcd.endpoint}")


def supervise(
    stack: Stack, say: Callable[[str], None] = print, restart: RestartPolicy = "no", timeout_s: float = 120.0
) -> int:
    """Block until Ctrl-C / SIGTERM; then stop everything. A service that dies stops everything
    too, unless ``restart`` is ``on-failure`` and it crashed (exit code not 0): then it is started
    again after a backoff (1 s, doubling to 30 s; back to 1 s after a minute up), at the same ports.
    The etcd the stack started is watched the same way (any exit counts as a crash)."""
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    restarts = _Restarts(stack, say, timeout_s)
    code = 0
    try:
        while not stopping:
            if stack.etcd is not None and not stack.etcd.running and ETCD not in restarts.due:
                if restart == "no":
                    say(f"etcd exited; stopping all services\n{stack.etcd.log_tail()}")
                    code = 1
                    break
                restarts.etcd_exited()
            dead = next((c for c in stack.children if not c.alive() and c.name not in restarts.due), None)
            if dead is not None:
                assert dead.proc is not None
                if restart == "no" or dead.proc.returncode == 0:
                    say(
                        f"{dead.name} exited with code {dead.proc.returncode}; stopping all services\n{dead.tail()}"
                    )
                    code = 1
                    break
                restarts.crashed(dead)
            restarts.run_due()
            time.sleep(0.2)
    finally:
        say("stopping services")
        stack.stop()
        for s, h in old.items():
            with contextlib.suppress(ValueError):
                signal.signal(s, h)
    return code
