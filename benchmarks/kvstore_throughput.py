"""Put / get throughput of the kvstore through gRPC, against a plain memory copy of the same bytes.

    .venv/bin/python benchmarks/kvstore_throughput.py [--total-mib 256] [--page-kib 256] [--process]

``--process`` runs the server as a separate process (what a deployment does: client and server
then use separate cores); otherwise client and server share one event loop in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.kvstore.client import KVStoreClient, KVStoreUnavailable  # noqa: E402
from services.kvstore.config import KVStoreConfig  # noqa: E402
from services.kvstore.server import build_server  # noqa: E402

MiB = 1024 * 1024


async def best_of(repeats: int, fn: Callable[[], Awaitable[object]]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return min(times)


def memcpy_seconds(pages: list[tuple[bytes, bytes]], repeats: int) -> float:
    total = sum(len(d) for _, d in pages)
    times = []
    for _ in range(repeats):
        dst = bytearray(total)
        start = time.perf_counter()
        offset = 0
        for _, data in pages:
            dst[offset : offset + len(data)] = data
            offset += len(data)
        times.append(time.perf_counter() - start)
    return min(times)


async def measure(address: str, pages: list[tuple[bytes, bytes]], repeats: int) -> tuple[float, float]:
    keys = [k for k, _ in pages]
    async with KVStoreClient(address, timeout_s=120) as client:
        for _ in range(100):
            try:
                await client.stats()
                break
            except KVStoreUnavailable:
                await asyncio.sleep(0.1)
        put_s = await best_of(repeats, lambda: client.put(pages))
        got = await client.get(keys)
        assert got == [d for _, d in pages], "pages came back different"
        get_s = await best_of(repeats, lambda: client.get(keys))
    return put_s, get_s


async def in_process(
    cfg: KVStoreConfig, pages: list[tuple[bytes, bytes]], repeats: int
) -> tuple[float, float]:
    server, _ = build_server(cfg)
    port = await server.start("127.0.0.1:0")
    try:
        return await measure(f"127.0.0.1:{port}", pages, repeats)
    finally:
        await server.stop(0)


def in_subprocess(cfg: KVStoreConfig, pages: list[tuple[bytes, bytes]], repeats: int) -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "services.kvstore.server", "--port", str(port)]
    cmd += ["--capacity-bytes", str(cfg.capacity_bytes), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        return asyncio.run(measure(f"127.0.0.1:{port}", pages, repeats))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--page-kib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--process", action="store_true", help="run the server as a separate process")
    args = parser.parse_args()

    page_bytes = args.page_kib * 1024
    count = args.total_mib * MiB // page_bytes
    # Distinct, incompressible-looking pages; keys are 32 bytes like a chained page hash.
    blob = os.urandom(page_bytes + count)
    pages = [(i.to_bytes(32, "big"), blob[i : i + page_bytes]) for i in range(count)]
    total = count * page_bytes
    cfg = KVStoreConfig(capacity_bytes=2 * total)

    copy_s = memcpy_seconds(pages, args.repeats)
    if args.process:
        put_s, get_s = in_subprocess(cfg, pages, args.repeats)
    else:
        put_s, get_s = asyncio.run(in_process(cfg, pages, args.repeats))
    where = "separate process" if args.process else "same process and event loop"
    print(f"{count} pages x {args.page_kib} KiB = {total / MiB:.0f} MiB, server in {where}")
    for name, seconds in (("memcpy", copy_s), ("put", put_s), ("get", get_s)):
        print(f"  {name:7s} {seconds * 1e3:8.1f} ms  {total / seconds / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
