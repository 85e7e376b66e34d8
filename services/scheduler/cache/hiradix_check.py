"""`HiRadixCache.sanity_check`: recount the hierarchical tree and its jobs from scratch and compare
with the incremental counters. Reads the cache's internals on purpose: it is the cache's own check,
kept in its own file so the tree's logic reads without it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.common.page_hash import extend_hashes
from services.scheduler.cache.hiradix_types import BackupJob, HiNode, LoadJob, PrefetchJob, PutJob
from services.scheduler.cache.tree_util import check, child_key

if TYPE_CHECKING:
    from services.scheduler.cache.hiradix import HiRadixCache


def check_tree(c: HiRadixCache, check_hashes: bool) -> None:
    ps = c.page_size
    pins: dict[HiNode, int] = {}
    pages_seen: set[int] = set()
    job_pages = limited = 0
    for job_id, job in c._jobs.items():
        check(job.job_id == job_id, "job filed under another id")
        if isinstance(job, BackupJob | PrefetchJob):
            job_pages += len(job.host_pages)
            _unique(pages_seen, job.host_pages, "a host page is held twice")
        if isinstance(job, PutJob | PrefetchJob):
            for p in job.pins:
                check(not p.evicted, "a pin on a node that left the tree")
                pins[p] = pins.get(p, 0) + 1
        if isinstance(job, BackupJob | LoadJob | PutJob):
            check(bool(job.nodes) and all(not x.evicted for x in job.nodes), "a job on a node that left the tree")
        limited += not isinstance(job, LoadJob)
        if isinstance(job, BackupJob):
            check(all(x.backup is job for x in job.nodes), "backup job and node disagree")
            check(len(job.slots) == ps * len(job.host_pages), "backup job: slots and pages disagree")
        elif isinstance(job, LoadJob):
            check(all(x.load is job for x in job.nodes), "load job and node disagree")
        elif isinstance(job, PutJob):
            check(all(x.put is job for x in job.nodes), "put job and node disagree")
    t = c._t
    check(limited == c._limited, f"in-flight count {c._limited} != recount {limited}")
    check(job_pages == c._job_pages, f"job pages {c._job_pages} != recount {job_pages}")

    dev_e = dev_p = host_e = host_p = 0
    slots_seen: set[int] = set()
    lists_seen: set[int] = set()
    dev_nodes: set[HiNode] = set()
    host_only: set[HiNode] = set()
    for extra, root in t.roots.items():
        check(root.parent is None and not root.key and root.extra == extra, "malformed root")
        check(bool(root.children), f"empty root kept for extra {extra!r}")
        seed = t.seed(extra)
        check(root.hashes == [seed], "root hash is not its namespace seed")
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = child_pins = 0
            for ck, x in node.children.items():
                k = len(x.key) // ps
                check(x.parent is node and not x.evicted and x.extra == extra, "broken parent link")
                check(len(x.key) > 0 and len(x.key) % ps == 0, "edge not whole pages")
                check(ck == child_key(x.key, 0, ps), "child indexed under the wrong key")
                check(len(x.hashes) == k, "one hash per page")
                if check_hashes:
                    check(x.hashes == extend_hashes(node.hashes[-1], x.key, ps), "page hashes do not chain")
                check(x.value is not None or x.host is not None, "a node with no copy anywhere")
                check(x.value is None or len(x.value) == len(x.key), "device slots / key length mismatch")
                check(x.host is None or len(x.host) == k, "host pages / page count mismatch")
                if x.value is not None:
                    check(node is root or node.value is not None, "device residency not closed upwards")
                    _unique(slots_seen, x.value, "a slot is cached twice")
                    _unique(lists_seen, [id(x.value)], "two owners share one list")
                    dev_nodes.add(x)
                    if x.lock_ref or x.backup is not None or x.load is not None:
                        dev_p += len(x.value)
                    else:
                        dev_e += len(x.value)
                if x.host is not None:
                    _unique(pages_seen, x.host, "a host page is held twice")
                    _unique(lists_seen, [id(x.host)], "two owners share one list")
                    if x.value is None and x.host_ref == 0:
                        host_e += len(x.host)
                    else:
                        host_p += len(x.host)
                    if x.value is None:
                        host_only.add(x)
                check(x.backup is None or (x.value is not None and x.host is None), "backup of a node not device-only")
                check(x.load is None or (x.value is not None and x.host is not None), "load of a node not on host")
                check(x.put is None or x.host is not None, "put of a node not on host")
                for on in (x.backup, x.load, x.put):
                    check(on is None or c._jobs.get(on.job_id) is on, "node points at an acknowledged job")
                check(x.lock_ref >= 0 and x.host_ref >= 0, "negative reference count")
                check(x.lock_ref == 0 or x.on_device, "a lock on a node that is not device-resident")
                child_locks += x.lock_ref
                child_pins += x.host_ref
                stack.append(x)
            if node is not root:
                check(node.lock_ref >= child_locks, "a node has fewer locks than its subtree")
                check(node.host_ref == child_pins + pins.get(node, 0), "pins along a path do not add up")
    check(dev_nodes == t.dev_nodes and host_only == t.host_only, "index sets out of date")
    check(dev_e == t.dev_evictable, f"device evictable {t.dev_evictable} != recount {dev_e}")
    check(dev_p == t.dev_protected, f"device protected {t.dev_protected} != recount {dev_p}")
    check(host_e == t.host_evictable, f"host evictable {t.host_evictable} != recount {host_e}")
    check(host_p == t.host_protected, f"host protected {t.host_protected} != recount {host_p}")
    for want in (t.want_backup, t.want_put):
        check(all(not x.evicted for x in want), "a queued write on a node that left the tree")
    total = c._host.available + c.host_evictable_size + c.host_protected_size
    check(total == c._host.num_pages, f"host free + evictable + protected = {total} != {c._host.num_pages}")


def _unique(seen: set[int], items: Iterable[int], msg: str) -> None:
    before = len(seen)
    batch = list(items)
    seen.update(batch)
    check(len(seen) == before + len(batch), msg)
