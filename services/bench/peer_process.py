"""A peer server's processes, for the server-vs-server benchmarks: start, wait for ``/health``, stop.

Both peers (``transformers serve``, vLLM) are started the same way: in a session of their own
(vLLM is three processes), dying with the benchmark, their output in a log file whose tail goes
into every start-up error; stopped by signalling the whole process group, then killing whatever
of it (or of the descendants seen before, should one have left the group) is still alive.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

import psutil

from services.common.etcd_proc import tied

_LOG_TAIL_BYTES = 4000


class PeerError(RuntimeError):
    """The peer server could not start (its log's tail is in the message)."""


class PeerProcess:
    """``command`` serving HTTP on ``port``, ready once ``GET /health`` answers 200."""

    def __init__(
        self, name: str, command: list[str], port: int, log: Path, env: dict[str, str] | None = None,
        startup_timeout_s: float = 300.0, stop_grace_s: float = 10.0, poll_s: float = 0.5,
    ) -> None:  # fmt: skip
        self.name, self.command, self.port, self.log = name, command, port, log
        self.env = dict(env or {})
        self._timeout, self._grace, self._poll = startup_timeout_s, stop_grace_s, poll_s
        self.startup_s = 0.0  # how long the last start took
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    def start(self) -> None:
        """Start and wait until ``/health`` answers 200; ``PeerError`` (with the log's tail) if the
        process exits or is not ready after ``startup_timeout_s``."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log.open("wb")
        t0 = time.monotonic()
        argv, preexec = tied(self.command)
        self.proc = subprocess.Popen(
            argv, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}, preexec_fn=preexec,
        )  # fmt: skip
        while time.monotonic() - t0 < self._timeout:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise PeerError(f"{self.name} exited with {code} during start-up (log {self.log}):\n{self.log_tail()}")
            if self.healthy():
                self.startup_s = time.monotonic() - t0
                return
            time.sleep(self._poll)
        self.stop()
        raise PeerError(f"{self.name} not ready after {self._timeout:.0f}s (log {self.log}):\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self) -> str:
        try:
            data = self.log.read_bytes()
        except OSError:
            return ""
        return data[-_LOG_TAIL_BYTES:].decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM to the process group, then SIGKILL to whatever of it is alive after the grace."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            except psutil.Error:
                family = []
            _signal_group(proc.pid, signal.SIGTERM)
            _, alive = psutil.wait_procs(family, timeout=self._grace)
            _signal_group(proc.pid, signal.SIGKILL)
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(pgid, sig)
