"""Hierarchical radix cache: write policies (which jobs appear when), load-back, write-back
eviction, host eviction around pinned pages, L3 puts and prefetches, exactly-once acknowledgement,
back-pressure, the prefetch tracker's stop policies, and a stateful run of random operations that
moves fake bytes between the tiers and keeps `free + evictable + protected == size` on both."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.common.page_hash import HashNamespace, page_hashes
from services.scheduler.allocator import SlotAllocator
from services.scheduler.cache.base import CacheHandle, CacheKey, MatchResult
from services.scheduler.cache.hiradix import EvictionPolicy, HiRadixCache
from services.scheduler.cache.hiradix_policy import (
    WRITE_POLICIES,
    DoubleAckError,
    PrefetchTracker,
    StopPolicy,
    WritePolicy,
    should_prefetch,
)
from services.scheduler.cache.hiradix_types import BackupJob, HiMatch, HiNode, Job, LoadJob, PrefetchJob, PutJob
from services.scheduler.host_alloc import HostPageAllocator

NS = HashNamespace("test-model", "page-first/L2/H2/D8/bfloat16")


class Env:
    """A device slot allocator, a host page allocator and the cache, wired as the scheduler will."""

    def __init__(
        self,
        page_size: int = 1,
        policy: WritePolicy = "write_back",
        *,
        size: int = 64,
        host_pages: int = 32,
        l3: bool = False,
        max_inflight: int = 64,
    ) -> None:
        self.alloc = SlotAllocator(size, page_size)
        self.host = HostPageAllocator(host_pages)
        self.cache = HiRadixCache(
            page_size, self.alloc.free, self.host, NS, write_policy=policy, l3=l3, max_inflight_jobs=max_inflight
        )

    def put(self, tokens: list[int], extra: str = "") -> tuple[int, list[int]]:
        """A request that computed `tokens` from scratch caches them and frees what it keeps."""
        own = self.alloc.alloc(len(tokens))
        assert own is not None
        slots = own[: len(tokens)]
        cached = self.cache.insert(CacheKey(tokens, extra), slots)
        self.alloc.free(own[:cached] + own[self.cache.aligned_len(len(tokens)) :])
        return cached, slots

    def match(self, tokens: list[int], extra: str = "") -> tuple[list[int], int, list[int], CacheHandle]:
        m = self.cache.match(CacheKey(tokens, extra))
        return m.slots, m.host_len, m.host_pages, m.node

    def offload(self, tokens: list[int]) -> BackupJob:
        """write_back: evict the (unlocked) leaf ending `tokens` to the host; returns its backup."""
        assert self.cache.evict_device(len(tokens)).pending > 0
        (job,) = self.cache.take_jobs()
        assert isinstance(job, BackupJob) and job.evict_after
        assert self.cache.backup_done(job) == len(job.slots)
        return job

    def check(self, held: int = 0) -> None:
        c = self.cache
        c.sanity_check(check_hashes=True)
        assert self.alloc.available + c.evictable_size + c.protected_size + held == self.alloc.size
        assert self.host.available + c.host_evictable_size + c.host_protected_size == self.host.num_pages


def _node(h: CacheHandle) -> HiNode:
    assert isinstance(h, HiNode)
    return h


# -- write policies ------------------------------------------------------------------------------


def test_write_through_backs_up_every_insert_and_pins_it_until_acknowledged() -> None:
    env = Env(page_size=2, policy="write_through")
    _, slots = env.put([1, 2, 3, 4, 5])  # two whole pages and a tail
    (job,) = env.cache.take_jobs()
    assert isinstance(job, BackupJob) and not job.evict_after
    assert job.slots == tuple(slots[:4]) and len(job.host_pages) == 2
    node = env.match([1, 2, 3, 4])[3]
    # In flight: device-only, pinned (not evictable), the host pages reserved but not host-resident.
    assert env.cache.residency(node) == "device"
    assert (env.cache.evictable_size, env.cache.protected_size) == (0, 4)
    assert env.cache.host_protected_size == 2
    assert env.cache.evict(4) == 0
    env.check()
    assert env.cache.backup_done(job) == 0
    assert env.cache.residency(node) == "both"
    assert env.cache.take_jobs() == []
    # Evicting a backed-up node drops only its device copy: it stays, host-resident.
    assert env.cache.evict(4) == 4
    assert env.match([1, 2, 3, 4]) == ([], 4, list(job.host_pages), env.cache.match(CacheKey([1])).node)
    assert env.cache.host_evictable_size == 2
    env.check()


def test_write_through_selective_backs_up_on_the_second_hit() -> None:
    env = Env(policy="write_through_selective")
    env.put([1, 2, 3])
    assert env.cache.take_jobs() == []
    env.match([1, 2, 3])
    assert env.cache.take_jobs() == []
    env.match([1, 2, 3, 9])
    (job,) = env.cache.take_jobs()
    assert isinstance(job, BackupJob) and len(job.host_pages) == 3
    env.check()


def test_write_back_backs_up_only_on_eviction_then_drops_the_device_copy() -> None:
    env = Env(page_size=2, policy="write_back")
    _, slots = env.put([1, 2, 3, 4])
    for _ in range(3):
        env.match([1, 2, 3, 4])
    assert env.cache.take_jobs() == []
    ev = env.cache.evict_device(4)
    assert ev.freed == 0 and ev.pending == 4  # nothing freed yet: the copy comes first
    (job,) = env.cache.take_jobs()
    assert isinstance(job, BackupJob) and job.evict_after and job.slots == tuple(slots[:4])
    assert env.cache.protected_size == 4
    env.check()
    assert env.cache.backup_done(job) == 4
    assert env.alloc.available == env.alloc.size
    assert env.match([1, 2, 3, 4])[:3] == ([], 4, list(job.host_pages))
    env.check()


def test_write_back_eviction_keeps_a_node_locked_meanwhile() -> None:
    env = Env(policy="write_back")
    env.put([1, 2])
    env.cache.evict(2)
    (job,) = env.cache.take_jobs()
    m = env.cache.match(CacheKey([1, 2]))
    env.cache.lock(m.node)  # a request started using it while the copy was in flight
    assert isinstance(job, BackupJob) and env.cache.backup_done(job) == 0
    assert env.cache.residency(m.node) == "both"
    env.cache.unlock(m.node)
    assert env.cache.evict(2) == 2  # now it is on the host: a plain drop
    env.check()


def test_write_back_with_a_full_host_pool_evicts_outright() -> None:
    env = Env(policy="write_back", host_pages=2)
    env.put([1, 2, 3])  # three pages, the host has room for two
    assert env.cache.evict_device(3) == (3, 0)
    assert env.cache.take_jobs() == []
    assert env.match([1, 2, 3])[:3] == ([], 0, [])
    assert env.host.available == 2
    env.check()


def test_failed_write_back_backup_evicts_outright() -> None:
    env = Env(policy="write_back")
    env.put([1, 2, 3])
    env.cache.evict(3)
    (job,) = env.cache.take_jobs()
    assert isinstance(job, BackupJob)
    assert env.cache.backup_failed(job) == 3
    assert env.host.available == env.host.num_pages and env.alloc.available == env.alloc.size
    assert env.match([1, 2, 3])[:3] == ([], 0, [])
    env.check()


def test_split_while_a_backup_is_in_flight_spreads_its_pages_over_both_halves() -> None:
    env = Env(page_size=2, policy="write_through")
    env.put([1, 2, 3, 4, 5, 6, 7, 8])
    (job,) = env.cache.take_jobs()
    env.put([1, 2, 3, 4, 9, 9])  # splits the node whose backup is in flight
    env.check()
    assert isinstance(job, BackupJob) and env.cache.backup_done(job) == 0
    env.check()
    env.cache.evict(100)  # [9 9] was never backed up: gone; both halves keep their host pages
    assert env.match([1, 2, 3, 4, 5, 6, 7, 8])[:3] == ([], 8, list(job.host_pages))
    assert env.match([1, 2, 3, 4, 9, 9])[1] == 4
    env.check()


# -- load-back -----------------------------------------------------------------------------------


def _host_tail(env: Env) -> tuple[list[int], BackupJob]:
    """[1 2 3 4] on the device, [5 6 7 8] after it only on the host (page size 2)."""
    _, head = env.put([1, 2, 3, 4])
    env.put([1, 2, 3, 4, 5, 6, 7, 8])
    m = env.cache.match(CacheKey([1, 2, 3, 4]))
    env.cache.lock(m.node)
    job = env.offload([5, 6, 7, 8])
    env.cache.unlock(m.node)
    return head[:4], job


def test_load_back_makes_a_host_prefix_device_resident() -> None:
    env = Env(page_size=2, policy="write_back")
    head, backup = _host_tail(env)
    full = [1, 2, 3, 4, 5, 6, 7, 8]
    m = env.cache.match(CacheKey(full))
    assert (m.slots, m.host_len, m.host_pages) == (head, 4, list(backup.host_pages))
    slots = env.alloc.alloc(4)
    assert slots is not None
    load = env.cache.start_load(m, slots)
    assert load.host_pages == backup.host_pages and load.slots == tuple(slots)
    # While the copy is in flight the pages are neither matchable, lockable, nor evictable.
    assert env.match(full)[:2] == (head, 0)
    with pytest.raises(ValueError):
        env.cache.lock(load.node)
    assert env.cache.evict(100) == 0
    env.check()
    env.cache.load_done(load)
    m = env.cache.match(CacheKey(full))
    assert m.slots == head + slots and m.host_len == 0 and m.node is load.node
    assert env.cache.residency(m.node) == "both"
    env.cache.lock(m.node)
    env.cache.unlock(m.node)
    env.check()


def test_failed_load_frees_the_slots_and_keeps_the_host_copy() -> None:
    env = Env(page_size=2, policy="write_back")
    head, backup = _host_tail(env)
    m = env.cache.match(CacheKey([1, 2, 3, 4, 5, 6, 7, 8]))
    slots = env.alloc.alloc(4)
    assert slots is not None
    env.cache.load_failed(env.cache.start_load(m, slots))
    assert not any(env.alloc.is_allocated(s) for s in slots)
    assert env.match([1, 2, 3, 4, 5, 6, 7, 8])[:3] == (head, 4, list(backup.host_pages))
    env.check()


def test_start_load_rejects_a_stale_match() -> None:
    env = Env(page_size=2, policy="write_back")
    _host_tail(env)
    m = env.cache.match(CacheKey([1, 2, 3, 4, 5, 6, 7, 8]))
    env.cache.evict_host(100)  # the host part is gone
    slots = env.alloc.alloc(4)
    assert slots is not None
    with pytest.raises(ValueError):
        env.cache.start_load(m, slots)
    env.alloc.free(slots)
    env.check()


def test_insert_over_a_host_only_node_adopts_the_requests_slots() -> None:
    env = Env(page_size=2, policy="write_back")
    head, _ = _host_tail(env)
    full = [1, 2, 3, 4, 5, 6, 7, 8]
    m = env.cache.match(CacheKey(full))
    env.cache.lock(m.node)
    own = env.alloc.alloc(4)  # the request recomputes the host part instead of loading it
    assert own is not None
    cached = env.cache.insert(CacheKey(full), head + own)
    assert cached == 4  # the device prefix: the tree took own[0:4] as the node's device copy
    env.cache.unlock(m.node)
    m = env.cache.match(CacheKey(full))
    assert m.slots == head + own and env.cache.residency(m.node) == "both"
    env.check()


def test_insert_under_a_node_being_loaded_frees_what_it_cannot_take() -> None:
    env = Env(page_size=2, policy="write_back")
    head, _ = _host_tail(env)
    full = [1, 2, 3, 4, 5, 6, 7, 8]
    slots = env.alloc.alloc(4)
    assert slots is not None
    load = env.cache.start_load(env.cache.match(CacheKey(full)), slots)
    own = env.alloc.alloc(4)
    assert own is not None
    assert env.cache.insert(CacheKey(full), head + own) == 4
    assert not any(env.alloc.is_allocated(s) for s in own)
    env.cache.load_done(load)
    assert env.match(full)[0] == head + slots
    env.check()


# -- host eviction and L3 ------------------------------------------------------------------------


def test_host_eviction_never_touches_pinned_pages() -> None:
    env = Env(policy="write_through", l3=True)
    keys = {name: [t] * 3 for t, name in enumerate("xyzw", start=1)}
    for tokens in keys.values():
        env.put(tokens)
    for job in env.cache.take_jobs():
        assert isinstance(job, BackupJob)
        env.cache.backup_done(job)
    puts = {job.hashes: job for job in env.cache.take_jobs() if isinstance(job, PutJob)}
    assert len(puts) == 4  # write_through: every backed-up page goes to L3 too
    z_put = puts.pop(tuple(page_hashes(keys["z"], 1, NS)))
    for job in puts.values():
        env.cache.put_done(job)
    w = env.cache.match(CacheKey(keys["w"])).node
    env.cache.lock(w)
    assert env.cache.evict(100) == 9  # x, y, z drop their device copies; w is locked
    env.cache.unlock(w)
    y = env.cache.match(CacheKey(keys["y"]))
    slots = env.alloc.alloc(3)
    assert slots is not None
    load = env.cache.start_load(y, slots)
    env.check()
    # x is the only host-only page set with nothing pinned: y is loading, z is being put, w is on device.
    assert env.cache.host_evictable_size == 3
    assert env.cache.evict_host(100) == (3, 0)
    assert env.match(keys["x"])[:2] == ([], 0)
    assert [env.cache.residency(env.cache.match(CacheKey(keys[k])).host_node) for k in "yzw"] == ["host"] * 2 + ["both"]
    env.check()
    assert env.cache.put_done(z_put) == 0
    assert env.cache.evict_host(100) == (3, 0)  # now z goes
    env.cache.load_done(load)
    assert env.cache.evict_host(100) == (0, 0)
    env.check()


def test_l3_write_through_puts_each_page_under_its_chained_hash() -> None:
    env = Env(page_size=2, policy="write_through", l3=True)
    tokens = [5, 6, 7, 8, 9, 10]
    env.put(tokens)
    (backup,) = env.cache.take_jobs()
    assert isinstance(backup, BackupJob) and env.cache.take_jobs() == []  # no put before the host copy
    env.cache.backup_done(backup)
    (put,) = env.cache.take_jobs()
    assert isinstance(put, PutJob) and not put.evict_after
    assert put.hashes == tuple(page_hashes(tokens, 2, NS)) and put.host_pages == backup.host_pages
    env.check()
    assert env.cache.put_done(put) == 0
    assert _node(env.cache.match(CacheKey(tokens)).node).l3
    assert env.cache.take_jobs() == []
    env.check()


def test_l3_write_through_selective_puts_after_the_second_hit() -> None:
    env = Env(policy="write_through_selective", l3=True)
    env.put([1, 2])
    env.match([1, 2])
    env.match([1, 2])
    (backup,) = env.cache.take_jobs()
    assert isinstance(backup, BackupJob)
    env.cache.backup_done(backup)
    (put,) = env.cache.take_jobs()
    assert isinstance(put, PutJob) and put.host_pages == backup.host_pages


@pytest.mark.parametrize("ok", [True, False])
def test_l3_write_back_puts_on_host_eviction(ok: bool) -> None:
    env = Env(page_size=2, policy="write_back", l3=True)
    env.put([1, 2, 3, 4])
    env.offload([1, 2, 3, 4])
    assert env.cache.evict_host(2) == (0, 2)
    (put,) = env.cache.take_jobs()
    assert isinstance(put, PutJob) and put.evict_after and put.hashes == tuple(page_hashes([1, 2, 3, 4], 2, NS))
    assert env.cache.host_protected_size == 2 and env.cache.evict_host(2) == (0, 0)
    env.check()
    # Evicted once the put is acknowledged, and also when it failed: L2 is a cache.
    assert (env.cache.put_done(put) if ok else env.cache.put_failed(put)) == 2
    assert env.host.available == env.host.num_pages
    assert env.match([1, 2, 3, 4])[:2] == ([], 0)
    env.check()


def test_prefetch_adds_the_pages_that_arrived_as_host_resident() -> None:
    env = Env(page_size=2, policy="write_back", l3=True)
    _, head = env.put([1, 2, 3, 4])
    key = CacheKey([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    m = env.cache.match(key)
    assert env.cache.l3_keys(key, m) == page_hashes(key.tokens, 2, NS)[2:]
    assert should_prefetch(5, m.local_len // 2, threshold_pages=2)
    job = env.cache.start_prefetch(key, m, l3_pages=5)
    assert job is not None and job.start == 4 and job.hashes == tuple(page_hashes(key.tokens, 2, NS)[2:5])
    assert env.cache.host_protected_size == 3
    env.check()
    assert env.cache.prefetch_done(job, 2) == 2  # the third page missed: its reservation is freed
    assert env.host.available == env.host.num_pages - 2
    m = env.cache.match(key)
    assert (m.slots, m.host_len, m.host_pages) == (head[:4], 4, list(job.host_pages[:2]))
    assert _node(m.host_node).l3
    env.check()
    slots = env.alloc.alloc(4)
    assert slots is not None
    env.cache.load_done(env.cache.start_load(m, slots))
    assert env.cache.match(key).slots == head[:4] + slots
    env.check()


@pytest.mark.parametrize("backing_up", [False, True])
def test_prefetch_arriving_for_pages_cached_meanwhile(backing_up: bool) -> None:
    """A request recomputed the pages while they were being fetched: the fetched copy becomes the
    node's host copy (saving a backup), unless a backup of it is already in flight."""
    env = Env(page_size=2, policy="write_through", l3=True)
    key = CacheKey([1, 2, 3, 4])
    job = env.cache.start_prefetch(key, env.cache.match(key), l3_pages=2)
    assert job is not None
    env.put([1, 2, 3, 4])
    backups = env.cache.take_jobs() if backing_up else []
    assert env.cache.prefetch_done(job, 2) == (0 if backing_up else 2)
    env.check()
    node = env.cache.match(key).node
    if backing_up:
        assert env.host.available == env.host.num_pages - 2  # only the backup's pages are held
        assert env.cache.residency(node) == "device"
        (backup,) = backups
        assert isinstance(backup, BackupJob)
        env.cache.backup_done(backup)
    else:
        assert _node(node).host == list(job.host_pages) and _node(node).l3
        assert env.cache.take_jobs() == []  # on the host and in L3 already: nothing to write
    assert env.cache.residency(node) == "both"
    env.check()


