"""Asking the shared store (L3) how much of a prompt it holds, at admission.

The prompt's whole pages are hashed with the chained page hash (namespaced by model fingerprint,
KV layout and cache salt) and the kvstore shards are asked for the leading run of present pages.
A slow, missing or dead store is a miss, never an error: the lookup is bounded by a short timeout.
The workers' hand-over outboxes count as L3 too (``services.kvstore.outbox.L3Store``).
The keys are the hierarchical cache's (``WorkerInfo.kv_layout`` and ``host_page_tokens``): the
figure becomes ``Req.mem.l3_pages``, from which admission decides whether to prefetch
(``Memory.hold``, ``memory/host.py``). A hybrid model's prefix is usable only up to a stored Mamba state,
so for it the pages and the state keys after each page are asked together (one ``Exists`` with
per-key answers per shard) and the hit is the deepest state with every page before it
(``usable_pages``). A worker without L3 gets no lookup.
"""

from __future__ import annotations

import asyncio
import logging

from services.common import telemetry
from services.common.page_hash import HashNamespace, page_hashes, state_key
from services.common.step import WorkerInfo
from services.kvstore.outbox import L3Store
from services.kvstore.sharded import ShardedKVStore

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 0.05


class L3Lookup:
    def __init__(self, etcd: str, timeout_s: float = LOOKUP_TIMEOUT_S) -> None:
        self._timeout_s = timeout_s
        self._store = L3Store.from_etcd(etcd)
        self._tracer = telemetry.get_tracer("strata.scheduler")

    async def start(self) -> None:
        await self._store.start()

    async def close(self) -> None:
        await self._store.close()

    async def leading_pages(self, ids: list[int], salt: str, info: WorkerInfo) -> int:
        """Pages of ``ids``, from the first, present in L3 (0 on any failure or timeout, and 0
        when the worker does not use L3)."""
        with self._tracer.start_as_current_span("scheduler.l3_lookup") as span:
            hits = await leading_pages(self._store, ids, salt, info, self._timeout_s)
            span.set_attribute("strata.l3_pages", hits)
            return hits


async def leading_pages(
    store: ShardedKVStore | L3Store, ids: list[int], salt: str, info: WorkerInfo, timeout_s: float = LOOKUP_TIMEOUT_S
) -> int:
    """The lookup itself: hash ``ids``' whole pages as the worker's hierarchical cache keys them
    and ask the shards for the leading run present (0 on a slow or broken store)."""
    if not info.l3:
        return 0
    if info.state_layout:  # a hybrid prompt is matched without its last token: no state after it
        ids = ids[:-1]
    ns = HashNamespace(info.fingerprint, info.kv_layout, cache_salt=salt)
    keys = page_hashes(ids, info.host_page_tokens, ns)
    if not keys:
        return 0
    try:
        if not info.state_layout:
            return await asyncio.wait_for(store.exists(keys), timeout_s)
        skeys = [state_key(k, info.state_layout) for k in keys]
        flags = await asyncio.wait_for(store.present(keys + skeys), timeout_s)
    except Exception as e:  # a slow or broken store is a miss
        log.debug("L3 lookup failed: %r", e)
        return 0
    return usable_pages(flags[: len(keys)], flags[len(keys) :])


def usable_pages(pages: list[bool], states: list[bool]) -> int:
    """A hybrid model's L3 hit, in pages: the deepest page ``q`` with the state after it stored
    (``states[q - 1]``) and every page up to it (0 when none)."""
    lead = next((i for i, f in enumerate(pages) if not f), len(pages))
    return next((q for q in range(lead, 0, -1) if states[q - 1]), 0)
