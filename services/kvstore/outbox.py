"""The L3 tier as its readers see it: the kvstore shards, and the hand-over outboxes of workers.

Prefill/decode disaggregation hands a prompt's KV from the prefill worker to the decode worker by
page hash. Through the kvstore that is two transfers (the prefill worker puts each page to its
shard, the decode worker gets it from there). A worker started with ``--outbox-bytes N`` keeps
the pages and states its steps put to L3 in a bounded in-memory store of its own instead (an LRU
``MemoryBackend``: a put is a local copy, acknowledged at once), serves it with the kvstore's own
``KVStore`` service on its gRPC port, and registers it in etcd as kind ``outbox``. The decode
worker then gets each page straight from the prefill worker's memory: one transfer.

``L3Store`` is what the schedulers' L3 lookups and the workers' L3 ports read through: every
registered outbox is asked first (a page is on whichever worker computed it, so each outbox is
asked for every key: ``ShardedKVStore(ask_all=True)``), and the shards for what none holds. Puts
go to the shards. With no outbox registered it is the shards alone, at no extra cost. A dead or
slow outbox is a miss, as a dead shard is: the reader recomputes what it cannot load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.common.discovery import Discovery
from services.kvstore.sharded import ShardedKVStore, ShardedPutResult

OUTBOX_KIND = "outbox"  # etcd service kind of the workers' outboxes


class L3Store:
    """Reads ask the outboxes (when any is registered), then the shards for the misses; puts go to
    the shards. ``discoveries``: etcd watches this store starts and stops with itself."""

    def __init__(
        self, shards: ShardedKVStore, outboxes: ShardedKVStore | None = None, discoveries: Sequence[Discovery] = ()
    ) -> None:
        self.shards = shards
        self.outboxes = outboxes
        self._discoveries = list(discoveries)

    @classmethod
    def from_etcd(cls, endpoint: str, timeout_s: float = 5.0) -> L3Store:
        """The shards (kind ``kvstore``) and outboxes (kind ``outbox``) registered at ``endpoint``."""
        shards, outboxes = Discovery(endpoint, "kvstore"), Discovery(endpoint, OUTBOX_KIND)
        return cls(
            ShardedKVStore(shards, timeout_s=timeout_s),
            ShardedKVStore(outboxes, timeout_s=timeout_s, ask_all=True),
            (shards, outboxes),
        )

    async def start(self) -> None:
        for d in self._discoveries:
            await d.start()

    async def close(self) -> None:
        await self.shards.close()
        if self.outboxes is not None:
            await self.outboxes.close()
        for d in self._discoveries:
            await d.stop()

    def _asking_outboxes(self) -> bool:
        return self.outboxes is not None and self.outboxes.has_members()

    async def put(self, pages: Sequence[tuple[bytes, bytes]]) -> ShardedPutResult:
        return await self.shards.put(pages)

    async def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's data in order (None where no outbox and no shard has it)."""
        if not self._asking_outboxes():
            return await self.shards.get(keys)
        assert self.outboxes is not None
        out = await self.outboxes.get(keys)
        missing = [i for i, d in enumerate(out) if d is None]
        if missing:
            for i, d in zip(missing, await self.shards.get([keys[i] for i in missing]), strict=True):
                out[i] = d
        return out

    async def present(self, keys: Sequence[bytes]) -> list[bool]:
        if not self._asking_outboxes():
            return await self.shards.present(keys)
        assert self.outboxes is not None
        mine, theirs = await asyncio.gather(self.outboxes.present(keys), self.shards.present(keys))
        return [a or b for a, b in zip(mine, theirs, strict=True)]

    async def exists(self, keys: Sequence[bytes]) -> int:
        """How many keys, from the first, are held somewhere without a gap."""
        if not self._asking_outboxes():
            return await self.shards.exists(keys)
        flags = await self.present(keys)
        return next((i for i, f in enumerate(flags) if not f), len(flags))
