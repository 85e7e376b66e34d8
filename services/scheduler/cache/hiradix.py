"""Hierarchical radix cache: one tree of token prefixes whose pages live on the device (L1), in the
worker's host pool (L2), or both; the kvstore (L3) is reached through jobs keyed by page hashes.

    roots[extra] ── [1 2 3 4] D+H ─┬─ [5 6 7 8] D ── [9 9 9 9] D       D: device slots
                                   └─ [6 6 6 6] H ── [7 7 7 7] H       H: host pages

Residency is per node (an edge of whole pages). Device residency is closed upwards: a node on
the device has every ancestor on the device, so a match is a device prefix followed by a host-only
continuation (`HiMatch`), and the host part is what a load-back brings to the device. A node keeps
its chained page hashes (computed once, at insert, from its parent's last hash), so L3 keys never
need the tokens before it.

The cache moves no bytes. It hands out jobs, and the caller turns them into step ops and
acknowledges each exactly once (a second acknowledgement raises DoubleAckError):

    insert ─▶ [D] ─(policy)─▶ BackupJob ─backup_done─▶ [D+H] ─evict──▶ [H] ─evict_host─▶ gone
                 device slots pinned ──┘  └─backup_failed─▶ [D]    (write_back: BackupJob first,
                 host pages not yet H      (pages freed)            then drop the device copy)
    match ─▶ HiMatch(host_len) ─start_load(slots)─▶ [H, loading] ─load_done─▶ [D+H]
                                                               └─load_failed─▶ [H] (slots freed)
    [H] ─(policy)─▶ PutJob ─put_done─▶ l3 = True          pages pinned until acked
    l3 hit ─start_prefetch─▶ PrefetchJob ─prefetch_done(n)─▶ n pages become [H] (l3), rest freed

Write policies (`hiradix_policy`) decide when backups and puts are made: `write_through` at insert
(at backup_done for L3), `write_through_selective` on a node's second hit, `write_back` on eviction
from the tier above. Jobs made as a side effect (insert, match, evict) wait in an outbox that
`take_jobs` empties. Backups, puts and prefetches in flight are bounded by `max_inflight_jobs`:
beyond it a new one is refused (a refused eviction backup evicts outright, a refused write-through
backup stays queued on its node), so memory never grows with a slow tier. Load jobs are bounded by
the device slots the caller gives them instead.

Accounting, checked by `sanity_check`: device `free + evictable_size + protected_size == size`
(protected: locked, being backed up or being loaded), and host `available + host_evictable_size +
host_protected_size == num_pages` (host-evictable: host-only nodes with no pin at or below them).
Every list the tree keeps is its own copy; jobs carry tuples.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Sequence

from services.common.page_hash import HashNamespace, extend_hashes
from services.scheduler.cache.base import CacheHandle, CacheKey, FreeSlots, MatchResult, PrefixCache
from services.scheduler.cache.hiradix_check import check_tree
from services.scheduler.cache.hiradix_policy import WRITE_POLICIES, DoubleAckError, HostAllocator, WritePolicy
from services.scheduler.cache.hiradix_tree import EvictionPolicy, HiTree
from services.scheduler.cache.hiradix_types import (
    BackupJob,
    Eviction,
    HiMatch,
    HiNode,
    Job,
    LoadJob,
    PrefetchJob,
    PutJob,
    Residency,
)
from services.scheduler.cache.tree_util import as_array, child_key

__all__ = ["EvictionPolicy", "HiRadixCache"]


class HiRadixCache(PrefixCache):
    """See PrefixCache and the module docstring. Differences from RadixCache's contract:
    `evict` returns the device slots freed now; under write_back it also queues backups, whose
    slots `backup_done` frees (`evict_device` reports both). `lock` takes a device-resident handle,
    and locking a node that is being backed up does not change `protected_size`."""

    def __init__(
        self,
        page_size: int,
        free_slots: FreeSlots,
        host: HostAllocator,
        namespace: HashNamespace,
        *,
        write_policy: WritePolicy = "write_through_selective",
        eviction: EvictionPolicy = "lru",
        l3: bool = False,
        max_inflight_jobs: int = 64,
    ) -> None:
        super().__init__(page_size, free_slots)
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}")
        if eviction not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {eviction!r}")
        if max_inflight_jobs < 1:
            raise ValueError(f"max_inflight_jobs must be >= 1, got {max_inflight_jobs}")
        if namespace.cache_salt:
            raise ValueError("namespace.cache_salt must be empty: each extra key salts its own chain")
        self.write_policy: WritePolicy = write_policy
        self.l3_enabled = l3
        self.max_inflight_jobs = max_inflight_jobs
        self.refused_jobs = 0  # backups / puts / prefetches refused by back-pressure, for metrics
        self._host = host
        self._t = HiTree(page_size, namespace, eviction)
        self._jobs: dict[int, Job] = {}
        self._job_ids = itertools.count(1)
        self._limited = 0  # backup + put + prefetch jobs in flight
        self._job_pages = 0  # host pages held by backup and prefetch jobs (not yet on a node)
        self._outbox: list[BackupJob | PutJob] = []

    # -- queries --------------------------------------------------------------------------------

    def match_prefix(self, key: CacheKey) -> MatchResult:
        return self.match(key).as_result()

    def match(self, key: CacheKey, *, touch: bool = True) -> HiMatch:
        """The device prefix and its host-only continuation. Refreshes access statistics and queues
        the writes the policy wants for the nodes passed (write_through_selective: second hits);
        ``touch=False`` only looks (no hit is counted, no write queued)."""
        t, ps = self._t, self.page_size
        root = t.roots.get(key.extra)
        if root is None or len(key.tokens) < ps:
            miss = t.detached_root if root is None else root
            return HiMatch([], miss, 0, [], miss)
        if child_key(as_array(key.tokens[:ps]), 0, ps) not in root.children:
            return HiMatch([], root, 0, [], root)
        tokens = as_array(key.tokens)
        path = t.walk(root, tokens, self.aligned_len(len(tokens)), hit=touch)
        slots: list[int] = []
        host_pages: list[int] = []
        node = host_node = root
        host_len = 0
        for cur in path:
            if cur.on_device and host_node is node:
                assert cur.value is not None
                slots.extend(cur.value)
                node = host_node = cur
            elif cur.value is None and cur.host is not None:
                host_pages.extend(cur.host)
                host_len += len(cur.key)
                host_node = cur
            else:
                break  # being loaded: neither usable on the device nor loadable again
        if touch and self.write_policy != "write_back":
            for cur in path:
                self._queue_writes(cur)
        return HiMatch(slots, node, host_len, host_pages, host_node)

    def l3_keys(self, key: CacheKey, match: HiMatch) -> list[bytes]:
        """Page hashes of `key`'s whole pages after the local match: what to ask L3 about."""
        tokens = as_array(key.tokens)
        start, end = match.local_len, self.aligned_len(len(tokens))
        last = self._t.last_hash(self._node(match.host_node), key.extra)
        return extend_hashes(last, tokens[start:end], self.page_size)

    def residency(self, handle: CacheHandle) -> Residency:
        return self._node(handle).residency

    @property
    def evictable_size(self) -> int:
        return self._t.dev_evictable

    @property
    def protected_size(self) -> int:
        return self._t.dev_protected

    @property
    def host_evictable_size(self) -> int:
        return self._t.host_evictable

    @property
    def host_protected_size(self) -> int:
        """Host pages held and not evictable now: also on the device, pinned, or in a job."""
        return self._t.host_protected + self._job_pages

    @property
    def outbox_jobs(self) -> int:
        """Jobs made (by evictions) that `take_jobs` has not handed out yet."""
        return len(self._outbox)

    @property
    def queued_writes(self) -> int:
        """Nodes whose backup or put the write policy wants and `take_jobs` has not issued yet."""
        return len(self._t.want_backup) + len(self._t.want_put)

    @property
    def inflight_jobs(self) -> int:
        """Backup, put and prefetch jobs not yet acknowledged (what `max_inflight_jobs` bounds)."""
        return self._limited

    # -- device tier ----------------------------------------------------------------------------

    def insert(self, key: CacheKey, slots: Sequence[int]) -> int:
        """PrefixCache.insert. A host-only node on the path adopts the request's slots (it becomes
        device + host) and `cached` stops before it; the tree frees the slots of pages it cannot
        take (those under a node being loaded)."""
        tokens = as_array(key.tokens)
        if len(slots) != len(tokens):
            raise ValueError(f"insert: {len(slots)} slots for {len(tokens)} tokens")
        n = self.aligned_len(len(tokens))
        if n == 0:
            return 0
        t = self._t
        root = t.root(key.extra)
        path = t.walk(root, tokens, n, hit=False)
        pos, cached = 0, -1
        for node in path:
            if not node.on_device:
                cached = pos if cached < 0 else cached
                if node.load is not None:
                    self._free_slots(list(slots[pos:n]))
                    return cached
                t.set(node, value=list(slots[pos : pos + len(node.key)]))
                self._queue_writes(node)
            pos += len(node.key)
        cached = pos if cached < 0 else cached
        if pos < n:
            parent = path[-1] if path else root
            hashes = extend_hashes(t.last_hash(parent, key.extra), tokens[pos:n], self.page_size)
            self._queue_writes(t.add_child(parent, tokens[pos:n], hashes, value=list(slots[pos:n]), host=None))
        return cached

    def lock(self, node: CacheHandle) -> None:
        cur = self._node(node)
        if cur.parent is not None and not cur.on_device:
            raise ValueError("lock: the handle is not device-resident (load it back first)")
        self._t.add_path(cur, lock=1)

    def unlock(self, node: CacheHandle) -> None:
        cur = self._node(node)
        if cur.parent is not None and cur.lock_ref == 0:
            raise ValueError("unlock of a handle that is not locked")
        self._t.add_path(cur, lock=-1)

    def evict(self, n: int) -> int:
        return self.evict_device(n).freed

    def evict_device(self, n: int) -> Eviction:
        """Free about n device slots, least valuable unlocked device leaves first: a node on the host
        drops its device copy and stays; under write_back (or when host-only nodes hang below it)
        a node not on the host is backed up first (a BackupJob in the outbox; backup_done frees);
        otherwise, or when the host pool is full or back-pressure refuses, it leaves the tree."""
        if n <= 0:
            return Eviction(0, 0)
        t = self._t
        freed: list[int] = []
        pending = 0
        heap = t.heap(x for x in t.dev_nodes if t.device_leaf(x))
        while len(freed) + pending < n and heap:
            leaf = heapq.heappop(heap)[-1]
            parent = leaf.parent
            if not t.device_leaf(leaf):
                continue
            if leaf.host is not None:
                freed.extend(t.drop_device(leaf))
            elif (self.write_policy == "write_back" or leaf.children) and (
                job := self._start_backup(leaf, evict_after=True)
            ) is not None:
                self._outbox.append(job)
                pending += len(job.slots)
                continue
            elif leaf.host_ref == 0:
                freed.extend(self._drop_subtree(leaf))
            else:
                continue  # an L3 transfer below still needs the path
            if parent is not None and parent.parent is not None and t.device_leaf(parent):
                t.push(heap, parent)
        if freed:
            self._free_slots(freed)
        return Eviction(len(freed), pending)

    # -- host tier ------------------------------------------------------------------------------

    def evict_host(self, n: int) -> Eviction:
        """Free about n host pages from host-only leaves with nothing pinned (least valuable first);
        pages also on the device, being loaded, backed up or put are never touched. Under write_back
        with L3 on, a page not yet in L3 is put first (a PutJob; put_done frees)."""
        if n <= 0:
            return Eviction(0, 0)
        t = self._t
        freed: list[int] = []
        pending = 0
        heap = t.heap(x for x in t.host_only if t.host_leaf(x))
        while len(freed) + pending < n and heap:
            leaf = heapq.heappop(heap)[-1]
            if not t.host_leaf(leaf):
                continue
            if self.l3_enabled and self.write_policy == "write_back" and not leaf.l3:
                job = self._start_put(leaf, evict_after=True)
                if job is not None:
                    self._outbox.append(job)
                    pending += len(job.host_pages)
                    continue
            parent = leaf.parent
            freed.extend(t.drop_host_leaf(leaf))
            if parent is not None and parent.parent is not None and t.host_leaf(parent):
                t.push(heap, parent)
        if freed:
            self._host.free(freed)
        return Eviction(len(freed), pending)

    def take_jobs(self) -> list[BackupJob | PutJob]:
        """Jobs made since the last call (by evictions), plus backups and puts the write policy
        queued, as far as back-pressure and host room allow; the rest stay queued on their nodes."""
        t = self._t
        for node in list(t.want_backup):
            if not self._backup_eligible(node):  # (a host eviction above may have removed it already)
                t.want_backup.pop(node, None)
                continue
            job = self._start_backup(node, evict_after=False)
            if job is None:
                break  # at the in-flight limit, or the host is full of pages that cannot go yet
            del t.want_backup[node]
            self._outbox.append(job)
        for node in list(t.want_put):
            if not self._put_eligible(node):
                t.want_put.pop(node, None)
                continue
            put = self._start_put(node, evict_after=False)
            if put is None:
                break
            del t.want_put[node]
            self._outbox.append(put)
        out, self._outbox = self._outbox, []
        return out

    def backup_done(self, job: BackupJob) -> int:
        """The pages are on the host. Returns device slots freed (an eviction waiting on it)."""
        self._retire(job)
        self._job_pages -= len(job.host_pages)
        i = 0
        for node in job.nodes:
            k = len(node.key) // self.page_size
            self._t.set(node, host=list(job.host_pages[i : i + k]), backup=None)
            self._queue_writes(node)
            i += k
        freed: list[int] = []
        if job.evict_after:
            for node in reversed(job.nodes):
                if self._t.device_leaf(node):
                    freed.extend(self._t.drop_device(node))
        return self._finish(job, freed)

    def backup_failed(self, job: BackupJob) -> int:
        """The copy did not happen: the host pages go back. An eviction waiting on it evicts
        outright. Returns device slots freed."""
        self._retire(job)
        self._host.free(list(job.host_pages))
        self._job_pages -= len(job.host_pages)
        for node in job.nodes:
            self._t.set(node, backup=None)
        freed: list[int] = []
        if job.evict_after:
            for node in reversed(job.nodes):
                if self._t.device_leaf(node) and node.host_ref == 0:
                    freed.extend(self._drop_subtree(node))
        return self._finish(job, freed)

    def start_load(self, match: HiMatch, slots: Sequence[int]) -> LoadJob:
        """Plan the load-back of `match`'s host part into `slots` (allocated by the caller, one per
        token; they are the cache's from now on). Call right after `match`, like `lock`."""
        if match.host_len == 0:
            raise ValueError("start_load: the match has no host-resident part")
        if len(slots) != match.host_len:
            raise ValueError(f"start_load: {len(slots)} slots for {match.host_len} host tokens")
        top, cur = self._node(match.node), self._node(match.host_node)
        nodes: list[HiNode] = []
        while cur is not top:
            if cur.parent is None or cur.value is not None or cur.host is None:
                raise ValueError("start_load: stale match (the tree changed since match)")
            nodes.append(cur)
            cur = cur.parent
        nodes.reverse()
        if (top.parent is not None and not top.on_device) or sum(len(x.key) for x in nodes) != len(slots):
            raise ValueError("start_load: stale match (the tree changed since match)")
        own = list(slots)
        pages = tuple(p for x in nodes for p in (x.host or ()))
        job = LoadJob(next(self._job_ids), pages, tuple(own), nodes[-1], nodes)
        pos = 0
        for node in nodes:
            self._t.set(node, value=own[pos : pos + len(node.key)], load=job)
            pos += len(node.key)
        self._jobs[job.job_id] = job  # not counted in _limited: bounded by the caller's slots
        return job

    def load_done(self, job: LoadJob) -> None:
        """The bytes are on the device: the loaded nodes match (lock `job.node` to use them)."""
        self._retire(job)
        for node in job.nodes:
            self._t.set(node, load=None)
        self._finish(job, [])

    def load_failed(self, job: LoadJob) -> None:
        """The copy did not happen: the nodes stay host-only and their device slots are freed."""
        self._retire(job)
        freed: list[int] = []
        for node in job.nodes:
            freed.extend(node.value or ())
            self._t.set(node, value=None, load=None)
        self._finish(job, freed)

    # -- L3 -------------------------------------------------------------------------------------

    def put_done(self, job: PutJob) -> int:
        """The kvstore holds the pages. Returns host pages freed (a host eviction waiting on it)."""
        return self._end_put(job, ok=True)

    def put_failed(self, job: PutJob) -> int:
        """The put did not happen; a host eviction waiting on it evicts anyway (it is a cache)."""
        return self._end_put(job, ok=False)

    def start_prefetch(self, key: CacheKey, match: HiMatch, l3_pages: int) -> PrefetchJob | None:
        """Reserve host pages for `key`'s pages after the local match that L3 holds (`l3_pages`: its
        hit in whole pages from the start of the key). None when there is nothing to fetch, the
        in-flight limit refuses, or the host has no room. Call right after `match`."""
        tokens = as_array(key.tokens)
        start, end = match.local_len, min(l3_pages * self.page_size, self.aligned_len(len(tokens)))
        if end <= start:
            return None
        if self._limited >= self.max_inflight_jobs:
            self.refused_jobs += 1
            return None
        anchor = self._node(match.host_node)
        pins = [anchor] if anchor.parent is not None else []
        for p in pins:  # before allocating: a host eviction to make room must not take the anchor
            self._t.add_path(p, pin=1)
        pages = self._alloc_host((end - start) // self.page_size)
        if pages is not None and self._limited >= self.max_inflight_jobs:  # puts made room, took the slot
            self._host.free(pages)
            self.refused_jobs += 1
            pages = None
        if pages is None:
            for p in pins:
                self._t.add_path(p, pin=-1)
            return None
        hashes = extend_hashes(self._t.last_hash(anchor, key.extra), tokens[start:end], self.page_size)
        job = PrefetchJob(next(self._job_ids), key.extra, start, tuple(tokens[start:end]), tuple(hashes), tuple(pages))
        job.anchor, job.pins = anchor, pins
        self._job_pages += len(pages)
        self._register(job)
        return job

    def prefetch_done(self, job: PrefetchJob, arrived: int) -> int:
        """The first `arrived` pages were written: they join the tree as host-resident (and in L3),
        unless a node already holds them there; the rest of the reservation is freed. Returns the
        pages kept."""
        if self._jobs.get(job.job_id) is not job:
            raise DoubleAckError(f"prefetch job {job.job_id} was already acknowledged (or is not ours)")
        if not 0 <= arrived <= len(job.host_pages):
            raise ValueError(f"prefetch_done: arrived={arrived} outside [0, {len(job.host_pages)}]")
        self._retire(job)
        t, ps = self._t, self.page_size
        self._job_pages -= len(job.host_pages)
        for p in job.pins:
            t.add_path(p, pin=-1)
        keep, spare = list(job.host_pages[:arrived]), list(job.host_pages[arrived:])
        kept = 0
        if arrived:
            # A root anchor may have been dropped (emptied) meanwhile; a pinned node cannot have.
            anchor = job.anchor if job.anchor is not None and job.anchor.parent is not None else t.root(job.extra)
            tokens = array("i", job.tokens[: arrived * ps])
            path = t.walk(anchor, tokens, len(tokens), hit=False)
            pos = 0
            for node in path:
                here = keep[pos // ps : (pos + len(node.key)) // ps]
                if node.host is None and node.backup is None:
                    t.set(node, host=here)
                    node.l3 = True
                    kept += len(here)
                else:
                    spare.extend(here)  # already held on the host: the fetched copy is surplus
                pos += len(node.key)
            if pos < len(tokens):
                parent, hashes = path[-1] if path else anchor, list(job.hashes[pos // ps : arrived])
                leaf = t.add_child(parent, tokens[pos:], hashes, value=None, host=keep[pos // ps :])
                leaf.l3 = True
                kept += arrived - pos // ps
        job.anchor, job.pins = None, []
        if spare:
            self._host.free(spare)
        return kept

    def prefetch_failed(self, job: PrefetchJob) -> None:
        self.prefetch_done(job, 0)

    def sanity_check(self, check_hashes: bool = False) -> None:
        """Recount everything from the tree and the jobs; `check_hashes` also recomputes every page
        hash (one SHA-256 per page: for tests)."""
        check_tree(self, check_hashes)

    # -- internals ------------------------------------------------------------------------------

    def _node(self, handle: CacheHandle) -> HiNode:
        if not isinstance(handle, HiNode):
            raise TypeError(f"not a hierarchical cache handle: {type(handle).__name__}")
        if handle.evicted:
            raise ValueError("stale handle: its node left the tree (lock right after match)")
        return handle

    def _register(self, job: Job) -> None:
        self._jobs[job.job_id] = job
        self._limited += 1

    def _retire(self, job: Job) -> None:
        if self._jobs.get(job.job_id) is not job:
            raise DoubleAckError(f"job {job.job_id} was already acknowledged (or is not this cache's)")
        del self._jobs[job.job_id]
        if not isinstance(job, LoadJob):
            self._limited -= 1

    def _finish(self, job: BackupJob | LoadJob, freed: list[int]) -> int:
        job.nodes = []
        if freed:
            self._free_slots(freed)
        return len(freed)

    def _start_backup(self, node: HiNode, *, evict_after: bool) -> BackupJob | None:
        if self._limited >= self.max_inflight_jobs:
            self.refused_jobs += 1
            return None
        pages = self._alloc_host(len(node.key) // self.page_size)
        if pages is None:
            return None
        if self._limited >= self.max_inflight_jobs:  # puts made by the host eviction took the room
            self._host.free(pages)
            self.refused_jobs += 1
            return None
        assert node.value is not None
        job = BackupJob(next(self._job_ids), tuple(node.value), tuple(pages), evict_after, [node])
        self._t.set(node, backup=job)
        self._job_pages += len(pages)
        self._register(job)
        return job

    def _start_put(self, node: HiNode, *, evict_after: bool) -> PutJob | None:
        if self._limited >= self.max_inflight_jobs:
            self.refused_jobs += 1
            return None
        assert node.host is not None
        job = PutJob(next(self._job_ids), tuple(node.hashes), tuple(node.host), evict_after, [node], [node])
        node.put = job
        self._t.add_path(node, pin=1)
        self._register(job)
        return job

    def _end_put(self, job: PutJob, *, ok: bool) -> int:
        self._retire(job)
        for node in job.nodes:
            node.put = None
            node.l3 = node.l3 or ok
        for p in job.pins:
            self._t.add_path(p, pin=-1)
        freed: list[int] = []
        if job.evict_after:
            for node in reversed(job.nodes):
                if self._t.host_leaf(node):
                    freed.extend(self._t.drop_host_leaf(node))
        job.nodes, job.pins = [], []
        if freed:
            self._host.free(freed)
        return len(freed)

    def _drop_subtree(self, leaf: HiNode) -> list[int]:
        """Remove a device-only leaf and its host-only subtree: host pages are freed here, the
        device slots are returned for the caller to free with the rest of its batch."""
        slots, pages = self._t.drop_subtree(leaf)
        if pages:
            self._host.free(pages)
        return slots

    def _alloc_host(self, n: int) -> list[int] | None:
        pages = self._host.alloc(n)
        if pages is None:
            self.evict_host(n - self._host.available)
            pages = self._host.alloc(n)
        return pages

    def _queue_writes(self, node: HiNode) -> None:
        """What the write policy wants for `node` now (write_back wants nothing until eviction)."""
        if self.write_policy == "write_back" or (self.write_policy == "write_through_selective" and node.hits < 2):
            return
        if self._backup_eligible(node):
            self._t.want_backup[node] = None
        elif self.l3_enabled and self._put_eligible(node):
            self._t.want_put[node] = None

    def _backup_eligible(self, node: HiNode) -> bool:
        return not node.evicted and node.on_device and node.host is None and node.backup is None

    def _put_eligible(self, node: HiNode) -> bool:
        return not node.evicted and node.host is not None and not node.l3 and node.put is None
