"""`make bench-kvstore` at toy size: every page put through real kvstore processes comes back byte
for byte, the report carries every figure it promises, and no server outlives the benchmark."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from benchmarks import kvstore_bw
from services.kvstore.client import KVStoreClient, KVStoreUnavailable

PAGE = 256 * 1024
TOTAL_MIB = 4.0
PAGES = int(TOTAL_MIB * 2**20) // PAGE


def test_bench_verifies_every_page_on_each_backend_and_shard_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "kvstore.json"
    files = tmp_path / "files"
    files.mkdir()
    args = ["--total-mib", str(TOTAL_MIB), "--page-bytes", str(PAGE), "--shards", "1", "2",
            "--backend", "memory", "file", "--repeats", "2", "--tmp-dir", str(files), "--out", str(out)]
    assert kvstore_bw.main(args) == 0

    data = json.loads(out.read_text())
    assert (data["page_bytes"], data["pages"], data["total_bytes"]) == (PAGE, PAGES, PAGES * PAGE)
    assert data["page_tokens"] == PAGE // kvstore_bw.BENCH_KV_BYTES_PER_TOKEN
    assert len(data["memcpy_s"]) == kvstore_bw.MEMCPY_REPEATS and data["memcpy_gb_s"] > 0
    cases = {(r["backend"], r["shards"]): r for r in data["results"]}
    assert set(cases) == {("memory", 1), ("memory", 2), ("file", 1), ("file", 2)}
    for (_, shards), r in cases.items():
        assert r["verified"] is True
        assert (r["missing"], r["mismatched"], r["evicted"], r["stored"]) == (0, 0, 0, PAGES)
        assert r["crc32"] == data["crc32"]  # the bytes got back are the bytes sent
        assert len(r["pages_per_shard"]) == shards and sum(r["pages_per_shard"]) == PAGES
        assert len(r["put_s"]) == len(r["get_s"]) == 2
        assert r["put_gb_s"] == pytest.approx(PAGES * PAGE / min(r["put_s"]) / 1e9)
        assert r["put_vs_memcpy"] == pytest.approx(r["put_gb_s"] / data["memcpy_gb_s"])
        assert r["get_vs_memcpy"] == pytest.approx(r["get_gb_s"] / data["memcpy_gb_s"])
    assert cases[("memory", 2)]["client"] == "ShardedKVStore" and cases[("memory", 1)]["client"] == "KVStoreClient"
    assert min(cases[("memory", 2)]["pages_per_shard"]) > 0  # both shards took part
    assert "| memory | 2 | ShardedKVStore |" in capsys.readouterr().out
    assert list(files.iterdir()) == []  # the file backend's directories are removed


def test_servers_stop_when_the_benchmark_fails() -> None:
    with pytest.raises(RuntimeError, match="boom"), kvstore_bw.kvstore_shards(2, "memory", 2**20, 2**20, None) as addrs:
        assert len(addrs) == 2
        raise RuntimeError("boom")

    async def reachable(address: str) -> bool:
        async with KVStoreClient(address, timeout_s=1.0) as client:
            try:
                await client.stats()
            except KVStoreUnavailable:
                return False
        return True

    assert [asyncio.run(reachable(a)) for a in addrs] == [False, False]


@pytest.mark.parametrize(
    "kwargs", [{"page_bytes": 0}, {"page_bytes": 65 * 2**20}, {"total_mib": 0.5, "page_bytes": 2**20},
               {"shards": (0,)}, {"repeats": 0}, {"batch_bytes": 0}, {"backends": ()}]
)
def test_spec_rejects_unusable_sizes(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        kvstore_bw.BenchSpec(**kwargs)  # type: ignore[arg-type]
