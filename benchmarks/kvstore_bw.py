"""kvstore put / get bandwidth against a raw memcpy of the same bytes, on this machine.

    python -m benchmarks.kvstore_bw [--page-bytes N] [--total-mib M] [--shards 1 2]
                                        [--backend memory file] [--out docs/bench/kvstore.json]

For each backend and shard count: start that many kvstore server processes on loopback (each with
room for all the data, so nothing is evicted), put ``--total-mib`` of random pages through the
client (1 shard: ``KVStoreClient``; more: ``ShardedKVStore`` with rendezvous placement), the client
streaming them in messages of ``--batch-bytes``; then get every page back and check it against what
was sent (page-by-page equality and a CRC-32 of the whole stream). ``--repeats`` passes of put + get
(a later put replaces the same keys); the best pass of each is reported, every pass is verified.
Each shard's own Stats must account for every page, none evicted.

The yardstick: copying the same page buffers into one preallocated buffer (numpy, best of 3; the
first pass also faults the buffer in), measured in the same run, so put / memcpy and get / memcpy
compare like with like on this machine. GB/s counts page bytes only (keys and framing excluded),
GB = 1e9 bytes. The client's channels are connected before the clock starts.

Writes ``--out`` (JSON) and prints a markdown table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from services.common.step import HOST_PAGE_TOKENS
from services.kvstore.client import DEFAULT_BATCH_BYTES, KVStoreClient
from services.kvstore.sharded import ShardedKVStore

BackendKind = Literal["memory", "file"]

MiB = 1 << 20
GB = 1e9
# KV bytes per token of the bench model (`strata model tiny --size bench`): K and V × 8 layers ×
# 4 KV heads × head_dim 64 × 4 bytes (fp32, the worker's default dtype) = 16 KiB.
BENCH_KV_BYTES_PER_TOKEN = 2 * 8 * 4 * 64 * 4
DEFAULT_PAGE_BYTES = HOST_PAGE_TOKENS * BENCH_KV_BYTES_PER_TOKEN  # one L3 page: 1 MiB
MAX_PAGE_BYTES = 64 * MiB  # the server's default --max-page-bytes
MEMCPY_REPEATS = 3
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0
_REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class BenchSpec:
    page_bytes: int = DEFAULT_PAGE_BYTES
    total_mib: float = 256.0
    shards: tuple[int, ...] = (1, 2)
    backends: tuple[BackendKind, ...] = ("memory", "file")
    batch_bytes: int = DEFAULT_BATCH_BYTES  # per streamed message, client and server
    repeats: int = 3  # put + get passes per case; the best of each is reported
    timeout_s: float = 120.0  # deadline of one whole put or get
    tmp_dir: str | None = None  # where file-backend shards keep pages; None = the system default
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.page_bytes <= MAX_PAGE_BYTES:
            raise ValueError(f"page_bytes must be in 1..{MAX_PAGE_BYTES}, got {self.page_bytes}")
        if self.num_pages < 1:
            raise ValueError(f"total_mib {self.total_mib} holds no page of {self.page_bytes} bytes")
        if not self.shards or min(self.shards) < 1:
            raise ValueError(f"shard counts must be >= 1, got {self.shards}")
        if self.batch_bytes < 1:
            raise ValueError(f"batch_bytes must be >= 1, got {self.batch_bytes}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if not self.backends:
            raise ValueError("no backend to measure")

    @property
    def num_pages(self) -> int:
        return int(self.total_mib * MiB) // self.page_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes


@dataclass(frozen=True, slots=True)
class CaseResult:
    backend: str
    shards: int
    client: str
    pages_per_shard: tuple[int, ...]  # from each shard's Stats after the run
    put_s: tuple[float, ...]  # every pass
    get_s: tuple[float, ...]
    put_gb_s: float  # best pass
    get_gb_s: float
    put_vs_memcpy: float
    get_vs_memcpy: float
    stored: int
    evicted: int  # by the shards during the run; must be 0
    missing: int  # pages a get did not return, over all passes
    mismatched: int  # pages a get returned with other bytes, over all passes
    crc32: str  # of the pages the last get returned, in order
    verified: bool  # every page back, byte for byte, and every shard holds what was put


@dataclass(frozen=True, slots=True)
class Report:
    page_bytes: int
    page_tokens: int  # tokens of the bench model's KV per page (0 when not a whole number)
    pages: int
    total_bytes: int
    batch_bytes: int
    crc32: str  # of the pages sent, in order
    memcpy_gb_s: float  # best of MEMCPY_REPEATS
    memcpy_s: tuple[float, ...]
    results: tuple[CaseResult, ...]
    machine: dict[str, str | int]


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- data and the yardstick ------------------------------------------------------------------------


def make_pages(spec: BenchSpec) -> tuple[list[bytes], list[bytes]]:
    """(keys, pages): 32-byte keys like L3 page hashes, and seeded random page data."""
    blob = np.random.default_rng(spec.seed).bytes(spec.total_bytes)
    n = spec.page_bytes
    pages = [blob[i * n : (i + 1) * n] for i in range(spec.num_pages)]
    keys = [hashlib.sha256(b"kvstore_bw/%d" % i).digest() for i in range(spec.num_pages)]
    return keys, pages


def crc32_of(pages: Sequence[bytes]) -> int:
    crc = 0
    for page in pages:
        crc = zlib.crc32(page, crc)
    return crc


def memcpy_seconds(pages: Sequence[bytes], expect_crc: int, repeats: int = MEMCPY_REPEATS) -> list[float]:
    """Seconds of each pass copying every page, in order, into one preallocated buffer. The first
    pass also faults the buffer's memory in; the best pass is the yardstick."""
    total = sum(len(p) for p in pages)
    dst = np.empty(total, dtype=np.uint8)
    srcs = [np.frombuffer(p, dtype=np.uint8) for p in pages]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        off = 0
        for src in srcs:
            dst[off : off + src.size] = src
            off += src.size
        times.append(time.perf_counter() - t0)
    if zlib.crc32(dst.data) != expect_crc:
        raise AssertionError("memcpy produced other bytes than its source")
    return times


