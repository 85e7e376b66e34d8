"""More than one tokenizer process behind the same public ports (``--front-processes N``).

One front process is one Python event loop: gRPC's and uvicorn's per-message work for every
streamed token runs on one core, about 20k output tokens/s on a GPU host. With ``N`` > 1 the
first process (index 0) binds the ports, then starts ``N - 1`` more of itself (the same flags,
``--front-index i``), as vLLM's ``--api-server-count`` and SGLang's tokenizer workers do:

- HTTP: they inherit the first process's listening socket (``--http-fd``) and accept from its one
  queue, so a port in use is still an error at start;
- gRPC, which cannot adopt a socket: every process binds the port with ``SO_REUSEPORT`` and the
  kernel spreads connections over them by their addresses (one client channel stays on one
  process). The first process checks first that nothing else holds the port.

Each process routes its own requests: the same discovered schedulers and cache index, its own
load counts and running request ids (``Abort`` of an id another process runs is passed to every
scheduler). Each registers its own etcd record and serves its own metrics, on ``--metrics-port``
+ index. The first process prints READY once all are ready, stops them when it stops, and stops
(exiting non-zero) when one of them dies, so that a supervisor restarts the set.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import subprocess
import sys
import threading

from services.common.config import to_args
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.http_server import bind

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0


def check_port_free(host: str, port: int) -> None:
    """Raise ``OSError`` naming the address when something listens on ``host:port``: a bind
    without ``SO_REUSEPORT`` (``http_server.bind``) fails even against sockets that set it."""
    bind(host, port).close()


def child_config(cfg: TokenizerConfig, index: int, grpc_port: int, http_fd: int) -> TokenizerConfig:
    """The configuration of front process ``index`` (> 0) beside ``cfg``'s first one."""
    metrics = cfg.metrics_port + index if cfg.metrics_port > 0 else cfg.metrics_port
    return dataclasses.replace(
        cfg, port=grpc_port, front_index=index, http_fd=http_fd, metrics_port=metrics,
        instance_id=f"{cfg.instance_id or f'tokenizer-{grpc_port}'}-{index}",
    )  # fmt: skip


class Fronts:
    """The other front processes of a first one: started, watched, stopped."""

    def __init__(self, cfg: TokenizerConfig, grpc_port: int, http_fd: int) -> None:
        self._configs = [child_config(cfg, i, grpc_port, http_fd) for i in range(1, cfg.front_processes)]
        self._fds = (http_fd,) if http_fd >= 0 else ()
        self.procs: list[subprocess.Popen[str]] = []
        self.lost: str = ""  # why the set stopped: a front process that died
        self._watch: asyncio.Task[None] | None = None

    async def start(self, stop: asyncio.Event) -> None:
        """Start the others and wait for each one's READY line; raises ``RuntimeError`` with the
        exit status of one that ended first. From then on, one that dies sets ``stop``."""
        loop = asyncio.get_running_loop()
        ready: list[asyncio.Future[str]] = []
        for c in self._configs:
            # From this (the loop's) thread: the parent-death signal that the child asks for
            # (``serve``: ``follow_parent``) fires when the thread that started it ends. No ``preexec_fn``:
            # Python code between fork and exec, beside gRPC's threads, crashed gRPC's poller
            # (seen with TLS); without one, subprocess uses vfork, which runs no fork handlers.
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.tokenizer", *to_args(c)],
                stdout=subprocess.PIPE, text=True, pass_fds=self._fds,
            )  # fmt: skip
            self.procs.append(proc)
            fut: asyncio.Future[str] = loop.create_future()
            ready.append(fut)
            threading.Thread(target=_follow, args=(proc, c.front_index, loop, fut), daemon=True).start()
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                lines = await asyncio.gather(*ready)
        except TimeoutError:
            await self.stop()
            raise RuntimeError(f"front processes were not ready within {READY_TIMEOUT_S:.0f}s") from None
        except RuntimeError:
            await self.stop()
            raise
        log.info("%d more front processes serving: %s", len(lines), "; ".join(lines))
        self._watch = asyncio.create_task(self._watch_procs(stop), name="front processes")

    async def _watch_procs(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for p, c in zip(self.procs, self._configs, strict=True):
                if p.poll() is not None:
                    self.lost = f"front process {c.front_index} (pid {p.pid}) exited with status {p.returncode}"
                    log.error("%s: stopping the tokenizer", self.lost)
                    stop.set()
                    return
            await asyncio.sleep(0.5)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                await asyncio.to_thread(p.wait, STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                await asyncio.to_thread(p.wait)


def _follow(
    proc: subprocess.Popen[str], index: int, loop: asyncio.AbstractEventLoop, ready: asyncio.Future[str]
) -> None:
    """Read a front process's stdout: its READY line resolves ``ready``; its end before that fails it."""
    assert proc.stdout is not None

    def settle(result: str | None, error: str = "") -> None:
        if ready.done():
            return
        if error:
            ready.set_exception(RuntimeError(error))
        else:
            ready.set_result(result or "")

    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith("READY tokenizer "):
            loop.call_soon_threadsafe(settle, f"{index}: {line.removeprefix('READY tokenizer ')}")
        elif line:
            log.info("front process %d: %s", index, line)
    code = proc.wait()
    with contextlib.suppress(RuntimeError):  # the loop is closed: the tokenizer has stopped
        loop.call_soon_threadsafe(settle, None, f"front process {index} exited with status {code} before it was ready")
