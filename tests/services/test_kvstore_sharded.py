"""The sharded kvstore client over three real in-process kvstore servers: rendezvous placement,
round trips, the cross-shard prefix count, and a dead shard read as misses, never as an error."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from services.common.discovery import Discovery, Registration, ServiceRecord
from services.common.server import Server
from services.kvstore.client import KVStoreClient
from services.kvstore.config import KVStoreConfig
from services.kvstore.server import KVStoreServicer, build_server
from services.kvstore.sharded import ShardedKVStore, ShardedPutResult, rendezvous_owner

KiB = 1024
MiB = 1024 * KiB


@dataclass(slots=True)
class Shard:
    server: Server
    servicer: KVStoreServicer
    address: str


@asynccontextmanager
async def shards(n: int = 3) -> AsyncIterator[list[Shard]]:
    started: list[Shard] = []
    try:
        for _ in range(n):
            server, servicer = build_server(KVStoreConfig(capacity_bytes=64 * MiB))
            port = await server.start("127.0.0.1:0")
            started.append(Shard(server, servicer, f"127.0.0.1:{port}"))
        yield started
    finally:
        for s in started:
            await s.server.stop(0)


def keys_(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}-{i:05}".encode().ljust(32, b".") for i in range(n)]


def data_of(key: bytes, size: int = 1 * KiB) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def run(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(fn())


def test_rendezvous_spreads_keys_and_a_removed_shard_moves_only_its_keys() -> None:
    addresses = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]
    keys = keys_(3000)
    owners = {k: rendezvous_owner(k, addresses) for k in keys}
    counts = {a: sum(o == a for o in owners.values()) for a in addresses}
    assert all(800 < c < 1200 for c in counts.values()), counts  # about a third each
    assert rendezvous_owner(keys[0], list(reversed(addresses))) == owners[keys[0]]  # order-free

    dead = addresses[1]
    survivors = [a for a in addresses if a != dead]
    for k in keys:
        after = rendezvous_owner(k, survivors)
        assert after == owners[k] if owners[k] != dead else after in survivors
    # The dead shard's keys split over both survivors, not all onto one.
    moved = [rendezvous_owner(k, survivors) for k in keys if owners[k] == dead]
    assert all(moved.count(a) > 0 for a in survivors)
    # A new shard takes keys only from others, never reshuffles between existing ones.
    grown = [*addresses, "10.0.0.4:7000"]
    for k in keys:
        after = rendezvous_owner(k, grown)
        assert after in (owners[k], "10.0.0.4:7000")


def test_put_get_exists_across_shards() -> None:
    async def body() -> None:
        async with shards() as ss, ShardedKVStore([s.address for s in ss]) as store:
            keys = keys_(300)
            pages = [(k, data_of(k)) for k in keys]
            assert await store.put(pages) == ShardedPutResult(stored=300, evicted=0, skipped=0)
            # Each shard holds exactly the keys it owns, and every shard holds some.
            for s in ss:
                mine = [k for k in keys if store.shard_of(k) == s.address]
                assert 50 < len(mine) < 150
                assert s.servicer.backend.stats().pages == len(mine)
            assert await store.get(keys) == [d for _, d in pages]
            assert await store.get([keys[5], b"missing".ljust(32), keys[0]]) == [
                pages[5][1], None, pages[0][1],
            ]  # fmt: skip
            assert await store.exists(keys) == 300
            assert await store.exists([]) == 0 and await store.get([]) == []
            # A gap anywhere ends the prefix there, whichever shard owns the gap.
            for gap in (0, 1, 137, 299):
                probe = [*keys[:gap], b"gap".ljust(32, b"."), *keys[gap:]]
                assert await store.exists(probe) == gap

    run(body)


def test_exists_counts_the_prefix_across_shards_after_deletes() -> None:
    async def body() -> None:
        async with shards() as ss, ShardedKVStore([s.address for s in ss]) as store:
            keys = keys_(120)
            await store.put([(k, data_of(k, 64)) for k in keys])
            # Delete key 77 directly on its shard: the prefix stops there even though other shards
            # hold every later key.
            owner = next(s for s in ss if s.address == store.shard_of(keys[77]))
            owner.servicer.backend.delete_many([keys[77]])
            assert await store.exists(keys) == 77
            assert await store.exists(keys[:77]) == 77
            assert await store.exists(keys[78:]) == 42
            # Each key's presence, across shards and in request order, gaps included.
            probe = [keys[80], b"gap".ljust(32, b"."), keys[77], keys[3], keys[119]]
            assert await store.present(probe) == [True, False, False, True, True]
            assert await store.present([]) == []

    run(body)


def test_a_stopped_shard_reads_as_misses_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with shards() as ss, ShardedKVStore([s.address for s in ss], timeout_s=2, suspect_s=0) as store:
            keys = keys_(240)
            pages = [(k, data_of(k)) for k in keys]
            await store.put(pages)
            dead = ss[1]
            await dead.server.stop(0)
            owner = {k: store.shard_of(k) for k in keys}
            lost = [i for i, k in enumerate(keys) if owner[k] == dead.address]
            assert lost

            with caplog.at_level(logging.WARNING, logger="services.kvstore.sharded"):
                got = await store.get(keys)
                assert got == [None if i in lost else d for i, (_, d) in enumerate(pages)]
                assert await store.exists(keys) == lost[0]
                survivors = [k for k in keys if owner[k] != dead.address]
                assert await store.exists(survivors) == len(survivors)
                assert await store.present(keys) == [i not in lost for i in range(len(keys))]
                new = [(k, data_of(k)) for k in keys_(60, "new")]
                r = await store.put(new)
                skipped = sum(store.shard_of(k) == dead.address for k, _ in new)
                assert (r.stored, r.skipped) == (60 - skipped, skipped) and skipped
            warnings = [rec for rec in caplog.records if dead.address in rec.getMessage()]
            assert len(warnings) == 1  # one outage, one line, however many calls hit it

    run(body)


def test_a_suspect_shard_is_skipped_without_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[str] = []
    real_get = KVStoreClient.get

    async def counting_get(self: KVStoreClient, keys: Sequence[bytes]) -> list[bytes | None]:
        called.append(self.address)
        return await real_get(self, keys)

    monkeypatch.setattr(KVStoreClient, "get", counting_get)

    async def body() -> None:
        now = [0.0]

        def clock() -> float:
            return now[0]

        async with shards() as ss, ShardedKVStore([s.address for s in ss], suspect_s=5, clock=clock) as store:
            keys = keys_(90)
            await store.put([(k, data_of(k, 64)) for k in keys])
            dead = ss[0].address
            await ss[0].server.stop(0)
            assert store.suspects() == []
            await store.get(keys)
            assert store.suspects() == [dead] and called.count(dead) == 1
            await store.get(keys)  # suspect: not called at all, so a dead shard costs nothing
            assert called.count(dead) == 1 and len(called) == 3 + 2
            now[0] = 6.0  # suspicion lapses: it is tried again
            assert store.suspects() == []
            await store.get(keys)
            assert called.count(dead) == 2

    run(body)


def test_membership_from_etcd_discovery(etcd_endpoint: str) -> None:
    async def body() -> None:
        async with shards() as ss, AsyncExitStack() as stack:
            regs = []
            for i, s in enumerate(ss):
                reg = Registration(etcd_endpoint, ServiceRecord("kvstore", f"kv{i}", s.address), ttl_s=5)
                await reg.start()
                regs.append(reg)
                stack.push_async_callback(reg.stop)
            disc = Discovery(etcd_endpoint, "kvstore")
            await disc.start()
            stack.push_async_callback(disc.stop)
            await disc.wait_for(3, timeout=10)
            store = ShardedKVStore(disc)
            stack.push_async_callback(store.close)

            keys = keys_(150)
            before = {k: store.shard_of(k) for k in keys}
            assert set(before.values()) == {s.address for s in ss}
            assert (await store.put([(k, data_of(k, 64)) for k in keys])).stored == 150

            await regs[2].stop()  # the shard leaves: only its keys move, the others still hit
            for _ in range(100):
                if len(disc.members()) == 2:
                    break
                await asyncio.sleep(0.05)
            after = {k: store.shard_of(k) for k in keys}
            assert all(after[k] == before[k] for k in keys if before[k] != ss[2].address)
            assert all(after[k] != ss[2].address for k in keys)
            got = await store.get(keys)
            assert all((got[i] is not None) == (before[k] != ss[2].address) for i, k in enumerate(keys))

    run(body)
