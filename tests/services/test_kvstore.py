"""The kvstore: backend contract (LRU, byte cap, atomic batches), the file backend's durability,
and the gRPC service end to end through the client."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.config import ConfigError, build_config
from services.common.errors import InvalidArgument
from services.kvstore.backends import Backend, FileBackend, MemoryBackend, PutResult
from services.kvstore.client import KVStoreClient, KVStoreError, KVStoreUnavailable, batch_pages
from services.kvstore.config import KVStoreConfig
from services.kvstore.server import KVStoreServicer, build_server
from strata.kvstore.v1 import kvstore_pb2 as pb
from strata.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

KiB = 1024
MiB = 1024 * KiB


def page(key: str, size: int) -> tuple[bytes, bytes]:
    """A page whose bytes depend on its key, so mixed-up pages compare unequal."""
    k = key.encode()
    return k, (k * (size // len(k) + 1))[:size]


@pytest.fixture(params=["memory", "file"])
def make_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Backend]:
    def make(capacity: int, max_page_bytes: int | None = None) -> Backend:
        if request.param == "memory":
            return MemoryBackend(capacity, max_page_bytes=max_page_bytes)
        return FileBackend(tmp_path / "store", capacity, max_page_bytes=max_page_bytes)

    return make


# --- backend contract, both backends ---------------------------------------------------------


def test_lru_evicts_least_recently_used_and_get_refreshes(make_backend: Callable[..., Backend]) -> None:
    b = make_backend(300)
    b.put_many([page("a", 100), page("b", 100), page("c", 100)])
    assert b.get_many([b"a"]) == [page("a", 100)[1]]  # a is now most recent; b is the LRU page
    assert b.put_many([page("d", 100)]) == (1, 1)
    assert b.get_many([b"b"]) == [None]
    assert b.exists_prefix([b"a"]) == b.exists_prefix([b"c"]) == b.exists_prefix([b"d"]) == 1
    s = b.stats()
    assert (s.used_bytes, s.pages, s.evictions, s.hits, s.misses) == (300, 3, 1, 1, 1)


def test_exists_does_not_refresh_recency(make_backend: Callable[..., Backend]) -> None:
    b = make_backend(200)
    b.put_many([page("a", 100), page("b", 100)])
    assert b.exists_prefix([b"a"]) == 1
    b.put_many([page("c", 100)])
    assert b.exists_prefix([b"a"]) == 0  # still evicted first despite the probe
    assert b.stats().hits == b.stats().misses == 0


def test_byte_cap_holds_across_many_puts(make_backend: Callable[..., Backend]) -> None:
    b = make_backend(1000)
    for i in range(50):
        b.put_many([page(f"k{i}", 70 + i)])
        assert b.stats().used_bytes <= 1000
    assert b.stats().evictions > 0


def test_oversize_page_refused_and_batch_stores_nothing(make_backend: Callable[..., Backend]) -> None:
    b = make_backend(100)
    with pytest.raises(InvalidArgument, match=r"page 1: 101 bytes exceeds the store's capacity of 100"):
        b.put_many([page("ok", 10), page("big", 101)])
    assert b.stats().pages == 0
    assert b.put_many([page("exact", 100)]) == (1, 0)


def test_max_page_bytes_refuses_below_capacity(make_backend: Callable[..., Backend]) -> None:
    b = make_backend(1000, max_page_bytes=64)
    with pytest.raises(InvalidArgument, match="page limit of 64"):
        b.put_many([page("p", 65)])


def test_invalid_key_refused_with_index(make_backend: Callable[..., Backend]) -> None:
    b = make_backend(1000)
    with pytest.raises(InvalidArgument, match=r"page 2: key is 257 bytes; keys must be 1..256"):
        b.put_many([page("a", 1), page("b", 1), (b"x" * 257, b"d")])
    with pytest.raises(InvalidArgument, match="page 0: key is 0 bytes"):
        b.put_many([(b"", b"d")])
    assert b.stats().pages == 0


def test_replace_adjusts_usage(make_backend: Callable[..., Backend]) -> None:
    b = make_backend(1000)
    b.put_many([page("a", 300), page("b", 100)])
    b.put_many([page("a", 50)])
    assert (b.stats().used_bytes, b.stats().pages) == (150, 2)
    assert b.get_many([b"a"]) == [page("a", 50)[1]]
    # Replacing with a page that only fits once the old version is gone evicts nothing else.
    assert b.put_many([page("a", 900)]) == (1, 0)
    assert b.stats().used_bytes == 1000


def test_exists_counts_leading_keys_only(make_backend: Callable[..., Backend]) -> None:
    b = make_backend(1000)
    b.put_many([page("a", 1), page("b", 1), page("d", 1)])
    assert b.exists_prefix([b"a", b"b", b"c", b"d"]) == 2
    assert b.exists_prefix([b"c", b"a"]) == 0
    assert b.exists_prefix([b"a", b"b", b"d"]) == 3
    assert b.exists_prefix([]) == 0
    assert b.present([b"a", b"c", b"d", b"b", b"a"]) == [True, False, True, True, True]
    assert b.present([]) == []
    assert b.stats().hits == b.stats().misses == 0  # probes are not reads


def test_delete_ignores_missing(make_backend: Callable[..., Backend]) -> None:
    b = make_backend(1000)
    b.put_many([page("a", 10), page("b", 20)])
    assert b.delete_many([b"a", b"zz", b"a"]) == 1
    assert (b.stats().used_bytes, b.stats().pages) == (20, 1)


class LruModel:
    """The reference: an ordered map evicting from the front."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.pages = capacity, OrderedDict[bytes, int]()

    def put(self, key: bytes, size: int) -> None:
        self.pages.pop(key, None)
        while sum(self.pages.values()) + size > self.capacity:
            self.pages.popitem(last=False)
        self.pages[key] = size

    def get(self, key: bytes) -> None:
        if key in self.pages:
            self.pages.move_to_end(key)


