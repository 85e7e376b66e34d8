"""The books of the hierarchical radix cache: nodes, edge splits, residency-aware size counters and
the index sets eviction scans. No policy and no jobs: `hiradix.py` decides, this keeps the books.

Every change to a node's tier fields (value, host, lock_ref, host_ref, backup, load) goes through
`set` or `add_path`, which take the node's share out of the counters, apply the change and put it
back, so the counters cannot drift from what `sanity_check` recounts:

    device  protected  value of a node locked, being backed up or being loaded
            evictable  value of any other node
    host    evictable  host of a host-only node with no pin at or below it
            protected  host of any other node (also on the device, or pinned)

A node keeps its identity across a split as the *deeper* half (a handle names where its match
ended); jobs, queued writes, locks and pins on it cover the new upper half too.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from array import array
from collections.abc import Iterable
from typing import Literal

from services.common.page_hash import HashNamespace
from services.scheduler.cache.hiradix_types import BackupJob, HiNode, LoadJob
from services.scheduler.cache.tree_util import child_key, common_prefix

EvictionPolicy = Literal["lru", "lfu"]
Heap = list[tuple[int, int, int, HiNode]]


class _Keep:
    """The default of `set`'s fields: leave this one as it is."""


_KEEP = _Keep()


class HiTree:
    __slots__ = (
        "_serials",
        "detached_root",
        "dev_evictable",
        "dev_nodes",
        "dev_protected",
        "eviction",
        "host_evictable",
        "host_only",
        "host_protected",
        "namespace",
        "page_size",
        "roots",
        "tick",
        "want_backup",
        "want_put",
    )

    def __init__(self, page_size: int, namespace: HashNamespace, eviction: EvictionPolicy) -> None:
        self.page_size = page_size
        self.namespace = namespace
        self.eviction: EvictionPolicy = eviction
        self.roots: dict[str, HiNode] = {}
        self.detached_root = HiNode(array("i"), None, "", [])  # the handle of a miss on a rootless extra
        # Nodes waiting for a write the policy wants (ordered sets, bounded by the tree's nodes).
        self.want_backup: dict[HiNode, None] = {}
        self.want_put: dict[HiNode, None] = {}
        self.dev_nodes: set[HiNode] = set()  # nodes holding device slots (being loaded included)
        self.host_only: set[HiNode] = set()
        self.dev_evictable = self.dev_protected = 0
        self.host_evictable = self.host_protected = 0
        self.tick = 0  # a logical clock: deterministic, never ties between operations
        self._serials = itertools.count()

    def seed(self, extra: str) -> bytes:
        """The first link of `extra`'s hash chain: the extra key is the namespace's cache salt."""
        return dataclasses.replace(self.namespace, cache_salt=extra).seed

    def root(self, extra: str) -> HiNode:
        root = self.roots.get(extra)
        if root is None:
            root = self.roots[extra] = self._new_node(array("i"), None, [self.seed(extra)], extra)
        return root

    def last_hash(self, node: HiNode, extra: str) -> bytes:
        return node.hashes[-1] if node.hashes else self.seed(extra)  # empty: the detached root

    # -- changes that keep the books -------------------------------------------------------------

    def acc(self, n: HiNode, sign: int) -> None:
        """Add (sign=1) or take out (sign=-1) a node's share of the counters and index sets."""
        if n.value is not None:
            if n.lock_ref or n.backup is not None or n.load is not None:
                self.dev_protected += sign * len(n.value)
            else:
                self.dev_evictable += sign * len(n.value)
        if n.host is not None:
            if n.value is None and n.host_ref == 0:
                self.host_evictable += sign * len(n.host)
            else:
                self.host_protected += sign * len(n.host)
        if sign < 0:
            self.dev_nodes.discard(n)
            self.host_only.discard(n)
        elif n.value is not None:
            self.dev_nodes.add(n)
        elif n.host is not None:
            self.host_only.add(n)

    def set(
        self,
        n: HiNode,
        *,
        value: list[int] | _Keep | None = _KEEP,
        host: list[int] | _Keep | None = _KEEP,
        backup: BackupJob | _Keep | None = _KEEP,
        load: LoadJob | _Keep | None = _KEEP,
    ) -> None:
        self.acc(n, -1)
        if not isinstance(value, _Keep):
            n.value = value
        if not isinstance(host, _Keep):
            n.host = host
        if not isinstance(backup, _Keep):
            n.backup = backup
        if not isinstance(load, _Keep):
            n.load = load
        self.acc(n, 1)

    def add_path(self, node: HiNode, *, lock: int = 0, pin: int = 0) -> None:
        """Add `lock` request locks and `pin` transfer pins on every node from `node` to the root."""
        cur: HiNode | None = node
        while cur is not None and cur.parent is not None:
            self.acc(cur, -1)
            cur.lock_ref += lock
            cur.host_ref += pin
            self.acc(cur, 1)
            cur = cur.parent

    def add_child(
        self, parent: HiNode, key: array[int], hashes: list[bytes], *, value: list[int] | None, host: list[int] | None
    ) -> HiNode:
        node = self._new_node(key, parent, hashes)
        node.last_access = self.tick
        node.value, node.host = value, host
        parent.children[child_key(key, 0, self.page_size)] = node
        self.acc(node, 1)
        return node

    def walk(self, start: HiNode, tokens: array[int], n: int, *, hit: bool) -> list[HiNode]:
        """Follow tokens[:n] (page-aligned) down from `start`, splitting the edge where the match
        stops inside it; returns the nodes passed, the last ending exactly where the match ends."""
        self.tick += 1
        ps = self.page_size
        path: list[HiNode] = []
        node, pos = start, 0
        while pos < n:
            child = node.children.get(child_key(tokens, pos, ps))
            if child is None:
                break
            edge = len(child.key)
            m = common_prefix(tokens, pos, child.key, min(edge, n - pos))
            m -= m % ps  # the dict lookup matched the first page, so m >= page_size
            if m < edge:
                child = self._split(child, m)
            child.last_access = self.tick
            child.hits += hit
            path.append(child)
            node, pos = child, pos + m
            if m < edge:
                break
        return path

    # -- removal ---------------------------------------------------------------------------------

    def drop_device(self, n: HiNode) -> list[int]:
        """A node also on the host gives up its device slots (returned) and stays, host-resident."""
        slots = n.value
        assert slots is not None and n.host is not None
        self.set(n, value=None)
        return slots

    def drop_host_leaf(self, n: HiNode) -> list[int]:
        """A host-only leaf leaves the tree; returns its host pages."""
        pages = n.host
        assert pages is not None and n.value is None
        self.acc(n, -1)
        n.host = None
        self._unlink(n)
        return pages

    def drop_subtree(self, top: HiNode) -> tuple[list[int], list[int]]:
        """A device leaf not on the host leaves the tree with its (host-only, unpinned) subtree;
        returns (device slots, host pages) to free."""
        assert top.host_ref == 0 and top.host is None
        order, stack = [], [top]
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        slots: list[int] = []
        pages: list[int] = []
        for x in reversed(order):  # descendants before ancestors
            self.acc(x, -1)
            slots.extend(x.value or ())
            pages.extend(x.host or ())
            x.value = x.host = None
            self._unlink(x)
        return slots, pages

    # -- eviction order --------------------------------------------------------------------------

    def device_leaf(self, n: HiNode) -> bool:
        """Unlocked, not in a transfer, on the device, no child on the device: may leave the device."""
        return (
            not n.evicted
            and n.on_device
            and n.lock_ref == 0
            and n.backup is None
            and all(c.value is None for c in n.children.values())
        )

    def host_leaf(self, n: HiNode) -> bool:
        """Host-only, childless, nothing pinned: may leave the host (and the tree)."""
        return not n.evicted and n.value is None and n.host is not None and n.host_ref == 0 and not n.children

    def heap(self, nodes: Iterable[HiNode]) -> Heap:
        heap = [(*self._priority(x), x.serial, x) for x in nodes]
        heapq.heapify(heap)
        return heap

    def push(self, heap: Heap, n: HiNode) -> None:
        heapq.heappush(heap, (*self._priority(n), n.serial, n))

    # -- internals -------------------------------------------------------------------------------

    def _priority(self, n: HiNode) -> tuple[int, int]:
        return (n.hits, n.last_access) if self.eviction == "lfu" else (n.last_access, 0)

    def _new_node(self, key: array[int], parent: HiNode | None, hashes: list[bytes], extra: str = "") -> HiNode:
        node = HiNode(key, parent, parent.extra if parent is not None else extra, hashes)
        node.serial = next(self._serials)  # a deterministic tie-break for eviction order
        return node

    def _split(self, node: HiNode, m: int) -> HiNode:
        """Cut node's edge after m tokens; the new upper node is returned, `node` keeps the rest."""
        parent = node.parent
        assert parent is not None, "roots have no edge to split"
        k = m // self.page_size
        self.acc(node, -1)
        upper = self._new_node(node.key[:m], parent, node.hashes[:k])
        if node.value is not None:
            upper.value, node.value = node.value[:m], node.value[m:]
        if node.host is not None:
            upper.host, node.host = node.host[:k], node.host[k:]
        upper.l3, upper.lock_ref, upper.host_ref = node.l3, node.lock_ref, node.host_ref
        upper.last_access, upper.hits = node.last_access, node.hits
        upper.backup, upper.load, upper.put = node.backup, node.load, node.put
        for job in (node.backup, node.load, node.put):
            if job is not None:  # the job's pages are spread over its nodes in order on ack
                job.nodes.insert(job.nodes.index(node), upper)
        for want in (self.want_backup, self.want_put):
            if node in want:
                want[upper] = None
        node.key, node.hashes, node.parent = node.key[m:], node.hashes[k:], upper
        parent.children[child_key(upper.key, 0, self.page_size)] = upper
        upper.children[child_key(node.key, 0, self.page_size)] = node
        self.acc(upper, 1)
        self.acc(node, 1)
        return upper

    def _unlink(self, x: HiNode) -> None:
        """Take a childless node holding nothing out of the tree (its share already taken out)."""
        parent = x.parent
        assert parent is not None and not x.children and x.lock_ref == 0 and x.host_ref == 0
        del parent.children[child_key(x.key, 0, self.page_size)]
        if parent.parent is None and not parent.children:
            del self.roots[parent.extra]  # per-user salts must not accumulate roots
        self.want_backup.pop(x, None)
        self.want_put.pop(x, None)
        # Drop references so a stale handle (or a job the caller kept) pins no memory.
        x.evicted, x.parent, x.key, x.hashes = True, None, array("i"), []