def test_prefetch_for_a_new_extra_uses_its_own_namespace() -> None:
    env = Env(page_size=2, l3=True)
    key = CacheKey([1, 2, 3, 4], "salt")
    m = env.cache.match(key)
    salted = page_hashes(key.tokens, 2, dataclasses.replace(NS, cache_salt="salt"))
    assert env.cache.l3_keys(key, m) == salted != page_hashes(key.tokens, 2, NS)
    job = env.cache.start_prefetch(key, m, l3_pages=2)
    assert job is not None and env.cache.prefetch_done(job, 2) == 2
    assert env.match([1, 2, 3, 4], "salt")[1:3] == (4, list(job.host_pages))
    assert env.match([1, 2, 3, 4])[1] == 0
    env.check()


def test_prefetch_pins_its_anchor_against_host_eviction() -> None:
    env = Env(page_size=2, policy="write_back", l3=True)
    env.put([1, 2])
    env.offload([1, 2])
    key = CacheKey([1, 2, 3, 4])
    job = env.cache.start_prefetch(key, env.cache.match(key), l3_pages=2)
    assert job is not None and env.cache.host_evictable_size == 0
    assert env.cache.evict_host(100) == (0, 0)
    env.check()
    env.cache.prefetch_done(job, 1)
    assert env.match([1, 2, 3, 4])[1] == 4
    env.check()


