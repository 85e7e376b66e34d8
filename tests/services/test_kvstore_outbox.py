"""L3 as its readers see it (``services.kvstore.outbox.L3Store``) over real in-process kvstore
servers: two shards, and two "outboxes" (the kvstore service over a worker's own pages, here
plain kvstore servers). Reads ask every outbox first and the shards for the rest; a page is found
on whichever outbox holds it; a dead outbox is a miss, never an error; puts go to the shards."""

from __future__ import annotations

import asyncio

import pytest

from services.kvstore.outbox import L3Store
from services.kvstore.sharded import ShardedKVStore
from tests.services.test_kvstore_sharded import data_of, keys_, shards


def test_reads_ask_every_outbox_then_the_shards() -> None:
    async def go() -> None:
        async with shards(2) as ss, shards(2) as boxes:
            store = L3Store(
                ShardedKVStore([s.address for s in ss]),
                ShardedKVStore([b.address for b in boxes], ask_all=True),
            )
            keys = keys_(12)
            # Pages 0-3 on the first outbox, 4-7 on the second (each worker holds what it computed),
            # 8-9 only in the shards, 10-11 nowhere.
            boxes[0].servicer.backend.put_many([(k, data_of(k)) for k in keys[:4]])
            boxes[1].servicer.backend.put_many([(k, data_of(k)) for k in keys[4:8]])
            result = await store.put([(k, data_of(k)) for k in keys[8:10]])
            assert result.stored == 2
            assert all(b.servicer.backend.stats().pages == 4 for b in boxes)  # puts never reach an outbox
            got = await store.get(keys)
            assert got == [data_of(k) for k in keys[:10]] + [None, None]
            assert await store.exists(keys) == 10
            assert await store.present(keys) == [True] * 10 + [False] * 2
            assert await store.exists([keys[10], *keys[:4]]) == 0
            # The shards were asked only for what no outbox held.
            assert sum(s.servicer.backend.stats().hits for s in ss) == 2
            assert sum(s.servicer.backend.stats().misses for s in ss) == 2
            await store.close()

    asyncio.run(go())


def test_a_dead_outbox_is_a_miss_and_the_shards_still_answer() -> None:
    async def go() -> None:
        async with shards(1) as ss, shards(2) as boxes:
            store = L3Store(
                ShardedKVStore([s.address for s in ss]),
                ShardedKVStore([b.address for b in boxes], timeout_s=2, ask_all=True),
            )
            keys = keys_(6)
            boxes[0].servicer.backend.put_many([(k, data_of(k)) for k in keys[:3]])
            boxes[1].servicer.backend.put_many([(k, data_of(k)) for k in keys[3:]])
            await store.put([(k, data_of(k)) for k in keys[:2]])
            await boxes[0].server.stop(0)  # the prefill worker that held pages 0-2 died
            assert await store.get(keys) == [data_of(keys[0]), data_of(keys[1]), None, *map(data_of, keys[3:])]
            assert await store.exists(keys) == 2
            await store.close()

    asyncio.run(go())


def test_without_outboxes_it_is_the_shards_alone() -> None:
    async def go() -> None:
        async with shards(2) as ss:
            store = L3Store(ShardedKVStore([s.address for s in ss]), ShardedKVStore([], ask_all=True))
            keys = keys_(5)
            await store.put([(k, data_of(k)) for k in keys[:3]])
            assert await store.get(keys) == [*map(data_of, keys[:3]), None, None]
            assert await store.exists(keys) == 3
            await store.close()

    asyncio.run(go())


def test_a_store_that_asks_every_member_refuses_puts() -> None:
    async def go() -> None:
        store = ShardedKVStore(["127.0.0.1:1"], ask_all=True)
        with pytest.raises(TypeError, match="only reads"):
            await store.put([(keys_(1)[0], b"x")])
        await store.close()

    asyncio.run(go())
