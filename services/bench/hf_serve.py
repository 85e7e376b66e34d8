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
import sys
from pathlib import Path

from services.bench.peer_process import PeerError, PeerProcess
from services.common.etcd_proc import free_port

__all__ = ["NO_EOS_BODY", "PeerError", "TransformersServe"]

NO_EOS_BODY = {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}


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
        self.process = PeerProcess(
            "transformers serve", self.command, self.port, log, {"HF_HUB_OFFLINE": "1"}, startup_timeout_s
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        """Start the process and wait until ``/health`` answers 200; ``PeerError`` if it dies or times out."""
        self.process.start()

    def log_tail(self) -> str:
        return self.process.log_tail()

    def stop(self) -> None:
        self.process.stop()

    def __enter__(self) -> TransformersServe:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
