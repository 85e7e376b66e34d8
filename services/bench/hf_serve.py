"""``transformers serve --continuous-batching`` as a peer server: its own process on a local checkpoint.

    HF_HUB_OFFLINE=1 transformers serve <model dir> --continuous-batching --device cpu \\
        --dtype float32 --host 127.0.0.1 --port <free port>

What the benchmark relies on (transformers 5.23, ``transformers/cli/serving/``):

* the positional model is loaded at start and pinned: a request's ``model`` must be that same string;
* ``/v1/completions`` takes a *text* prompt only (no token ids); ``/v1/chat/completions`` would add
  a chat template, so completions it is;
* a body field it does not know is a 422 — there is no ``ignore_eos``. A ``generation_config`` JSON
  string replaces the model's generation config instead: ``eos_token_id = -1`` disables eos per
  request in continuous batching, and ``max_tokens`` still sets ``max_new_tokens`` (``NO_EOS_BODY``);
* ``stream_options`` is ignored (a warning), and the last chunk always carries ``usage`` (prompt and
  completion tokens; no ``cached_tokens``, although its paged cache shares prefix blocks);
* the continuous-batching manager starts on the first request (about 10 s here) with that request's
  generation config for every later one: warm it up with the same body;
* ``GET /v1/models`` scans the hub cache and answers 500 when there is none, so readiness is ``/health``;
* its KV cache is sized from free memory unless ``--cb-num-blocks`` is given (RSS ~8 GiB here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from services.common.etcd_proc import die_with_parent, free_port

NO_EOS_BODY = {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}
_POLL_S = 0.5
_STOP_GRACE_S = 10.0
_LOG_TAIL_BYTES = 3000


class PeerError(RuntimeError):
    """The peer server could not start (its log's tail is in the message)."""


class TransformersServe:
    """One ``transformers serve`` process; use as a context manager. ``model_name`` is what requests
    must carry, ``base_url`` the OpenAI base (``http://127.0.0.1:<port>/v1``)."""

    def __init__(
        self, model: Path, log: Path, extra_args: tuple[str, ...] = (), startup_timeout_s: float = 300.0
    ) -> None:
        self.model_name = str(model)
        self.port = free_port()
        self.log = log
        self.command = [
            sys.executable, "-m", "transformers.cli.transformers", "serve", self.model_name,
            "--continuous-batching", "--device", "cpu", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(self.port), *extra_args,
        ]  # fmt: skip
        self._timeout = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        """Start the process and wait until ``/health`` answers 200; ``PeerError`` if it dies or times out."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log.open("wb")
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen(
            self.command, stdout=self._log_file, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent
        )
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self.stop()
                raise PeerError(f"transformers serve exited with {self._proc.returncode}:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(_POLL_S)
        self.stop()
        raise PeerError(f"transformers serve not ready after {self._timeout:.0f}s:\n{self.log_tail()}")

    def _healthy(self) -> bool:
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
        """SIGTERM, then SIGKILL after a grace period."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> TransformersServe:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
