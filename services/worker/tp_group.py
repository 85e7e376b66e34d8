"""A tensor-parallel worker group: rank 0 starts the other ranks, and they follow its steps.

``strata serve worker --tp N`` is rank 0: it serves ``Step`` / ``GetInfo``, registers in etcd,
and starts ranks ``1..N-1`` as child processes (the same command with ``--tp-rank r
--tp-init tcp://…``; each dies with its parent). All ranks join one gloo process group and build
their shard of the model and pools (``services.worker.tp``). For every step, rank 0 sends the
serialized ``StepRequest`` to the followers (``Tp.send_bytes``), then all ranks run it: the same
ops on their own shards, the same forward with its all-reduces; rank 0 samples and shares the ids.
While idle, rank 0 sends heartbeats (``keep_alive``), so no rank waits unbounded.

Failure is loud and bounded: rank 0 watches its children and, when one exits, logs which rank
died and with what code, leaves etcd and exits (status 1); collectives inside a step time out
after ``tp_timeout_s``, and a step that fails on rank 0 other than by validation (a timeout, a
lost peer) stops the group the same way; a follower whose parent is gone gets SIGTERM from Linux
and exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import replace

from services.common import config as config_mod
from services.common import step_codec
from services.common.etcd_proc import follow_parent, free_port
from services.common.step import StepError
from services.worker.config import WorkerConfig
from services.worker.engine import Engine
from services.worker.tp import GroupBroken, Tp
from strata.worker.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)

POLL_S = 0.2


class Followers:
    """Rank 0's children: ranks ``1..size-1``."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.broken = ""
        for rank in range(1, cfg.tp):
            device = rank_device(cfg.device, rank)
            child = replace(cfg, tp_rank=rank, tp_init=self.init_method, port=0, metrics_port=-1, device=device)
            cmd = [sys.executable, "-m", "services.worker.server", *config_mod.to_args(child)]
            # No preexec_fn: other threads may hold locks (gRPC's), and code between fork and exec
            # could deadlock on them; the follower asks for its parent-death signal itself.
            self.procs[rank] = subprocess.Popen(cmd)  # inherits stdout/stderr
            log.info("tensor parallel: started rank %d of %d (pid %d)", rank, cfg.tp, self.procs[rank].pid)

    async def failure(self) -> str:
        """Wait until the group can no longer serve: a rank exits, or a step failed mid-way on
        rank 0 (``broken``: a collective timed out or lost a peer); returns what happened."""
        while True:
            for rank, p in self.procs.items():
                code = p.poll()
                if code is not None:
                    return describe_death(rank, code)
            if self.broken:
                return self.broken
            await asyncio.sleep(POLL_S)

    async def keep_alive(self, tp: Tp, thread: Executor, period_s: float) -> None:
        """While no step goes out, send the followers a heartbeat every ``period_s`` (on the
        engine's thread, between steps), so that waits on either side stay within the timeout."""
        loop = asyncio.get_running_loop()
        while not self.broken:
            await asyncio.sleep(max(period_s - (time.monotonic() - tp.last_sent), 0.0))
            if time.monotonic() - tp.last_sent >= period_s:
                try:
                    await loop.run_in_executor(thread, tp.send_heartbeat)
                except GroupBroken as e:
                    self.break_group(e)

    def break_group(self, error: BaseException) -> None:
        """From the engine's thread: a step failed after the ranks started it together, so they
        are out of step for good."""
        self.broken = f"a tensor-parallel step failed ({error!r}); the worker group stops"

    def kill(self) -> None:
        """The group is broken: no rank is waited for (a stopped one would ignore SIGTERM)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()

    def stop(self, timeout_s: float = 5.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the GPUs after rank 0's (``cuda:2``: ranks on 2, 3, ...); CPU ranks share it."""
    if not device.startswith("cuda"):
        return device
    _, _, index = device.partition(":")
    return f"cuda:{int(index or 0) + rank}"


def join(cfg: WorkerConfig, init_method: str) -> Tp:
    """Join the group (blocking; on the engine's thread)."""
    return Tp.join(init_method, cfg.tp_rank, cfg.tp, cfg.tp_timeout_s, cfg.device)


def describe_death(rank: int, code: int) -> str:
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"tensor-parallel rank {rank} {how}; the worker group stops"


def follow(engine: Engine) -> None:
    """A follower's life: run every step rank 0 sends until it sends the stop message.

    A step refused by validation is refused on every rank alike (the checks are deterministic), so
    the follower goes on; any other error means the group is out of step: it exits, and rank 0,
    seeing it die, takes the group down."""
    tp = engine.tp
    while True:
        data = tp.recv_bytes()
        if data is None:  # a heartbeat
            continue
        if not data:
            log.info("tensor parallel rank %d: stop", tp.rank)
            return
        msg = wpb.StepRequest.FromString(data)
        step = step_codec.step_from_pb(msg)
        try:
            engine.step(step, None)
        except StepError as e:
            log.info("tensor parallel rank %d: step %d refused on every rank: %s", tp.rank, step.step_id, e)


async def serve_follower(cfg: WorkerConfig, stop: asyncio.Event, make_engine: Callable[[Tp], Engine]) -> None:
    """Rank ``cfg.tp_rank``: join, build the shard, follow rank 0 until it stops (or dies)."""
    follow_parent(f"worker-rank{cfg.tp_rank}")  # ends with rank 0; its lines share rank 0's log
    loop = asyncio.get_running_loop()

    def run() -> None:
        tp = join(cfg, cfg.tp_init)
        engine = make_engine(tp)
        follow(engine)

    task: asyncio.Future[None] = loop.run_in_executor(None, run)
    stopped = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
    if task in done:
        err = task.exception()
        if err is None:
            os._exit(0)
        log.error("tensor parallel rank %d failed: %r", cfg.tp_rank, err, exc_info=err)
        os._exit(1)
    # Stopped by a signal (rank 0 gone): the thread may sit in a collective; leave at once.
    log.info("tensor parallel rank %d: stopping", cfg.tp_rank)
    os._exit(0)
