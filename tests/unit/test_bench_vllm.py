"""The vLLM peer of ``strata bench --only servers`` without vLLM: the command line it builds, start-up
failures reported with the log's tail and the whole process group stopped, the skip when no vLLM
python is given, the head-size fix of the null checkpoint, the agent workload, and the CPU-per-token
arithmetic. Nothing here starts vLLM (``make bench-vllm`` does)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import stat
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from services.bench.cli import VLLM_PYTHON_ENV, add_bench_parser, run_bench
from services.bench.hf_serve import PeerError
from services.bench.metrics import summarize
from services.bench.servers import Side, cpu_per_token
from services.bench.vllm_serve import CPU_HEAD_SIZES, ENTRY_POINT, VllmServe, head_dim, with_head_dim
from services.bench.workloads import AgentSpec, agent_workload, max_context_needed


def _fake_python(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_command_line_is_the_module_entry_point_with_cpu_settings(tmp_path: Path) -> None:
    serve = VllmServe(Path("/venv/bin/python"), Path("models/m"), tmp_path / "log", max_num_seqs=256,
                      kvcache_gib=3, threads_bind="0-1", extra_args=("--seed", "1"))  # fmt: skip
    cmd = serve.command
    assert cmd[:3] == ["/venv/bin/python", "-m", ENTRY_POINT]  # not `vllm serve`
    flags = " ".join(cmd[3:])
    for part in ("--model models/m", "--dtype float32", "--max-model-len 4096", "--max-num-seqs 256",
                 "--enable-prompt-tokens-details", "--host 127.0.0.1", f"--port {serve.port}"):  # fmt: skip
        assert part in flags
    assert cmd[-2:] == ["--seed", "1"]
    assert serve.env == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "3", "HF_HUB_OFFLINE": "1"}
    assert serve.shell_line().startswith("VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=3 HF_HUB_OFFLINE=1 "
                                         "/venv/bin/python -m vllm.entrypoints")  # fmt: skip
    assert serve.base_url == f"http://127.0.0.1:{serve.port}/v1"
    default = VllmServe(Path("/p"), Path("m"), tmp_path / "log")
    assert "--max-num-seqs" not in default.command  # vLLM's own default
    assert default.env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")


def test_a_missing_python_is_refused_before_starting(tmp_path: Path) -> None:
    with pytest.raises(PeerError, match="no vLLM python at /nowhere/python"):
        VllmServe(Path("/nowhere/python"), Path("m"), tmp_path / "log").start()


def test_a_server_that_exits_is_reported_with_its_log_tail(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, 'echo "ValueError: no such model"; exit 3')
    with pytest.raises(PeerError, match=r"exited with 3(.|\n)*ValueError: no such model"):
        VllmServe(python, Path("m"), tmp_path / "vllm.log").start()


def test_a_server_never_ready_times_out_and_its_process_group_is_stopped(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # A parent and a child (vLLM's API server and EngineCore) that both ignore SIGTERM.
    python = _fake_python(tmp_path, f"trap '' TERM; sleep 300 & echo $$ $! > {pids}; echo starting; wait")
    serve = VllmServe(python, Path("m"), tmp_path / "vllm.log", startup_timeout_s=1.5, stop_grace_s=0.5)
    with pytest.raises(PeerError, match=r"not ready after 2s(.|\n)*starting"):
        serve.start()
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in started):
        assert time.monotonic() < deadline, "the server's process group outlived stop()"
        time.sleep(0.1)


def _bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_the_vllm_part_is_skipped_without_a_python(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    args = _bench_args(["--model", str(tiny_qwen3), "--only", "servers", "--peer", "vllm", "--out-dir", str(tmp_path)])
    assert args.vllm_python == ""
    assert run_bench(args) == 0
    assert "vLLM part skipped: no vLLM python given" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_the_vllm_python_comes_from_the_environment_and_must_exist(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/nowhere/bin/python")
    args = _bench_args(["--model", str(tiny_qwen3), "--only", "servers", "--peer", "both"])
    assert args.vllm_python == "/nowhere/bin/python"
    assert run_bench(args) == 2
    assert "--vllm-python /nowhere/bin/python: no such file" in capsys.readouterr().err
    assert _bench_args(["--only", "servers"]).peer == "transformers"  # the existing default is unchanged


def test_with_head_dim_widens_the_heads_and_keeps_the_rest(tiny_qwen3: Path, tmp_path: Path) -> None:
    assert head_dim(tiny_qwen3) not in CPU_HEAD_SIZES  # why the null model needs it
    out = with_head_dim(tiny_qwen3, tmp_path / "hd32", 32)
    assert head_dim(out) == 32 and 32 in CPU_HEAD_SIZES
    before = json.loads((tiny_qwen3 / "config.json").read_text())
    after = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in after.items() if k not in ("head_dim", "transformers_version")} == {
        k: v for k, v in before.items() if k not in ("head_dim", "transformers_version")
    }
    assert (out / "tokenizer.json").read_bytes() == (tiny_qwen3 / "tokenizer.json").read_bytes()
    old, new = load_file(str(tiny_qwen3 / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert new["model.embed_tokens.weight"].equal(old["model.embed_tokens.weight"])
    assert new["lm_head.weight"].equal(old["lm_head.weight"])
    q = new["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (before["num_attention_heads"] * 32, before["hidden_size"])
    assert with_head_dim(tiny_qwen3, out, 32) == out  # reused, not rewritten


def test_agent_workload_resends_a_growing_context() -> None:
    spec = AgentSpec(conversations=2, turns=3, context_len=100, turn_len=10, output_len=4)
    w = agent_workload(spec, 768, seed=5)
    assert w == agent_workload(spec, 768, seed=5) and w != agent_workload(spec, 768, seed=6)
    assert w.num_requests == 6 and w.max_parallel == 2
    a, b = w.conversations
    assert a[0].prefix != b[0].prefix  # each agent has its own context
    history: list[int] = []
    for k, turn in enumerate(a):  # an HTTP backend returns no answer ids: history is the last prompt
        prompt = turn.prompt_for(history)
        assert len(prompt) == 100 + 10 * (k + 1)
        assert prompt[: len(history)] == history
        history = prompt
    assert max_context_needed(w) == 100 + 3 * 10 + 3 * 4  # counts answers a backend might append


def test_cpu_per_token_splits_own_processes_client_and_idle_peer() -> None:
    run = dataclasses.replace(summarize("r", [], 1.0), output_tokens=1000)
    side = Side("w", "vLLM HTTP", runs=[run], own="vllm ")
    side.cpu.append({"client": 0.5, "vllm api server": 1.0, "vllm worker": 2.0, "strata worker": 0.25})
    per = cpu_per_token(side)
    assert per == {"api server": [1000.0], "worker": [2000.0], "total": [3000.0], "client": [500.0],
                   "idle peer": [250.0]}  # fmt: skip


def test_the_vllm_workloads_are_chosen_by_name(tmp_path: Path) -> None:
    from services.bench.cli import _vllm_peer

    python = tmp_path / "python"
    python.touch()
    base = ["--peer", "vllm", "--vllm-python", str(python)]
    peer = _vllm_peer(_bench_args(base))
    assert peer is not None and peer.workloads == ("shared", "random", "agent", "single", "control")
    assert peer.single.count == 1 and peer.single.input_len == peer.single.range_ratio * peer.single.input_len
    peer = _vllm_peer(_bench_args([*base, "--vllm-workloads", "single,agent"]))
    assert peer is not None and peer.workloads == ("single", "agent")
    with pytest.raises(SystemExit, match="--vllm-workloads: sharde; choose from"):
        _vllm_peer(_bench_args([*base, "--vllm-workloads", "sharde,agent"]))
