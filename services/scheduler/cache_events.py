"""What the prefix cache holds, as page keys, for KV-aware routers (``Scheduler/WatchCache``).

The tree reports every insert and eviction with the whole key from its root (``CacheEvent``);
this turns them into the keys of the whole pages that appeared or went, chained SHA-256 over pages
of ``page_tokens`` (``services/common/page_hash.py``) seeded by the model fingerprint, a layout and
the cache salt, so a router computes the same keys from a prompt without asking. With a host
tier the pages are the host pages and the keys are the L3 keys, and the host pool reports its pages
too: a page counts as cached while the device tree or the host pool holds it (a host hit is a
copy, not a recomputation). The log keeps both sets (32 bytes and a set entry per page), so a
snapshot is a copy, not a walk.

Batches get consecutive ids. Each subscriber has a bounded queue: one that falls more than
``QUEUE_BATCHES`` behind loses its queue and is sent a fresh snapshot instead (never an unbounded
backlog). A snapshot is taken when it is sent, so it is exact at its id. When the scheduler
attaches another worker (a new, empty cache) every subscriber gets a snapshot too.

All of it runs on the scheduler's event loop (the tree's only caller); the hashing costs one
SHA-256 per page changed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from services.common.page_hash import PageKeying
from services.scheduler.memory.base import CacheEvent

QUEUE_BATCHES = 256  # batches a subscriber may fall behind before it is sent a snapshot instead
ROUTE_PAGE_TOKENS = 16  # page size of the keys when the worker has no host tier (no L3 keys to share)


@dataclass(frozen=True, slots=True)
class Batch:
    event_id: int
    stored: list[bytes]
    removed: list[bytes]
    snapshot: bool = False


@dataclass(slots=True, eq=False)  # by identity: a set member
class Subscription:
    queue: deque[Batch] = field(default_factory=deque)
    needs_snapshot: bool = True  # the first thing a subscriber gets
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class CacheEventLog:
    """Keeps the set of cached page keys (device tree and host pool) and fans changes out."""

    def __init__(self, queue_batches: int = QUEUE_BATCHES) -> None:
        self.epoch = time.time_ns()
        self.event_id = 0
        self.keying: PageKeying | None = None
        self._queue_batches = queue_batches
        self._device: set[bytes] = set()  # whole pages in the device tree
        self._host: set[bytes] = set()  # pages in the host pool
        self._stored: list[bytes] = []
        self._removed: list[bytes] = []
        self._subs: set[Subscription] = set()
        self._flush_scheduled = False

    # -- the producing side -----------------------------------------------------------------------
    def attach(self, keying: PageKeying | None) -> None:
        """A new worker's (empty) cache, keyed by ``keying`` (None: no worker or no cache). Every
        subscriber gets a snapshot."""
        self.keying = keying
        self._device.clear()
        self._host.clear()
        self._stored.clear()
        self._removed.clear()
        for sub in self._subs:
            sub.queue.clear()
            sub.needs_snapshot = True
            sub.wake.set()

    def on_tree_event(self, ev: CacheEvent) -> None:
        """The device tree gained or lost the whole pages of ``ev`` that end after ``ev.start``."""
        k = self.keying
        if k is None:
            return
        for key in k.keys(ev.tokens, ev.extra)[ev.start // k.page_tokens :]:
            self._change(key, ev.kind == "insert", self._device, self._host)

    def on_host_page(self, key: bytes, added: bool) -> None:
        """The host pool gained or lost the page ``key`` (the same keys: host pages are the pages)."""
        if self.keying is not None:
            self._change(key, added, self._host, self._device)

    def _change(self, key: bytes, added: bool, here: set[bytes], other: set[bytes]) -> None:
        if added:
            if key in here:
                return
            here.add(key)
        else:
            if key not in here:
                return
            here.discard(key)
        if key in other or not self._subs:
            return  # still cached in the other tier (nothing a router sees changed), or nobody to tell
        (self._stored if added else self._removed).append(key)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what changed since the last flush as one batch (called soon after a change)."""
        self._flush_scheduled = False
        if not self._stored and not self._removed:
            return
        self.event_id += 1
        batch = Batch(self.event_id, self._stored, self._removed)
        self._stored, self._removed = [], []
        for sub in self._subs:
            if sub.needs_snapshot:
                continue  # the snapshot it waits for will include this
            if len(sub.queue) >= self._queue_batches:
                sub.queue.clear()
                sub.needs_snapshot = True
            else:
                sub.queue.append(batch)
            sub.wake.set()

    # -- the consuming side -----------------------------------------------------------------------
    def subscribe(self) -> Subscription:
        sub = Subscription()
        sub.wake.set()
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    @property
    def cached_pages(self) -> int:
        return len(self._device | self._host)

    def take(self, sub: Subscription) -> list[Batch]:
        """What ``sub`` should be sent now: a snapshot when it needs one, then its queued batches."""
        sub.wake.clear()
        out: list[Batch] = []
        if sub.needs_snapshot:
            self.flush()  # changes not yet sent belong before the snapshot's id
            sub.needs_snapshot = False
            sub.queue.clear()
            out.append(Batch(self.event_id, list(self._device | self._host), [], snapshot=True))
        out.extend(sub.queue)
        sub.queue.clear()
        return out


