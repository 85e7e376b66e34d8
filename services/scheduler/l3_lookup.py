"""Asking the shared store (L3) how much of a prompt it holds, at admission.

The prompt's whole pages are hashed with the chained page hash (namespaced by model fingerprint,
KV layout and cache salt) and the kvstore shards are asked for the leading run of present pages.
A slow, missing or dead store is a miss, never an error: the lookup is bounded by a short timeout.
Loading pages back from L3 is the hierarchical cache's job; today the figure is recorded on the
request's span and in metrics (and nothing writes L3 pages yet, so it is 0).
"""

from __future__ import annotations

import asyncio
import logging

from services.common import telemetry
from services.common.discovery import Discovery
from services.common.page_hash import HashNamespace, page_hashes
from services.common.step import WorkerInfo
from services.kvstore.sharded import ShardedKVStore

log = logging.getLogger(__name__)

L3_PAGE_TOKENS = 64  # tokens per L3 page: big enough that one request asks for few keys
LOOKUP_TIMEOUT_S = 0.05


class L3Lookup:
    def __init__(self, etcd: str) -> None:
        self._discovery = Discovery(etcd, "kvstore")
        self._store = ShardedKVStore(self._discovery)
        self._tracer = telemetry.get_tracer("strata.scheduler")

    async def start(self) -> None:
        await self._discovery.start()

    async def close(self) -> None:
        await self._store.close()
        await self._discovery.stop()

    async def leading_pages(self, ids: list[int], salt: str, info: WorkerInfo) -> int:
        """Pages of ``ids``, from the first, present in L3 (0 on any failure or timeout)."""
        layout = f"kv/{info.architecture}/{info.dtype}/{info.bytes_per_slot}B/P{L3_PAGE_TOKENS}"
        keys = page_hashes(ids, L3_PAGE_TOKENS, HashNamespace(info.fingerprint, layout, cache_salt=salt))
        if not keys:
            return 0
        with self._tracer.start_as_current_span("scheduler.l3_lookup") as span:
            try:
                hits = await asyncio.wait_for(self._store.exists(keys), LOOKUP_TIMEOUT_S)
            except Exception as e:  # a slow or broken store is a miss
                log.debug("L3 lookup failed: %r", e)
                hits = 0
            span.set_attribute("strata.l3_pages", hits)
            span.set_attribute("strata.pages", len(keys))
            return hits
