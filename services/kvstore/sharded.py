"""A kvstore spread over shards: each key lives on one shard chosen by rendezvous hashing.

Placement: a key goes to the shard with the highest weight ``H(address ‖ key)`` among the current
members (highest-random-weight hashing). When a shard leaves, only its keys move (each to its
second choice); when one joins, it takes only keys it now wins. No table, no coordination: every
client with the same membership places every key the same way.

Failure model: the L3 tier is a cache, so a shard that is down, slow past the deadline or missing is
a miss, never an error. A shard whose call fails with ``KVStoreUnavailable`` is *suspect* for
``suspect_s``: calls skip it (its keys read as missing, puts to it are dropped) instead of paying a
deadline each time, and it is logged once per outage. Suspicion does not move keys — only a
membership change does (an etcd ``Discovery`` drops a dead shard when its lease expires), so a shard
that blips keeps its pages. Other refusals (``KVStoreError``: an oversize page, a bad key) are the
caller's bug and propagate.

Bounds: at most ``max_concurrency`` RPCs in flight across all calls of one instance; each RPC
streams messages of at most ``batch_bytes`` (``KVStoreClient``), so a large put or get never builds
one giant message.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, TypeVar

from services.kvstore.client import DEFAULT_BATCH_BYTES, KVStoreClient, KVStoreUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")


class _HasAddress(Protocol):
    @property
    def address(self) -> str: ...


class MembershipSource(Protocol):
    """What ``ShardedKVStore`` needs of discovery: ``services.common.discovery.Discovery`` fits."""

    def members(self) -> Mapping[str, _HasAddress]: ...


def _weight_base(address: str) -> hashlib.blake2b:
    # blake2b keyed by (a digest of) the address; per key we .copy() this and feed the key, so
    # keying costs nothing per key. 64-bit weights: ties are astronomically unlikely.
    return hashlib.blake2b(key=hashlib.sha256(address.encode()).digest(), digest_size=8)


def rendezvous_owner(key: bytes, addresses: Sequence[str]) -> str:
    """The shard that owns ``key`` among ``addresses`` (non-empty). Pure; order-independent."""
    if not addresses:
        raise ValueError("no shards to place a key on")
    return _Placement(addresses).owner(key)


class _Placement:
    """Rendezvous placement over a fixed set of addresses."""

    __slots__ = ("_bases",)

    def __init__(self, addresses: Sequence[str]) -> None:
        # Sorted, so a tie breaks the same way in every client.
        self._bases = [(a, _weight_base(a)) for a in sorted(set(addresses))]

    def owner(self, key: bytes) -> str:
        best, best_w = "", -1
        for address, base in self._bases:
            h = base.copy()
            h.update(key)
            w = int.from_bytes(h.digest(), "little")
            if w > best_w:
                best, best_w = address, w
        return best


@dataclass(frozen=True, slots=True)
class ShardedPutResult:
    """``stored`` pages written, ``evicted`` pages the shards dropped to make room, ``skipped``
    pages not written because their shard was down or suspect."""

    stored: int
    evicted: int
    skipped: int


class _StaticMembers:
    __slots__ = ("_members",)

    def __init__(self, addresses: Sequence[str]) -> None:
        self._members = {a: _Static(a) for a in addresses}

    def members(self) -> Mapping[str, _HasAddress]:
        return self._members


@dataclass(frozen=True, slots=True)
class _Static:
    address: str


class ShardedKVStore:
    """Put / get / exists over the live kvstore shards. Use ``async with`` or call ``close``.

    ``shards`` is a membership source (an etcd ``Discovery`` the caller starts and stops) or a
    fixed list of addresses. Key order is preserved in every result.

    ``ask_all``: every key is asked of every member instead of its one owner, and a key is found
    where any member holds it (the hand-over outboxes of ``services.kvstore.outbox``: a page is on
    whichever worker computed it). Such a store only reads; ``put`` is refused.
    """

    def __init__(
        self,
        shards: MembershipSource | Sequence[str],
        *,
        max_concurrency: int = 16,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        timeout_s: float = 5.0,
        suspect_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        ask_all: bool = False,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if timeout_s <= 0 or suspect_s < 0:
            raise ValueError(f"need timeout_s > 0 and suspect_s >= 0, got {timeout_s}, {suspect_s}")
        if isinstance(shards, str):
            raise TypeError("shards must be a list of addresses or a membership source, not one string")
        self._source: MembershipSource = (
            _StaticMembers(list(shards)) if isinstance(shards, Sequence) else shards
        )
        self._batch_bytes = batch_bytes
        self._timeout_s = timeout_s
        self._suspect_s = suspect_s
        self._clock = clock
        self._ask_all = ask_all
        self._sem = asyncio.Semaphore(max_concurrency)
        self._clients: dict[str, KVStoreClient] = {}
        self._placement: tuple[frozenset[str], _Placement] | None = None
        self._suspect_until: dict[str, float] = {}
        self._down: set[str] = set()  # shards in an outage already logged
        self._retiring: set[asyncio.Task[None]] = set()

    # --- public API ---------------------------------------------------------------------------

    def shard_of(self, key: bytes) -> str | None:
        """The address that owns ``key`` under the current membership; None with no shards."""
        placement = self._current_placement()
        return placement.owner(key) if placement else None

    def has_members(self) -> bool:
        """Whether any member is known (suspect ones included)."""
        return bool(self._source.members())

    def suspects(self) -> list[str]:
        """Shards currently skipped after a failed call."""
        now = self._clock()
        return sorted(a for a, until in self._suspect_until.items() if until > now)

    async def put(self, pages: Sequence[tuple[bytes, bytes]]) -> ShardedPutResult:
        """Store pages on their shards (in parallel); pages for a down shard are skipped."""
        if self._ask_all:
            raise TypeError("a store that asks every member (ask_all) only reads")
        groups = self._group([k for k, _ in pages])

        async def one(address: str, idx: list[int]) -> tuple[int, int]:
            r = await self._client(address).put([pages[i] for i in idx])
            return r.stored, r.evicted

        results = await self._fan_out(groups, one)
        stored = evicted = skipped = 0
        for (_, idx), r in zip(groups.items(), results, strict=True):
            if r is None:
                skipped += len(idx)
            else:
                stored, evicted = stored + r[0], evicted + r[1]
        return ShardedPutResult(stored, evicted, skipped)

    async def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's data in order; None where missing or where its shard is down."""
        out: list[bytes | None] = [None] * len(keys)
        groups = self._group(keys)

        async def one(address: str, idx: list[int]) -> list[bytes | None]:
            return await self._client(address).get([keys[i] for i in idx])

        for (_, idx), data in zip(groups.items(), await self._fan_out(groups, one), strict=True):
            if data is not None:
                for i, d in zip(idx, data, strict=True):
                    if d is not None:
                        out[i] = d
        return out

    async def exists(self, keys: Sequence[bytes]) -> int:
        """How many keys, from the first, are stored without a gap (a down shard's keys are gaps).

        One Exists per shard, in parallel: a shard answering ``c`` for its subsequence of keys has
        its first gap at its ``c``-th key, and the whole prefix ends at the earliest such gap.
        """
        if self._ask_all:
            flags = await self.present(keys)
            return next((i for i, f in enumerate(flags) if not f), len(flags))
        groups = self._group(keys)

        async def one(address: str, idx: list[int]) -> int:
            return await self._client(address).exists([keys[i] for i in idx])

        prefix = len(keys)
        for (_, idx), count in zip(groups.items(), await self._fan_out(groups, one), strict=True):
            c = 0 if count is None else count
            if c < len(idx):
                prefix = min(prefix, idx[c])
        return prefix

    async def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (a down shard's keys are absent). One Exists per shard."""
        groups = self._group(keys)

        async def one(address: str, idx: list[int]) -> list[bool]:
            return await self._client(address).present([keys[i] for i in idx])

        out = [False] * len(keys)
        for (_, idx), flags in zip(groups.items(), await self._fan_out(groups, one), strict=True):
            if flags is not None:
                for i, f in zip(idx, flags, strict=True):
                    out[i] = out[i] or f
        return out

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

    async def __aenter__(self) -> ShardedKVStore:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- internals ----------------------------------------------------------------------------

    def _current_placement(self) -> _Placement | None:
        addresses = frozenset(r.address for r in self._source.members().values())
        if self._placement is None or self._placement[0] != addresses:
            self._placement = (addresses, _Placement(sorted(addresses)))
        return self._placement[1] if addresses else None

    def _group(self, keys: Sequence[bytes]) -> dict[str, list[int]]:
        """Key positions per owning shard, ascending within each shard."""
        placement = self._current_placement()
        assert self._placement is not None
        if stale := set(self._clients) - self._placement[0]:
            self._retire(stale)
        groups: dict[str, list[int]] = {}
        if placement is None:
            return groups
        if self._ask_all:
            every = list(range(len(keys)))
            return {a: every for a in self._placement[0]} if keys else {}
        for i, key in enumerate(keys):
            groups.setdefault(placement.owner(key), []).append(i)
        return groups

    def _client(self, address: str) -> KVStoreClient:
        client = self._clients.get(address)
        if client is None:
            client = KVStoreClient(address, batch_bytes=self._batch_bytes, timeout_s=self._timeout_s)
            self._clients[address] = client
        return client

    def _retire(self, addresses: set[str]) -> None:
        """Close the channels of shards that left, after calls already on them had their deadline."""
        for address in addresses:
            client = self._clients.pop(address)
            self._suspect_until.pop(address, None)
            self._down.discard(address)
            task = asyncio.get_running_loop().create_task(self._close_later(client))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _close_later(self, client: KVStoreClient) -> None:
        try:
            await asyncio.sleep(self._timeout_s)
        finally:
            await client.close()

    async def _fan_out(
        self, groups: dict[str, list[int]], call: Callable[[str, list[int]], Awaitable[T]]
    ) -> list[T | None]:
        """``call`` for each shard's group in parallel; None for a shard that is suspect or fails
        as unavailable."""
        return list(await asyncio.gather(*(self._guarded(a, idx, call) for a, idx in groups.items())))

    async def _guarded(
        self, address: str, idx: list[int], call: Callable[[str, list[int]], Awaitable[T]]
    ) -> T | None:
        if self._suspect_until.get(address, 0.0) > self._clock():
            return None
        try:
            async with self._sem:
                result = await call(address, idx)
        except KVStoreUnavailable as exc:
            self._suspect_until[address] = self._clock() + self._suspect_s
            if address not in self._down:
                self._down.add(address)
                log.warning("kvstore shard %s unavailable, its keys read as misses: %s", address, exc)
            return None
        if address in self._down:
            self._down.discard(address)
            log.info("kvstore shard %s reachable again", address)
        return result
