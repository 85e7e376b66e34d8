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
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from services.common.etcd_proc import free_port
from services.common.server import Server

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