# -- exactly once, back-pressure, ownership ------------------------------------------------------


def test_every_acknowledgement_is_accepted_exactly_once() -> None:
    env = Env(page_size=2, policy="write_back", l3=True)
    head, backup = _host_tail(env)
    with pytest.raises(DoubleAckError):
        env.cache.backup_done(backup)
    with pytest.raises(DoubleAckError):
        env.cache.backup_failed(backup)
    slots = env.alloc.alloc(4)
    assert slots is not None
    load = env.cache.start_load(env.cache.match(CacheKey([1, 2, 3, 4, 5, 6, 7, 8])), slots)
    env.cache.load_done(load)
    with pytest.raises(DoubleAckError):
        env.cache.load_failed(load)  # would free slots that are the tree's now
    key = CacheKey([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    prefetch = env.cache.start_prefetch(key, env.cache.match(key), l3_pages=5)
    assert prefetch is not None
    env.cache.prefetch_failed(prefetch)
    with pytest.raises(DoubleAckError):
        env.cache.prefetch_done(prefetch, 1)
    env.check()
    other = Env(page_size=2, policy="write_back")
    other.put([1, 2])
    other.cache.evict(2)
    (foreign,) = other.cache.take_jobs()
    assert isinstance(foreign, BackupJob)
    with pytest.raises(DoubleAckError):
        env.cache.backup_done(foreign)
    env.check()
    assert env.match([1, 2, 3, 4, 5, 6, 7, 8])[0] == head + slots


def test_back_pressure_refuses_jobs_beyond_the_in_flight_limit() -> None:
    env = Env(policy="write_through", max_inflight=1)
    env.put([1, 1])
    env.put([2, 2])
    (first,) = env.cache.take_jobs()
    assert env.cache.inflight_jobs == 1 and env.cache.take_jobs() == []
    key = CacheKey([3, 3])
    assert env.cache.start_prefetch(key, env.cache.match(key), l3_pages=2) is None
    assert env.cache.refused_jobs >= 2
    env.check()
    assert isinstance(first, BackupJob)
    env.cache.backup_done(first)
    (second,) = env.cache.take_jobs()  # the refused backup stayed queued on its node
    assert isinstance(second, BackupJob) and second.host_pages != first.host_pages


def test_write_back_eviction_under_back_pressure_evicts_outright() -> None:
    env = Env(policy="write_back", max_inflight=1)
    env.put([1, 1, 1])
    env.put([2, 2])
    ev = env.cache.evict_device(100)
    assert ev == (2, 3)  # [1 1 1] (least recent) is backed up; the limit refuses [2 2]'s backup
    assert len(env.cache.take_jobs()) == 1 and env.cache.refused_jobs == 1
    env.check()


def test_no_list_in_the_tree_is_a_callers_list() -> None:
    env = Env(policy="write_back")
    slots = env.alloc.alloc(4)
    assert slots is not None
    env.cache.insert(CacheKey([1, 2, 3, 4]), slots)
    kept = list(slots)
    slots[0] = 999
    m = env.cache.match(CacheKey([1, 2, 3, 4]))
    assert m.slots == kept
    m.slots.append(7)
    m.host_pages.append(7)
    assert env.cache.match(CacheKey([1, 2, 3, 4])).slots == kept
    backup = env.offload([1, 2, 3, 4])
    assert isinstance(backup.slots, tuple) and isinstance(backup.host_pages, tuple)
    new = env.alloc.alloc(4)
    assert new is not None
    load = env.cache.start_load(env.cache.match(CacheKey([1, 2, 3, 4])), new)
    want = list(new)
    new[1] = 12345
    env.cache.load_done(load)
    assert env.cache.match(CacheKey([1, 2, 3, 4])).slots == want
    env.check()


def test_match_prefix_keeps_the_prefix_cache_contract() -> None:
    env = Env(policy="write_back")
    _, slots = env.put([1, 2, 3])
    r = env.cache.match_prefix(CacheKey([1, 2, 3, 4]))
    assert isinstance(r, MatchResult) and r.slots == slots and r.length == 3
    env.cache.lock(r.node)
    assert env.cache.protected_size == 3
    env.cache.unlock(r.node)
    with pytest.raises(ValueError):
        env.cache.unlock(r.node)
    with pytest.raises(TypeError):
        env.cache.lock(CacheHandle())
    env.offload([1, 2, 3])
    with pytest.raises(ValueError):
        env.cache.lock(r.node)  # host-only now: load it back first
    env.cache.evict_host(3)
    with pytest.raises(ValueError):
        env.cache.lock(r.node)  # stale: it left the tree
    env.check()


# -- prefetch decision and tracker ---------------------------------------------------------------


def test_should_prefetch_needs_a_gain_of_threshold_pages() -> None:
    assert should_prefetch(10, 4, 6) and not should_prefetch(10, 4, 7)
    assert not should_prefetch(4, 4, 0)  # no gain is never worth a round trip
    with pytest.raises(ValueError):
        should_prefetch(-1, 0, 1)


def _tracker(policy: StopPolicy, released: list[int]) -> PrefetchTracker:
    return PrefetchTracker(3, policy, now=0.0, timeout_s=1.0, release=released.append)


def test_tracker_best_effort_admits_at_once_and_releases_on_the_ack() -> None:
    released: list[int] = []
    t = _tracker("best_effort", released)
    assert t.may_admit(0.0)
    t.issue()
    t.on_done(2)
    assert released == [2] and t.arrived == 2
    with pytest.raises(DoubleAckError):
        t.on_done(2)
    assert released == [2]


def test_tracker_wait_complete_waits_for_the_ack() -> None:
    released: list[int] = []
    t = _tracker("wait_complete", released)
    t.issue()
    assert not t.may_admit(100.0) and not t.expire(100.0)
    t.on_done(3)
    assert t.may_admit(100.0) and released == [3]


def test_tracker_timeout_admits_at_the_deadline_and_releases_once() -> None:
    released: list[int] = []
    sent = _tracker("timeout", released)
    sent.issue()
    assert not sent.may_admit(0.5) and sent.may_admit(1.0)
    assert not sent.expire(2.0) and released == []  # sent: the worker may still be writing
    sent.on_done(1)
    assert released == [1]
    unsent = _tracker("timeout", released)
    assert not unsent.expire(0.5)
    assert unsent.expire(1.0) and released == [1, 0] and not unsent.should_issue
    assert not unsent.expire(5.0)
    unsent.abort()
    with pytest.raises(DoubleAckError):
        unsent.on_done(0)
    assert released == [1, 0]


def test_tracker_abort_releases_exactly_once() -> None:
    released: list[int] = []
    unsent = _tracker("wait_complete", released)
    unsent.abort()
    unsent.abort()
    assert released == [0] and not unsent.may_admit(9.0)
    with pytest.raises(ValueError):
        unsent.issue()
    sent = _tracker("best_effort", released)
    sent.issue()
    sent.abort()
    assert released == [0]  # waits for the worker's ack
    sent.on_done(3)
    assert released == [0, 3] and not sent.may_admit(0.0)


def test_tracker_releases_the_caches_reservation() -> None:
    env = Env(page_size=2, l3=True)
    key = CacheKey([1, 2, 3, 4])
    job = env.cache.start_prefetch(key, env.cache.match(key), l3_pages=2)
    assert job is not None
    t = PrefetchTracker(2, "timeout", now=0.0, timeout_s=0.1, release=lambda n: env.cache.prefetch_done(job, n))
    assert env.cache.host_protected_size == 2
    assert t.expire(0.2)  # never sent: cancelled, pages back at once
    assert env.host.available == env.host.num_pages and env.cache.inflight_jobs == 0
    env.check()


# -- stateful: random operations moving fake bytes between the tiers -----------------------------

_BASES = [[0, 1, 0, 1, 1, 0, 1, 1, 0, 0, 1, 0], [0, 1, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 0, 1, 1, 1]]
Label = tuple[str, tuple[int, ...]]


@dataclass
class _Req:
    key: CacheKey
    node: CacheHandle
    match_len: int
    matched: list[int]
    own: list[int]


class HiCacheMachine(RuleBasedStateMachine):
    """Device slots, host pages and L3 entries hold fake bytes: the label (extra, prefix through
    this token) of the token they store. Requests write labels into their own slots, acknowledged
    jobs copy them between tiers as the worker would, and every match must serve the right labels
    from the device and from the host."""

    @initialize(
        page_size=st.sampled_from([1, 2]),
        policy=st.sampled_from(WRITE_POLICIES),
        l3=st.booleans(),
        limit=st.sampled_from([1, 3, 64]),
        eviction=st.sampled_from(["lru", "lfu"]),
    )
    def setup(self, page_size: int, policy: WritePolicy, l3: bool, limit: int, eviction: EvictionPolicy) -> None:
        self.ps = page_size
        self.alloc = SlotAllocator(32, page_size)
        self.host = HostPageAllocator(12 // page_size)
        self.cache = HiRadixCache(
            page_size, self.alloc.free, self.host, NS, write_policy=policy, eviction=eviction, l3=l3,
            max_inflight_jobs=limit,
        )  # fmt: skip
        self.limit = limit
        self.dev: dict[int, Label] = {}
        self.hostmem: dict[int, tuple[Label, ...]] = {}
        self.l3: dict[bytes, tuple[Label, ...]] = {}
        self.reqs: list[_Req] = []
        self.jobs: list[Job] = []
        self.acked: Job | None = None

    @staticmethod
    def label(key: CacheKey, i: int) -> Label:
        return (key.extra, tuple(key.tokens[: i + 1]))

    def check_match(self, key: CacheKey, m: HiMatch) -> None:
        assert all(self.dev[s] == self.label(key, i) for i, s in enumerate(m.slots))
        for j, p in enumerate(m.host_pages):
            start = m.length + j * self.ps
            assert self.hostmem[p] == tuple(self.label(key, start + t) for t in range(self.ps))

    def take_slots(self, n: int) -> list[int] | None:
        own = self.alloc.alloc(n)
        if own is None:
            self.cache.evict(self.alloc.round_up(n) - self.alloc.available)
            own = self.alloc.alloc(n)
        return own

    tokens = st.builds(
        lambda base, cut, tail: base[:cut] + tail,
        st.sampled_from(_BASES),
        st.integers(1, 12),
        st.lists(st.integers(0, 1), max_size=3),
    )
    extras = st.sampled_from(["", "x"])

    @rule(tokens=tokens, extra=extras)
    def admit(self, tokens: list[int], extra: str) -> None:
        key = CacheKey(tokens, extra)
        m = self.cache.match(key)
        self.check_match(key, m)
        self.cache.lock(m.node)
        need = len(tokens) - m.length
        own = self.take_slots(need)
        if own is None:
            self.cache.unlock(m.node)
            return
        for i in range(need):
            self.dev[own[i]] = self.label(key, m.length + i)  # the forward pass writes its KV
        self.reqs.append(_Req(key, m.node, m.length, m.slots, own))

    @precondition(lambda self: bool(self.reqs))
    @rule(pick=st.integers(0, 1 << 16))
    def finish(self, pick: int) -> None:
        r = self.reqs.pop(pick % len(self.reqs))
        n, m = len(r.key.tokens), r.match_len
        cached = self.cache.insert(r.key, r.matched + r.own[: n - m])
        assert cached >= m
        self.alloc.free(r.own[: cached - m] + r.own[self.cache.aligned_len(n) - m :])
        self.cache.unlock(r.node)

    @rule(tokens=tokens, extra=extras)
    def load_back(self, tokens: list[int], extra: str) -> None:
        key = CacheKey(tokens, extra)
        m = self.cache.match(key)
        self.check_match(key, m)
        if not m.host_len:
            return
        slots = self.take_slots(m.host_len)
        if slots is None:
            return
        m = self.cache.match(key)  # taking slots may have evicted: match again, as the batcher must
        if m.host_len != len(slots):
            self.alloc.free(slots)
            return
        job = self.cache.start_load(m, slots)
        assert list(job.host_pages) == m.host_pages
        self.jobs.append(job)

    @rule(tokens=tokens, extra=extras, load=st.booleans())
    def serve(self, tokens: list[int], extra: str, load: bool) -> None:
        """A whole request: match, load back the host part (or recompute it), compute, insert."""
        key = CacheKey(tokens, extra)
        m = self.cache.match(key)
        self.check_match(key, m)
        if load and m.host_len and (slots := self.alloc.alloc(m.host_len)) is not None:
            job = self.cache.start_load(m, slots)
            self.finish_job(job, ok=True)
            m = self.cache.match(key)
            self.check_match(key, m)
            assert m.node is job.node or m.length > len(job.slots)
        self.cache.lock(m.node)
        need = len(tokens) - m.length
        own = self.take_slots(need)
        if own is not None:
            for i in range(need):
                self.dev[own[i]] = self.label(key, m.length + i)
            self.reqs.append(_Req(key, m.node, m.length, m.slots, own))
            self.finish(len(self.reqs) - 1)
        else:
            self.cache.unlock(m.node)

    @rule(ok=st.integers(0, 5).map(lambda x: x != 0))
    def drain(self, ok: bool) -> None:
        """The worker runs every job handed out so far (the common case: one step later)."""
        self.jobs.extend(self.cache.take_jobs())
        while self.jobs:
            self.finish_job(self.jobs.pop(0), ok)

    @rule(tokens=tokens, extra=extras)
    def prefetch(self, tokens: list[int], extra: str) -> None:
        key = CacheKey(tokens, extra)
        m = self.cache.match(key)
        self.check_match(key, m)
        hashes = self.cache.l3_keys(key, m)
        hit = next((i for i, h in enumerate(hashes) if h not in self.l3), len(hashes))  # Exists
        job = self.cache.start_prefetch(key, m, m.local_len // self.ps + hit)
        if job is not None:
            assert list(job.hashes) == hashes[: len(job.hashes)]
            self.jobs.append(job)

    @rule()
    def take(self) -> None:
        self.jobs.extend(self.cache.take_jobs())

    @precondition(lambda self: bool(self.jobs))
    @rule(pick=st.integers(0, 1 << 16), ok=st.integers(0, 3).map(lambda x: x != 0))
    def ack(self, pick: int, ok: bool) -> None:
        job = self.jobs.pop(pick % len(self.jobs))
        self.finish_job(job, ok)
        self.acked = job

    def finish_job(self, job: Job, ok: bool) -> None:
        ps, c = self.ps, self.cache
        if isinstance(job, BackupJob):
            if ok:
                for j, p in enumerate(job.host_pages):
                    self.hostmem[p] = tuple(self.dev[s] for s in job.slots[j * ps : (j + 1) * ps])
            before = self.alloc.available
            freed = c.backup_done(job) if ok else c.backup_failed(job)
            assert self.alloc.available == before + freed
        elif isinstance(job, LoadJob):
            if ok:
                for j, p in enumerate(job.host_pages):
                    for t in range(ps):
                        self.dev[job.slots[j * ps + t]] = self.hostmem[p][t]
                c.load_done(job)
            else:
                c.load_failed(job)
        elif isinstance(job, PutJob):
            if ok:
                for h, p in zip(job.hashes, job.host_pages, strict=True):
                    self.l3[h] = self.hostmem[p]
            c.put_done(job) if ok else c.put_failed(job)
        else:
            arrived = 0
            while ok and arrived < len(job.hashes) and job.hashes[arrived] in self.l3:
                self.hostmem[job.host_pages[arrived]] = self.l3[job.hashes[arrived]]
                arrived += 1
            c.prefetch_done(job, arrived)

    @precondition(lambda self: self.acked is not None)
    @rule(ok=st.booleans())
    def double_ack(self, ok: bool) -> None:
        job, c = self.acked, self.cache
        with pytest.raises(DoubleAckError):  # no bytes move: the worker ran the op once
            if isinstance(job, BackupJob):
                c.backup_done(job) if ok else c.backup_failed(job)
            elif isinstance(job, LoadJob):
                c.load_done(job) if ok else c.load_failed(job)
            elif isinstance(job, PutJob):
                c.put_done(job) if ok else c.put_failed(job)
            elif isinstance(job, PrefetchJob):
                c.prefetch_done(job, 0)

    @rule(n=st.integers(0, 24))
    def evict(self, n: int) -> None:
        c = self.cache
        quiet = not self.jobs and c.inflight_jobs == 0
        before = c.evictable_size
        ev = c.evict_device(n)
        assert c.evictable_size == before - ev.freed - ev.pending
        # Never a silent stall: with nothing in flight, evicting frees, backs up, or starts the put
        # a full host pool needs first (write_back + L3), whose ack lets the next call proceed.
        assert not (quiet and n and before) or ev.freed + ev.pending > 0 or c.inflight_jobs > 0

    @rule(n=st.integers(0, 12))
    def evict_host(self, n: int) -> None:
        c = self.cache
        quiet = not self.jobs and c.inflight_jobs == 0
        before = c.host_evictable_size
        ev = c.evict_host(n)
        # A put pins its path: host-only ancestors of a page being put stop being evictable too.
        assert c.host_evictable_size <= before - ev.freed - ev.pending
        assert not (quiet and n and before) or ev.freed + ev.pending > 0 or c.inflight_jobs > 0

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "cache"):
            return
        c = self.cache
        c.sanity_check(check_hashes=True)
        held = sum(len(r.own) for r in self.reqs)
        assert self.alloc.available + c.evictable_size + c.protected_size + held == self.alloc.size
        assert self.host.available + c.host_evictable_size + c.host_protected_size == self.host.num_pages
        assert c.inflight_jobs <= self.limit

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        while self.reqs:
            self.finish(0)
        c = self.cache
        for _ in range(100):
            self.jobs.extend(c.take_jobs())
            while self.jobs:
                self.finish_job(self.jobs.pop(), ok=True)
            if c.total_size() == 0 and c.host_evictable_size + c.host_protected_size == 0:
                break
            c.evict_device(self.alloc.size)
            c.evict_host(self.host.num_pages)
        c.sanity_check()
        assert self.alloc.available == self.alloc.size and self.host.available == self.host.num_pages


HiCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=80, deadline=None)
test_hicache_machine = HiCacheMachine.TestCase
