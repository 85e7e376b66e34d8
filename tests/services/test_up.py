"""``strata up`` as a user runs it: one table of endpoints (gRPC, HTTP, metrics per service), the
OpenAI API serving, and no service outliving it, even when it is SIGKILLed. A gRPC port already
in use is an error at start, not a silently shared port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest

from services.common.etcd_proc import free_port
from services.common.server import Server
from strata.v1 import strata_pb2_grpc as pgrpc
from tests import streams

REPO = Path(__file__).resolve().parents[2]


def test_a_taken_grpc_port_is_an_error() -> None:
    async def run() -> None:
        first = Server()
        port = await first.start(f"127.0.0.1:{free_port()}")
        try:
            with pytest.raises(Exception, match=r"bind|Failed|address"):
                await Server().start(f"127.0.0.1:{port}")
        finally:
            await first.stop()

    asyncio.run(run())


def test_up_lists_endpoints_and_its_services_die_with_it(tiny_qwen3: Path, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(tiny_qwen3), "--port", "0",
            "--http-port", "-1", "--run-dir", str(tmp_path), "--kv-cache-bytes", "16MiB", "--host-cache-bytes", "8MiB"]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        assert up.stdout is not None
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            lines.append(line)
            if not line or "Ctrl-C stops all services" in line:
                break
        text = "".join(lines)
        assert "Ctrl-C stops all services" in text, text
        for name in ("kvstore", "worker", "scheduler", "tokenizer"):
            assert re.search(rf"^{name} +\S+ +metrics http://\S+/metrics", text, re.M), text
        cached = [int(m) for m in re.findall(r"cached=(\d+)", text)]
        assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0, text  # the example shows the cache
        http = re.search(r"^http +(http://\S+)/v1", text, re.M)
        assert http is not None
        with urllib.request.urlopen(f"{http.group(1)}/health", timeout=10) as r:
            assert json.loads(r.read()) == {"status": "ok"}
        metrics = re.search(r"^tokenizer .* metrics (http://\S+)", text, re.M)
        assert metrics is not None
        with urllib.request.urlopen(metrics.group(1), timeout=10) as r:
            body = r.read().decode()
        assert 'strata_tokenizer_requests_total{finish_reason="length",model_name="qwen3-tiny"} 2.0' in body
        assert "_created" not in body
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 5  # etcd and the four services
        up.send_signal(signal.SIGKILL)
        up.wait(10)
        _, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, [p.cmdline()[:4] for p in alive]
    finally:
        if up.poll() is None:
            up.kill()
        for p in children:  # what a failed run left behind (they are init's children by now)
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def test_up_restart_on_failure_restarts_a_killed_service_and_its_streams_go_on(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    """``strata up --restart on-failure`` (issue #29): the scheduler, then the worker, SIGKILLed
    under 8 streams (greedy, seeded, grammar); each is started again at its address after a 1 s
    backoff and every stream goes on with the tokens of an uninterrupted run. Then etcd, SIGKILLed:
    started again on its ports and data, and the stack serves on."""
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(tiny_qwen3), "--port", "0", "--http-port", "0",
            "--run-dir", str(tmp_path), "--example", "", "--no-metrics", "--restart", "on-failure"]  # fmt: skip
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not any("Ctrl-C stops all services" in x for x in lines):
            assert time.monotonic() < deadline and up.poll() is None, "".join(lines)
            time.sleep(0.1)
        address = re.search(r"^tokenizer +(\S+)", "".join(lines), re.M)
        assert address is not None
        with grpc.insecure_channel(address.group(1)) as ch:
            api = pgrpc.StrataStub(ch)
            reqs = streams.mixed(8, 100)
            want = [w.ids for w in streams.run(api, reqs)]
            for name in ("scheduler", "worker"):
                pid = next(p.pid for p in psutil.Process(up.pid).children()
                           if f"services.{name}.server" in " ".join(p.cmdline()))  # fmt: skip

                killed: list[float] = []

                def kill(running: list[streams.Stream], pid: int = pid, killed: list[float] = killed) -> None:
                    streams.wait_streaming(running, 10)
                    killed.append(time.monotonic())
                    os.kill(pid, signal.SIGKILL)

                got = streams.run(api, reqs, kill)
                assert [g.error for g in got] == [None] * 8, name
                assert [g.ids for g in got] == want, name
                resumed = max(g.gap_after(killed[0]) for g in got if g.times[-1] > killed[0])
                print(f"[up --restart on-failure] {name} SIGKILLed under 8 streams: every stream streaming "
                      f"again {resumed:.2f}s after the kill")
            # etcd SIGKILLed: started again on its ports and data; the services keep serving.
            etcd = next(p for p in psutil.Process(up.pid).children() if "--initial-cluster" in p.cmdline())
            etcd.kill()
            while not any(x.startswith("etcd restarted at") for x in lines):
                assert time.monotonic() < deadline + 120 and up.poll() is None, "".join(lines)
                time.sleep(0.1)
            assert [g.ids for g in streams.run(api, reqs)] == want
        text = "".join(lines)
        for name in ("scheduler", "worker"):
            assert f"{name} exited with code -9; restarting it in 1s" in text, text
            assert re.search(rf"^{name} restarted at \S+", text, re.M), text
        assert "etcd exited; restarting it in 1s" in text, text
        assert up.poll() is None  # still supervising
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
