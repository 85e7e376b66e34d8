"""Start and stop a real single-member etcd server (Debian's ``etcd-server``) for ``strata up`` and tests.

Contract: ``EtcdProcess.start`` returns only once the server answers its ``/health`` endpoint on the
client URL, and raises ``EtcdError`` (with the tail of etcd's log) when it exits or stays unhealthy.
``stop`` is idempotent. The data directory survives ``stop``, so ``start`` after ``stop`` restarts the
same cluster with its keys and leases, which is how tests simulate an etcd outage.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.tls import TlsFiles

log = logging.getLogger(__name__)

DEBIAN_ETCD = Path("/usr/bin/etcd")
_LOG_TAIL_BYTES = 4000



_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def tied(argv: list[str]) -> tuple[list[str], Callable[[], None] | None]:
    """``(argv, preexec_fn)`` for a ``Popen`` whose process gets SIGTERM when the thread that
    starts it ends, so services started by ``strata up`` end with it even when it is SIGKILLed.

    util-linux's ``setpriv --pdeathsig`` sets that signal and execs ``argv``, so no Python runs
    between fork and exec and ``subprocess`` can use vfork: a plain fork in a process with gRPC
    channels ran gRPC's fork handlers in the child, whose restarted poller thread aborted
    ("epoll_wait error: Bad file descriptor") when the child closed its inherited descriptors.
    Without ``setpriv``, ``die_with_parent`` runs between fork and exec as before."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return argv, die_with_parent
    return [setpriv, "--pdeathsig", "TERM", "--", *argv], None


def die_with_parent() -> None:
    """In a child between fork and exec: ask Linux to SIGTERM it when its parent dies (no-op where
    prctl is absent). ``tied`` does it without Python in the child where it can."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def follow_parent(name: str) -> None:
    """First thing in a process another one of the same service started (a TP rank, a tokenizer
    front process): end with that parent (``die_with_parent``; exit at once if it is already gone),
    and tag the log lines, which share the parent's log, with ``name``."""
    die_with_parent()
    if os.getppid() == 1:  # the parent died before we asked
        os._exit(1)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s"))


class EtcdError(RuntimeError):
    """etcd could not be found, started or stopped."""


def find_etcd_binary() -> Path:
    """Return the etcd server binary: Debian's /usr/bin/etcd, else ``etcd`` on PATH."""
    if DEBIAN_ETCD.is_file():
        return DEBIAN_ETCD
    found = shutil.which("etcd")
    if found is None:
        raise EtcdError(
            "no etcd server binary found (looked for /usr/bin/etcd and `etcd` on PATH); "
            "install Debian's etcd-server: `sudo apt-get install etcd-server`"
        )
    return Path(found)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (racy by nature; fine for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class EtcdProcess:
    """One etcd member listening on 127.0.0.1 only.

    ``log_path`` receives etcd's stdout and stderr (default: ``<data_dir>.log`` beside the data dir,
    because etcd wants its data directory to itself).
    """

    def __init__(
        self,
        data_dir: Path | str,
        client_port: int,
        peer_port: int,
        log_path: Path | str | None = None,
        tied: bool = False,
        tls: TlsFiles | None = None,
    ) -> None:
        """``tied``: etcd gets SIGTERM when the thread that starts it exits (the function ``tied``);
        for ``strata up``, whose main thread lives as long as the stack. ``tls``: serve clients
        over TLS with this certificate, requiring client certificates signed by its CA (the
        endpoint is then ``https://``)."""
        self.tls = tls if tls is not None and tls.on else None
        self.data_dir = Path(data_dir)
        self.tied = tied
        self.client_port = client_port
        self.peer_port = peer_port
        self.log_path = Path(log_path) if log_path is not None else Path(f"{self.data_dir}.log")
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """The client endpoint as ``127.0.0.1:PORT``, or ``https://127.0.0.1:PORT`` with TLS (what
        ``Registration``/``Discovery`` take)."""
        return f"https://127.0.0.1:{self.client_port}" if self.tls else f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _command(self, binary: Path) -> list[str]:
        client_url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        tls = self.tls
        secure = (
            ["--cert-file", tls.cert, "--key-file", tls.key, "--trusted-ca-file", tls.ca, "--client-cert-auth"]
            if tls else []
        )  # fmt: skip
        return [
            str(binary),
            "--name", "strata",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"strata={peer_url}",
            "--initial-cluster-state", "new",
            # The metrics listener is unused; logging to stderr keeps the log file the one place to look.
            "--logger", "zap", "--log-outputs", "stderr",
            *secure,
        ]  # fmt: skip

    def start(self, timeout: float = 20.0) -> None:
        """Spawn etcd and block until it reports healthy; raises ``EtcdError`` otherwise."""
        if self.running:
            raise EtcdError(f"etcd on {self.endpoint} is already running")
        binary = find_etcd_binary()
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("ab")
        argv, preexec = tied(self._command(binary)) if self.tied else (self._command(binary), None)
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            # Own process group: a Ctrl-C aimed at `strata up` is handled by us, which stops etcd last.
            start_new_session=True,
            preexec_fn=preexec,
        )
        log.info("etcd starting endpoint=%s data_dir=%s", self.endpoint, self.data_dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._close_log()
                self._proc = None
                raise EtcdError(f"etcd exited with status {code} during start:\n{self.log_tail()}")
            if self._healthy():
                log.info("etcd healthy endpoint=%s", self.endpoint)
                return
            time.sleep(0.05)
        self.stop()
        raise EtcdError(
            f"etcd on {self.endpoint} was not healthy within {timeout:.1f} s:\n{self.log_tail()}"
        )

    def _healthy(self) -> bool:
        url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}/health"
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.cert, self.tls.key)
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                body = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return str(body.get("health")) == "true"

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate etcd (SIGTERM, then SIGKILL after ``timeout``); a no-op when not running."""
        proc = self._proc
        self._proc = None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("etcd ignored SIGTERM; killing it endpoint=%s", self.endpoint)
                proc.kill()
                proc.wait()
        self._close_log()

    def kill(self) -> None:
        """SIGKILL etcd, as a crash would (tests use this to simulate an outage)."""
        proc = self._proc
        self._proc = None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no etcd log)"
        return data[-_LOG_TAIL_BYTES:].decode(errors="replace")

    def __enter__(self) -> EtcdProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