# -- server processes ------------------------------------------------------------------------------


class _ShardProcess:
    """One ``services.kvstore.server`` process. A thread drains its output (so a chatty server
    never blocks on a full pipe), picks the address off the READY line and keeps the last lines for
    an error message."""

    def __init__(self, args: list[str]) -> None:
        self.address = ""
        self._tail: deque[str] = deque(maxlen=20)
        self._ready = threading.Event()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "services.kvstore.server", *args],
            cwd=_REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._tail.append(line.rstrip())
            if not self.address and line.startswith("READY kvstore "):
                self.address = line.split()[-1]
                self._ready.set()
        self._ready.set()  # EOF: the process is gone; wait_ready sees no address

    def wait_ready(self, timeout_s: float) -> str:
        if not self._ready.wait(timeout_s) or not self.address:
            output = "\n".join(self._tail)
            raise RuntimeError(
                f"kvstore server not ready after {timeout_s:.0f}s (exit code {self._proc.poll()}):\n{output}"
            )
        return self.address

    def terminate(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()

    def wait(self) -> None:
        try:
            self._proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=_STOP_TIMEOUT_S)


@contextlib.contextmanager
def kvstore_shards(
    n: int, backend: BackendKind, capacity_bytes: int, batch_bytes: int, root: Path | None
) -> Iterator[list[str]]:
    """Start ``n`` kvstore processes on loopback (file shards under ``root/shard<i>``) and yield
    their addresses; every process is stopped on exit, on an exception too."""
    procs: list[_ShardProcess] = []
    try:
        for i in range(n):
            args = ["--host", "127.0.0.1", "--port", "0", "--backend", backend, "--log-level", "warning",
                    "--capacity-bytes", str(capacity_bytes), "--batch-bytes", str(batch_bytes)]
            if backend == "file":
                assert root is not None
                args += ["--path", str(root / f"shard{i}")]
            procs.append(_ShardProcess(args))
        addresses = [p.wait_ready(_START_TIMEOUT_S) for p in procs]
        yield addresses
    finally:
        for p in procs:  # SIGTERM to all first: they shut down in parallel
            p.terminate()
        for p in procs:
            p.wait()