ops = st.lists(
    # Few keys and pages of a quarter to a half of the capacity keep eviction busy.
    st.tuples(st.sampled_from(["put", "put", "get", "delete"]), st.integers(0, 5), st.integers(0, 500)),
    max_size=60,
)


def check_against_model(b: Backend, steps: list[tuple[str, int, int]]) -> None:
    model = LruModel(b.capacity_bytes)
    keys = [f"key{i}".encode() for i in range(6)]
    for op, i, size in steps:
        key = keys[i]
        if op == "put":
            b.put_many([(key, bytes([i]) * size)])
            model.put(key, size)
        elif op == "get":
            got = b.get_many([key])[0]
            assert got == (bytes([i]) * model.pages[key] if key in model.pages else None)
            model.get(key)
        else:
            b.delete_many([key])
            model.pages.pop(key, None)
        s = b.stats()
        assert s.used_bytes <= s.capacity_bytes
        assert s.used_bytes == sum(model.pages.values())
        assert {k for k in keys if b.exists_prefix([k])} == set(model.pages)
    # Usage equals the sum of what is actually stored (read back, not taken from the model).
    stored = [v for v in b.get_many(keys) if v is not None]
    assert b.stats().used_bytes == sum(map(len, stored))
    assert b.stats().pages == len(stored)


@settings(max_examples=150, deadline=None)
@given(steps=ops)
def test_memory_backend_matches_lru_model(steps: list[tuple[str, int, int]]) -> None:
    check_against_model(MemoryBackend(1000), steps)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=ops)
