"""The worker's host / L3 step ops on the real engine (tiny Qwen3): copies round-trip bit for bit,
bad ops are refused before anything runs, and a slow, short or broken kvstore is a failed or
short job (never a failed step). The kvstore port is a stand-in here (a unit test of the engine's
side); tests/engine/test_memory_tiers.py and tests/services/test_hicache_e2e.py use a real kvstore."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
import torch

from services.common.step import HostBackup, HostLoad, JobResult, L3Get, L3Put, StepError, StepRequest
from services.worker.engine import Engine, EngineConfig

P = 4


class FakePort:
    """Records puts in a dict; gets answer from it. ``fail`` makes every call raise."""

    def __init__(self) -> None:
        self.pages: dict[bytes, bytes] = {}
        self.fail = False
        self.drop_every_other = False

    def put(self, pages: list[tuple[bytes, bytes]]) -> concurrent.futures.Future[int]:
        f: concurrent.futures.Future[int] = concurrent.futures.Future()
        if self.fail:
            f.set_exception(ConnectionError("shard down"))
            return f
        kept = pages[::2] if self.drop_every_other else pages
        self.pages.update(kept)
        f.set_result(len(kept))
        return f

    def get(self, keys: list[bytes]) -> concurrent.futures.Future[list[bytes | None]]:
        f: concurrent.futures.Future[list[bytes | None]] = concurrent.futures.Future()
        if self.fail:
            f.set_exception(ConnectionError("shard down"))
        else:
            f.set_result([self.pages.get(k) for k in keys])
        return f


@pytest.fixture(scope="module")
def port() -> FakePort:
    return FakePort()


@pytest.fixture(scope="module")
def engine(tiny_qwen3: Path, port: FakePort) -> Engine:
    cfg = EngineConfig(kv_cache_bytes=1 << 20, max_rows=4, host_cache_bytes=1 << 20, host_page_tokens=P)
    return Engine(tiny_qwen3, cfg, port)


def _key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _kv(engine: Engine, slots: list[int]) -> torch.Tensor:
    idx = torch.tensor(slots)
    return torch.stack([t.index_select(0, idx) for t in (*engine.kv.k, *engine.kv.v)])


def test_backup_put_get_load_round_trip(engine: Engine, port: FakePort) -> None:
    for t in (*engine.kv.k, *engine.kv.v):
        t.normal_()
    src = [5, 9, 2, 7, 40, 41, 42, 43]  # loose slots, then an aligned page
    before = _kv(engine, src)
    r = engine.step(StepRequest(1, ops=[HostBackup(1, tuple(src), (3, 4)), L3Put(2, (3, 4), (_key(1), _key(2)))]))
    assert r.jobs == [JobResult(1, True, 2), JobResult(2, True, 2)]
    assert engine.host is not None
    engine.host.pool.pages.normal_()  # the host copy is gone: only L3 has the bytes now
    dst = [100, 101, 102, 103, 60, 61, 62, 63]
    r = engine.step(StepRequest(2, ops=[L3Get(3, (_key(1), _key(2), _key(3)), (0, 1, 2))]))
    assert r.jobs == [JobResult(3, False, 2)]  # the third key is missing: two leading pages
    r = engine.step(StepRequest(3, ops=[HostLoad(4, (0, 1), tuple(dst))]))
    assert r.jobs == [JobResult(4, True, 2)]
    assert torch.equal(_kv(engine, dst), before)


def test_a_broken_store_fails_the_job_not_the_step(engine: Engine, port: FakePort) -> None:
    port.fail = True
    try:
        r = engine.step(StepRequest(10, ops=[L3Put(5, (0,), (_key(9),)), L3Get(6, (_key(1),), (1,))]))
    finally:
        port.fail = False
    assert r.jobs == [JobResult(5, False, 0), JobResult(6, False, 0)]
    port.drop_every_other = True
    try:
        r = engine.step(StepRequest(11, ops=[L3Put(7, (0, 1), (_key(10), _key(11)))]))
    finally:
        port.drop_every_other = False
    assert r.jobs == [JobResult(7, False, 1)]  # a shard skipped a page: not all stored


@pytest.mark.parametrize(
    ("op", "match"),
    [
        (HostBackup(1, (0, 1, 2), (0,)), "1 host pages need 4 slots"),
        (HostBackup(1, (0, 1, 2, 3), (10**6,)), "page 1000000 outside"),
        (HostLoad(1, (0,), (0, 1, 2, 10**7)), "slot 10000000 outside"),
        (HostLoad(1, (0, 1), (0, 1, 2, 3, 0, 1, 2, 3)), "destination repeats"),
        (L3Put(1, (0,), (b"short",)), "a key is 32 bytes"),
        (L3Get(1, (_key(1),), (0, 1)), "1 keys for 2 host pages"),
    ],
)
def test_bad_host_ops_are_refused_before_anything_runs(engine: Engine, op: object, match: str) -> None:
    assert engine.host is not None
    engine.host.pool.pages[0].fill_(7.0)
    ok = HostBackup(99, (0, 1, 2, 3), (0,))  # valid, but must not run: a later op is bad
    with pytest.raises(StepError, match=match):
        engine.step(StepRequest(20, ops=[ok, op]))  # type: ignore[list-item]
    assert bool((engine.host.pool.pages[0] == 7.0).all())


def test_host_ops_need_a_host_pool_and_l3(tiny_qwen3: Path) -> None:
    plain = Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=1 << 20, max_rows=2))
    with pytest.raises(StepError, match="no host pool"):
        plain.step(StepRequest(1, ops=[HostBackup(1, (0,), (0,))]))
    host_only = Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=1 << 20, max_rows=2, host_cache_bytes=1 << 20))
    assert host_only.info.host_pages > 0 and not host_only.info.l3
    with pytest.raises(StepError, match="no kvstore connection"):
        host_only.step(StepRequest(1, ops=[L3Get(1, (_key(1),), (0,))]))
