"""vLLM's CPU build as a peer server: its own virtual environment, its own process group.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 \\
      <vllm python> -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 \\
      --max-model-len 4096 --enable-prompt-tokens-details --host 127.0.0.1 --port N

What the benchmark relies on (vLLM 0.32.0, CPU build, checked on 2 cores):

* vLLM never enters Strata's environment: it runs from the python of its own venv, given to the
  benchmark (``--vllm-python``, default ``$STRATA_VLLM_PYTHON``);
* ``vllm serve`` fails there on the package name; the module entry point above works;
* start-up takes 1-2 min (a torch.compile warm-up); ready when ``GET /health`` answers 200;
* it is three processes (API server, EngineCore, worker), so it is started in a new session and
  stopped by signalling the whole process group (and any descendant that left it);
* ``/v1/completions`` takes a list of token ids as the prompt, ``ignore_eos``, and
  ``stream_options.include_usage``; ``usage.prompt_tokens_details.cached_tokens`` needs
  ``--enable-prompt-tokens-details``;
* its CPU attention kernels take head sizes 32, 64, 80, ... only. A checkpoint with ``head_dim``
  16 (``strata model tiny`` at sizes tiny and null) starts, then fails its first request with
  ``RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2`` and the EngineCore
  dies: ``with_head_dim`` derives a copy with wider heads for both servers to run.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import psutil

from services.bench.peer_process import PeerError, PeerProcess
from services.common.etcd_proc import free_port

# vllm/v1/attention/backends/cpu_attn.py: CPUAttentionBackend.get_supported_head_sizes()
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The workloads of the vLLM comparison (``strata bench --peer vllm``), in the order they run.
VLLM_WORKLOADS = ("shared", "random", "agent", "single", "control")
ENTRY_POINT = "vllm.entrypoints.openai.api_server"


class VllmServe:
    """One vLLM OpenAI server on ``model``; use as a context manager. ``model_name`` is what requests
    carry, ``base_url`` the OpenAI base (``http://127.0.0.1:<port>/v1``), ``shell_line()`` the
    command with its environment, for the report."""

    def __init__(
        self,
        python: Path,
        model: Path,
        log: Path,
        *,
        max_model_len: int = 4096,
        max_num_seqs: int = 0,
        kvcache_gib: int = 2,
        threads_bind: str = "",
        extra_args: tuple[str, ...] = (),
        startup_timeout_s: float = 420.0,
        stop_grace_s: float = 15.0,
    ) -> None:
        """``max_num_seqs`` 0: vLLM's default (128 on CPU); ``threads_bind`` "": every core of
        this machine (``0-<n-1>``)."""
        self.model_name = str(model)
        self.port = free_port()
        self.log = log
        self.env = {
            "VLLM_CPU_OMP_THREADS_BIND": threads_bind or f"0-{(os.cpu_count() or 1) - 1}",
            "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
            "HF_HUB_OFFLINE": "1",
        }
        seqs = ("--max-num-seqs", str(max_num_seqs)) if max_num_seqs else ()
        self.command = [
            str(python), "-m", ENTRY_POINT, "--model", self.model_name, "--dtype", "float32",
            "--max-model-len", str(max_model_len), *seqs, "--enable-prompt-tokens-details",
            "--host", "127.0.0.1", "--port", str(self.port), *extra_args,
        ]  # fmt: skip
        self.process = PeerProcess("vLLM", self.command, self.port, log, self.env, startup_timeout_s, stop_grace_s, 1.0)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def startup_s(self) -> float:
        """How long the last start took."""
        return self.process.startup_s

    def shell_line(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.command)}"

    def start(self) -> None:
        """Start the server and wait until ``/health`` answers 200; ``PeerError`` (with the log's
        tail) if it exits or is not ready after ``startup_timeout_s``."""
        python = Path(self.command[0])
        if not python.is_file():
            raise PeerError(f"no vLLM python at {python} (give the python of vLLM's venv: --vllm-python)")
        self.process.start()

    def pids(self) -> dict[str, int]:
        """The server's processes by role (``api server``, then its descendants by name): what a
        ``CpuMeter`` measures. Call once the server is ready (the workers exist by then)."""
        proc = self.process.proc
        if proc is None:
            return {}
        root = psutil.Process(proc.pid)
        out = {"api server": root.pid}
        for child in root.children(recursive=True):
            try:
                name, cmdline = child.name(), " ".join(child.cmdline())
            except psutil.Error:
                continue
            if "resource_tracker" in cmdline:  # multiprocessing's helper, idle
                continue
            key = name.removeprefix("VLLM::").lower() or str(child.pid)
            out[key if key not in out else f"{key} {child.pid}"] = child.pid
        return out

    def log_tail(self) -> str:
        return self.process.log_tail()

    def stop(self) -> None:
        """SIGTERM to the process group, then SIGKILL to whatever of it (and of the descendants
        seen before, should one have left the group) is still alive after a grace period."""
        self.process.stop()

    def __enter__(self) -> VllmServe:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def head_dim(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def with_head_dim(model: Path, out: Path, dim: int = 32, seed: int = 0) -> Path:
    """A copy of ``model`` (a Qwen3 checkpoint) whose attention heads are ``dim`` wide: the same
    config, tokenizer and every weight whose shape does not depend on the head size; the attention
    projections and q/k norms are drawn afresh (seeded). Returns ``out``; reuses it when its config
    already says ``dim``. For a random-weight benchmark model only: the outputs change."""
    import shutil

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").exists() and head_dim(out) == dim:
        return out
    cfg = AutoConfig.from_pretrained(str(model))
    cfg.head_dim = dim
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        new = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    old = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    state = new.state_dict()
    kept = {k: v for k, v in old.items() if k in state and state[k].shape == v.shape}
    new.load_state_dict(kept, strict=False)
    out.mkdir(parents=True, exist_ok=True)
    new.save_pretrained(out, safe_serialization=True)
    for f in model.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy2(f, out / f.name)
    return out