def test_file_backend_matches_lru_model(steps: list[tuple[str, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        check_against_model(FileBackend(d, 1000), steps)


# --- file backend durability -------------------------------------------------------------------


def test_file_backend_rebuilds_index_and_lru_order_on_restart(tmp_path: Path) -> None:
    b = FileBackend(tmp_path, 300)
    for name in ("a", "b", "c"):
        b.put_many([page(name, 100)])
        time.sleep(0.01)  # distinct mtimes
    b.get_many([b"a"])  # touches a: b is now the oldest
    b2 = FileBackend(tmp_path, 300)
    assert (b2.stats().used_bytes, b2.stats().pages) == (300, 3)
    b2.put_many([page("d", 100)])
    assert b2.exists_prefix([b"b"]) == 0
    assert b2.get_many([b"a", b"c", b"d"]) == [page(n, 100)[1] for n in "acd"]


def test_file_backend_lowered_capacity_evicts_on_restart(tmp_path: Path) -> None:
    FileBackend(tmp_path, 1000).put_many([page(f"k{i}", 100) for i in range(10)])
    b = FileBackend(tmp_path, 450)
    assert (b.stats().used_bytes, b.stats().pages) == (400, 4)
    assert len(list((tmp_path / "pages").iterdir())) == 4


def test_file_backend_corrupt_page_is_a_miss_and_deleted(tmp_path: Path) -> None:
    b = FileBackend(tmp_path, 1000)
    b.put_many([page("a", 100), page("b", 100)])
    (path,) = [p for p in (tmp_path / "pages").iterdir() if p.read_bytes().endswith(page("a", 100)[1])]
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF  # flip a data bit; the size still matches the header
    path.write_bytes(bytes(blob))
    assert b.get_many([b"a", b"b"]) == [None, page("b", 100)[1]]
    assert not path.exists()
    assert (b.stats().used_bytes, b.stats().pages, b.stats().misses) == (100, 1, 1)


def test_file_backend_drops_torn_and_leftover_files_on_restart(tmp_path: Path) -> None:
    b = FileBackend(tmp_path, 1000)
    b.put_many([page("a", 100), page("b", 100)])
    (tmp_path / "tmp" / "crashed.tmp").write_bytes(b"half a page")
    victim = sorted((tmp_path / "pages").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:50])  # truncated: header no longer matches the size
    (tmp_path / "pages" / "stray.page").write_bytes(b"not ours")
    b2 = FileBackend(tmp_path, 1000)
    assert (b2.stats().used_bytes, b2.stats().pages) == (100, 1)
    assert list((tmp_path / "tmp").iterdir()) == []
    assert len(list((tmp_path / "pages").iterdir())) == 1


# --- config and client helpers -----------------------------------------------------------------


def test_config_rejects_unusable_values() -> None:
    with pytest.raises(ConfigError, match="path: the file backend needs a directory"):
        KVStoreConfig(backend="file")
    with pytest.raises(ConfigError, match="capacity_bytes"):
        build_config(KVStoreConfig, {"capacity_bytes": "0"})
    with pytest.raises(ConfigError, match="gRPC message cap"):
        KVStoreConfig(max_page_bytes=512 * MiB)
    with pytest.raises(ConfigError, match="unknown configuration key"):
        build_config(KVStoreConfig, {"capcity_bytes": 1})
    assert build_config(KVStoreConfig, {"capacity_bytes": "1024", "backend": "memory"}).capacity_bytes == 1024


def test_batch_pages_packs_many_pages_per_message() -> None:
    pages = [page(f"p{i:03}", 64 * KiB) for i in range(200)]
    batches = list(batch_pages(pages, 4 * MiB))
    assert [p for b in batches for p in b] == pages
    assert len(batches) == 4
    assert all(sum(len(k) + len(d) for k, d in b) <= 4 * MiB for b in batches)
    # A page larger than the batch travels alone; nothing in, nothing out.
    assert [len(b) for b in batch_pages([page("a", 10), page("b", 100), page("c", 10)], 50)] == [1, 1, 1]
    assert list(batch_pages([], 10)) == []


# --- end to end through grpc.aio ---------------------------------------------------------------


@asynccontextmanager
async def running(**overrides: Any) -> AsyncIterator[tuple[KVStoreClient, KVStoreServicer, str]]:
    cfg = KVStoreConfig(**overrides)
    server, servicer = build_server(cfg)
    port = await server.start("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    client = KVStoreClient(address, timeout_s=10)
    try:
        yield client, servicer, address
    finally:
        await client.close()
        await server.stop(0)


def run(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(fn())


def test_e2e_put_get_exists_delete_stats() -> None:
    async def body() -> None:
        async with running(capacity_bytes=64 * MiB) as (client, servicer, _):
            calls: list[int] = []
            put_many = servicer.backend.put_many

            def counting_put_many(pages: Sequence[tuple[bytes, bytes]]) -> PutResult:
                calls.append(len(pages))
                return put_many(pages)

            servicer.backend.put_many = counting_put_many  # type: ignore[method-assign]
            pages = [page(f"page-{i:04}", 64 * KiB) for i in range(200)]
            assert await client.put(pages) == (200, 0)
            assert sum(calls) == 200 and len(calls) <= 4  # batched, never one message per page

            keys = [k for k, _ in pages]
            assert await client.get(keys) == [d for _, d in pages]
            assert await client.get([b"nope", keys[7]]) == [None, pages[7][1]]
            assert await client.exists([*keys[:10], b"gap", keys[10]]) == 10
            assert await client.delete([*keys[100:], b"never-stored"]) == 100
            assert await client.exists(keys) == 100
            s = await client.stats()
            assert (s.used_bytes, s.pages, s.backend) == (100 * 64 * KiB, 100, "memory")
            assert s.capacity_bytes == 64 * MiB
            assert (s.hits, s.misses) == (201, 1)
            assert await client.get([]) == []

    run(body)


def test_e2e_get_streams_in_batches() -> None:
    async def body() -> None:
        async with running(batch_bytes=256 * KiB) as (client, _, address):
            pages = [page(f"p{i:02}", 100 * KiB) for i in range(10)]
            await client.put(pages)
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.KVStoreStub(channel)
                responses = [r async for r in stub.Get(pb.GetRequest(keys=[k for k, _ in pages]))]
            # Two 100 KiB pages fit under 256 KiB, three do not.
            assert [len(r.pages) for r in responses] == [2, 2, 2, 2, 2]
            assert [p.data for r in responses for p in r.pages] == [d for _, d in pages]

    run(body)


def test_e2e_eviction_keeps_usage_under_cap() -> None:
    async def body() -> None:
        async with running(capacity_bytes=1 * MiB) as (client, _, _address):
            pages = [page(f"p{i:02}", 64 * KiB) for i in range(40)]
            assert await client.put(pages) == (40, 24)
            s = await client.stats()
            assert s.used_bytes <= s.capacity_bytes and s.pages == 16 and s.evictions == 24
            assert await client.exists([k for k, _ in pages[24:]]) == 16
            assert await client.exists([k for k, _ in pages]) == 0

    run(body)


def test_e2e_invalid_arguments_and_server_keeps_serving() -> None:
    async def body() -> None:
        async with running(capacity_bytes=1 * MiB) as (client, _, _address):
            with pytest.raises(KVStoreError, match=r"key 1: key is 300 bytes") as err:
                await client.get([b"ok", b"k" * 300])
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(KVStoreError, match="key 0: key is 0 bytes") as err:
                await client.exists([b""])
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(KVStoreError, match=r"Put batch 0: page 0: 2097152 bytes exceeds") as err:
                await client.put([page("big", 2 * MiB)])
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert await client.put([page("fine", 10)]) == (1, 0)
            assert await client.get([b"fine"]) == [page("fine", 10)[1]]

    run(body)


def test_e2e_file_backend(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(backend="file", path=str(tmp_path), capacity_bytes=1 * MiB) as (client, _, _a):
            pages = [page(f"p{i:02}", 100 * KiB) for i in range(12)]
            assert await client.put(pages) == (12, 2)
            assert await client.get([k for k, _ in pages[2:]]) == [d for _, d in pages[2:]]
            assert (await client.stats()).backend == "file"

    run(body)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_server_raises_unavailable() -> None:
    async def body() -> None:
        async with KVStoreClient(f"127.0.0.1:{free_port()}", timeout_s=2) as client:
            with pytest.raises(KVStoreUnavailable):
                await client.get([b"a"])
            with pytest.raises(KVStoreUnavailable):
                await client.put([page("a", 10)])
            with pytest.raises(KVStoreUnavailable):
                await client.exists([b"a"])
        # A server that goes away mid-life reads the same.
        async with running() as (client, _, _address):
            pass
        async with KVStoreClient(_address, timeout_s=2) as client:
            with pytest.raises(KVStoreUnavailable):
                await client.stats()

    run(body)


def test_runs_as_a_process_and_stops_on_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.kvstore.server", "--port", str(port), "--capacity-bytes", "1048576"],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )

    async def body() -> None:
        async with KVStoreClient(f"127.0.0.1:{port}", timeout_s=2) as client:
            for _ in range(100):
                try:
                    s = await client.stats()
                    break
                except KVStoreUnavailable:
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("kvstore process never came up")
            assert s.capacity_bytes == 1048576

    try:
        run(body)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert proc.stdout is not None
        assert f"READY kvstore 127.0.0.1:{port}" in proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
