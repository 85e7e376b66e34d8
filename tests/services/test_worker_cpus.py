"""``--cpus`` on a real worker process: the process and every thread it has started (gRPC's, the
engine's and its OpenMP team) run on those CPUs only; a CPU the process may not use is refused at
start with the field named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.common.config import ConfigError
from services.supervisor import Child
from services.worker.config import cpu_list
from strata.worker.v1 import worker_pb2 as wpb
from strata.worker.v1 import worker_pb2_grpc as wgrpc

WORKER = [sys.executable, "-m", "services.worker.server"]


def _allowed(pid: int) -> dict[str, str]:
    """Thread id -> its Cpus_allowed_list."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[tid] = line.split(":", 1)[1].strip()
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one of them")
def test_a_pinned_worker_runs_every_thread_on_its_cpus(tiny_qwen3: Path, tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    child = Child("worker", [*WORKER, "--model", str(tiny_qwen3), "--kv-cache-bytes", "8MiB", "--cpus", str(cpu)],
                  tmp_path / "worker.log")  # fmt: skip
    child.start(dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        child.wait_ready(120)
        assert child.proc is not None
        with grpc.insecure_channel(child.address) as ch:  # a call: gRPC's threads are all up
            assert wgrpc.WorkerStub(ch).GetInfo(wpb.GetInfoRequest(), timeout=30).num_slots > 0
        threads = _allowed(child.proc.pid)
        assert len(threads) > 3 and set(threads.values()) == {str(cpu)}, threads
    finally:
        child.stop()


def test_a_cpu_the_process_may_not_use_is_refused(tiny_qwen3: Path) -> None:
    bad = str(max(os.sched_getaffinity(0)) + 1)
    r = subprocess.run([*WORKER, "--model", str(tiny_qwen3), "--cpus", bad], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode != 0 and f"cpus: [{bad}] not among" in r.stderr, r.stderr[-2000:]
    # The same parse, in process (a worker process costs ~4 s of imports before it parses).
    for value in ("1-0", "x", "0,-1"):
        with pytest.raises(ConfigError, match="cpus: expected CPU numbers"):
            cpu_list(value)
    assert cpu_list(f"{min(os.sched_getaffinity(0))}") == {min(os.sched_getaffinity(0))}
