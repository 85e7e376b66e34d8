"""Types of the hierarchical radix cache (`hiradix.py`): its node, what a match returns, and the
jobs it hands out for the caller to turn into step ops.

A job asks the caller to move bytes between tiers; the caller acknowledges it exactly once. The
fields a caller reads are tuples, so nothing the caller does to them can change what the cache
later frees; `nodes` (and `pins`, `anchor`) are the cache's own, and are dropped on
acknowledgement, so a job the caller keeps around pins no part of the tree.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from services.scheduler.cache.base import CacheHandle, MatchResult

Residency = Literal["device", "host", "both"]


class HiNode(CacheHandle):
    """One edge of whole pages. `value`: device slots (None when not on the device); `host`: host
    pages, one per page (None until a backup is acknowledged); `hashes`: the chained page hashes
    (the L3 keys); `l3`: a put of its pages was acknowledged. A node always has `value` or `host`.

    `lock_ref` counts request locks at or below the node (they protect device slots); `host_ref`
    counts transfer pins at or below it (they keep the node, and its host pages, in the tree).
    """

    __slots__ = (
        "backup",
        "children",
        "evicted",
        "extra",
        "hashes",
        "hits",
        "host",
        "host_ref",
        "key",
        "l3",
        "last_access",
        "load",
        "lock_ref",
        "parent",
        "put",
        "serial",
        "value",
    )

    def __init__(self, key: array[int], parent: HiNode | None, extra: str, hashes: list[bytes]) -> None:
        self.children: dict[int | bytes, HiNode] = {}
        self.parent = parent
        self.key = key
        self.extra = extra
        self.hashes = hashes
        self.value: list[int] | None = None
        self.host: list[int] | None = None
        self.l3 = False
        self.lock_ref = 0
        self.host_ref = 0
        self.backup: BackupJob | None = None
        self.load: LoadJob | None = None
        self.put: PutJob | None = None
        self.last_access = 0
        self.hits = 0
        self.serial = 0
        self.evicted = False

    @property
    def on_device(self) -> bool:
        """Its device slots hold its KV now (a node being loaded has slots but not yet the bytes)."""
        return self.value is not None and self.load is None

    @property
    def residency(self) -> Residency:
        if self.on_device:
            return "both" if self.host is not None else "device"
        return "host"


class HiMatch(NamedTuple):
    """A match split by tier: `slots` (owned list) is the device-resident prefix ending at `node`;
    after it come `host_len` tokens held only on the host, in `host_pages` (owned list, one per
    page), ending at `host_node` (== `node` when `host_len` is 0). Lock `node` before any call
    that may evict; pass the match to `start_load` to bring the host part back."""

    slots: list[int]
    node: CacheHandle
    host_len: int
    host_pages: list[int]
    host_node: CacheHandle

    @property
    def length(self) -> int:
        return len(self.slots)

    @property
    def local_len(self) -> int:
        """Tokens held locally, device and host: where an L3 lookup starts."""
        return len(self.slots) + self.host_len

    def as_result(self) -> MatchResult:
        return MatchResult(self.slots, self.node)


class Eviction(NamedTuple):
    """`freed` units (device slots or host pages) released now, and `pending` more that jobs in
    the outbox will release when acknowledged (a write-back eviction backs up before it frees)."""

    freed: int
    pending: int


@dataclass(slots=True, eq=False)
class BackupJob:
    """Copy device `slots` (token order, whole pages) to `host_pages`: page j ← slots[j*P:(j+1)*P].
    Until acknowledged the slots are pinned and the pages are not yet host-resident."""

    job_id: int
    slots: tuple[int, ...]
    host_pages: tuple[int, ...]
    evict_after: bool
    nodes: list[HiNode] = field(default_factory=list, repr=False)


@dataclass(slots=True, eq=False)
class LoadJob:
    """Copy `host_pages` to device `slots` (the layout of BackupJob, reversed). The slots were the
    caller's and are the cache's from `start_load` on; lock `node` after `load_done`."""

    job_id: int
    host_pages: tuple[int, ...]
    slots: tuple[int, ...]
    node: CacheHandle
    nodes: list[HiNode] = field(default_factory=list, repr=False)


@dataclass(slots=True, eq=False)
class PutJob:
    """Write `host_pages[j]` to the kvstore under `hashes[j]`. The pages are pinned until acked."""

    job_id: int
    hashes: tuple[bytes, ...]
    host_pages: tuple[int, ...]
    evict_after: bool
    nodes: list[HiNode] = field(default_factory=list, repr=False)
    pins: list[HiNode] = field(default_factory=list, repr=False)


@dataclass(slots=True, eq=False)
class PrefetchJob:
    """Read `hashes[j]` from the kvstore into `host_pages[j]`, stopping at the first miss; the
    pages continue key `extra`'s tokens from `start` (they are `tokens`). Acknowledge with the
    number of leading pages written."""

    job_id: int
    extra: str
    start: int
    tokens: tuple[int, ...]
    hashes: tuple[bytes, ...]
    host_pages: tuple[int, ...]
    anchor: HiNode | None = field(default=None, repr=False)
    pins: list[HiNode] = field(default_factory=list, repr=False)


Job = BackupJob | LoadJob | PutJob | PrefetchJob