# -- one case --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Transfer:
    """What the passes of one case measured and found. The pages got back are checked and dropped
    inside the event loop, never returned: a task's result may be repr'd, and 256 MiB of it is slow."""

    put_s: tuple[float, ...]
    get_s: tuple[float, ...]
    stored: int  # fewest pages any put stored
    missing: int  # summed over the passes
    mismatched: int  # summed over the passes
    crcs: tuple[int, ...]  # of each get's pages, in order
    pages_per_shard: tuple[int, ...]
    evicted: int


async def _transfer(addresses: list[str], keys: list[bytes], pages: list[bytes], spec: BenchSpec) -> _Transfer:
    store: KVStoreClient | ShardedKVStore
    if len(addresses) == 1:
        store = KVStoreClient(addresses[0], batch_bytes=spec.batch_bytes, timeout_s=spec.timeout_s)
    else:
        store = ShardedKVStore(addresses, batch_bytes=spec.batch_bytes, timeout_s=spec.timeout_s)
    batch = list(zip(keys, pages, strict=True))
    put_s, get_s, crcs = [], [], []
    stored, evicted, missing, mismatched = len(pages), 0, 0, 0
    async with store:
        await store.exists(keys)  # connects every shard's channel before the clock starts
        for _ in range(spec.repeats):  # after the first pass, a put replaces the pages it stored
            t0 = time.perf_counter()
            put = await store.put(batch)
            put_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = await store.get(keys)
            get_s.append(time.perf_counter() - t0)
            stored, evicted = min(stored, put.stored), evicted + put.evicted
            missing += sum(g is None for g in got)
            mismatched += sum(g is not None and g != p for g, p in zip(got, pages, strict=True))
            crcs.append(crc32_of([g for g in got if g is not None]))
            del got
    stats = []
    for address in addresses:
        async with KVStoreClient(address, timeout_s=spec.timeout_s) as client:
            stats.append(await client.stats())
    evicted += sum(s.evictions for s in stats)
    return _Transfer(tuple(put_s), tuple(get_s), stored, missing, mismatched, tuple(crcs),
                     tuple(s.pages for s in stats), evicted)


def run_case(
    spec: BenchSpec, backend: BackendKind, shards: int, keys: list[bytes], pages: list[bytes], memcpy_gb_s: float
) -> CaseResult:
    """Put and get every page ``spec.repeats`` times through ``shards`` fresh server processes."""
    # Every shard has room for all the data: placement is uneven, and an eviction would turn the
    # run into a measurement of misses.
    capacity = spec.total_bytes + spec.page_bytes
    with contextlib.ExitStack() as stack:
        root = None
        if backend == "file":
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstore_bw-", dir=spec.tmp_dir)))
        addresses = stack.enter_context(kvstore_shards(shards, backend, capacity, spec.batch_bytes, root))
        t = asyncio.run(_transfer(addresses, keys, pages, spec))
    sent_crc = crc32_of(pages)
    verified = (
        t.missing == 0 and t.mismatched == 0 and all(c == sent_crc for c in t.crcs) and t.evicted == 0
        and t.stored == len(pages) and sum(t.pages_per_shard) == len(pages)
    )
    put_gb_s, get_gb_s = spec.total_bytes / min(t.put_s) / GB, spec.total_bytes / min(t.get_s) / GB
    return CaseResult(
        backend, shards, "KVStoreClient" if shards == 1 else "ShardedKVStore", t.pages_per_shard,
        t.put_s, t.get_s, put_gb_s, get_gb_s, put_gb_s / memcpy_gb_s, get_gb_s / memcpy_gb_s,
        t.stored, t.evicted, t.missing, t.mismatched, f"{t.crcs[-1]:08x}", verified,
    )


def _machine() -> dict[str, str | int]:
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def run(spec: BenchSpec) -> Report:
    """Every (backend, shard count) case of ``spec``, beside the memcpy of the same pages."""
    _say(f"-- {spec.num_pages} pages of {spec.page_bytes} bytes ({spec.total_bytes / MiB:.0f} MiB), seed {spec.seed}")
    keys, pages = make_pages(spec)
    crc = crc32_of(pages)
    memcpy_s = memcpy_seconds(pages, crc)
    memcpy_gb_s = spec.total_bytes / min(memcpy_s) / GB
    _say(f"-- memcpy: {memcpy_gb_s:.2f} GB/s (best of {len(memcpy_s)})")
    results = []
    for backend in spec.backends:
        for shards in spec.shards:
            r = run_case(spec, backend, shards, keys, pages, memcpy_gb_s)
            _say(f"-- {backend}, {shards} shard(s): put {r.put_gb_s:.3f} GB/s, get {r.get_gb_s:.3f} GB/s, "
                 f"verified {r.verified}")
            results.append(r)
    tokens, rest = divmod(spec.page_bytes, BENCH_KV_BYTES_PER_TOKEN)
    return Report(
        spec.page_bytes, 0 if rest else tokens, spec.num_pages, spec.total_bytes, spec.batch_bytes, f"{crc:08x}",
        memcpy_gb_s, tuple(memcpy_s), tuple(results), _machine(),
    )


def markdown(report: Report) -> str:
    lines = [
        "| backend | shards | client | put GB/s | get GB/s | memcpy GB/s | put / memcpy | get / memcpy | verified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.results:
        lines.append(
            f"| {r.backend} | {r.shards} | {r.client} | {r.put_gb_s:.3f} | {r.get_gb_s:.3f} | "
            f"{report.memcpy_gb_s:.2f} | {r.put_vs_memcpy:.4f} | {r.get_vs_memcpy:.4f} | {r.verified} |"
        )
    tokens = f" = {report.page_tokens} tokens of bench-model KV" if report.page_tokens else ""
    lines.append(
        f"\n{report.pages} pages of {report.page_bytes} bytes{tokens}, {report.total_bytes / MiB:.0f} MiB in all, "
        f"{report.batch_bytes} bytes per message; {report.machine['cpus']} CPUs; GB = 1e9 bytes"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-bytes", type=int, default=DEFAULT_PAGE_BYTES,
                   help=f"bytes per page (default {DEFAULT_PAGE_BYTES}: {HOST_PAGE_TOKENS} tokens of bench-model KV)")
    p.add_argument("--total-mib", type=float, default=256.0, help="page data put and got back per case")
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2], help="shard counts to run")
    p.add_argument("--backend", choices=["memory", "file"], nargs="+", default=["memory", "file"])
    p.add_argument("--batch-bytes", type=int, default=DEFAULT_BATCH_BYTES, help="bytes per streamed message")
    p.add_argument("--repeats", type=int, default=3, help="put + get passes per case (best reported)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="deadline of one whole put or get")
    p.add_argument("--tmp-dir", default=None, help="parent of the file backend's directories")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/bench/kvstore.json"))
    args = p.parse_args(argv)
    try:
        spec = BenchSpec(args.page_bytes, args.total_mib, tuple(args.shards), tuple(args.backend),
                         args.batch_bytes, args.repeats, args.timeout_s, args.tmp_dir, args.seed)
    except ValueError as e:
        p.error(str(e))
    # SIGTERM unwinds like Ctrl-C, so the server processes are stopped on the way out.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        t0 = time.perf_counter()
        report = run(spec)
        elapsed = time.perf_counter() - t0
    finally:
        signal.signal(signal.SIGTERM, previous)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        **asdict(report), "gb": GB, "elapsed_s": elapsed,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }, indent=2) + "\n")
    print(markdown(report))
    return 0 if all(r.verified for r in report.results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
