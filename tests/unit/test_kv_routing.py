"""KV-aware routing, in one process: the scheduler's cache event log over a real prefix tree, the
router's index kept from its batches, and the routing policies (issue #20)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.page_hash import HashNamespace, PageKeying, page_hashes
from services.scheduler.cache_events import Batch, CacheEventLog
from services.scheduler.memory.allocator import SlotAllocator
from services.scheduler.memory.base import CacheKey
from services.scheduler.memory.tree import PrefixTree
from services.tokenizer import kv_index
from services.tokenizer.kv_index import Chooser, KvIndex

KEYING = RKEYING = PageKeying(16, "fp-test", "device")


class Replica:
    """A tree and allocator as the scheduler wires them, with the event log following the tree."""

    def __init__(self, size: int = 1024, queue_batches: int = 256) -> None:
        self.alloc = SlotAllocator(size, 1)
        self.tree = PrefixTree(1, self.alloc.free)
        self.log = CacheEventLog(queue_batches)
        self.log.attach(KEYING)
        self.tree.on_event = self.log.on_tree_event

    def put(self, tokens: list[int], salt: str = "") -> None:
        own = self.alloc.alloc(len(tokens))
        assert own is not None
        cached = self.tree.insert(CacheKey(tokens, salt), own)
        self.alloc.free(own[:cached])

    def evict_all(self) -> None:
        self.tree.evict(self.tree.evictable_size)


def keys(tokens: list[int], salt: str = "") -> list[bytes]:
    return page_hashes(tokens, 16, HashNamespace("fp-test", "device", cache_salt=salt))


def feed(index: KvIndex, address: str, log: CacheEventLog, batches: list[Batch]) -> bool:
    ok = True
    for b in batches:
        ok = ok and index.apply(
            address, epoch=log.epoch, event_id=b.event_id, snapshot=b.snapshot, stored=b.stored, removed=b.removed,
            keying=RKEYING if b.snapshot else None,
        )
    return ok


def test_events_name_the_pages_the_tree_gains_and_loses() -> None:
    async def run() -> None:
        r = Replica()
        sub = r.log.subscribe()
        assert r.log.take(sub) == [Batch(0, [], [], snapshot=True)]  # a new subscriber starts from a snapshot
        a = list(range(100, 140))  # 40 tokens: 2 whole pages
        r.put(a)
        await asyncio.sleep(0)  # the flush runs soon after the change
        (b,) = r.log.take(sub)
        assert (b.event_id, b.snapshot, b.stored, b.removed) == (1, False, keys(a), [])
        r.put(a + list(range(200, 230)))  # extends the same path: pages 2 and 3 only
        await asyncio.sleep(0)
        (b,) = r.log.take(sub)
        assert b.event_id == 2 and b.stored == keys(a + list(range(200, 230)))[2:]
        r.evict_all()
        await asyncio.sleep(0)
        (b,) = r.log.take(sub)
        assert b.event_id == 3 and sorted(b.removed) == sorted(keys(a + list(range(200, 230))))
        assert r.log.cached_pages == 0

    asyncio.run(run())


def test_the_router_index_follows_the_stream_and_predicts_the_overlap() -> None:
    async def run() -> None:
        r = Replica()
        index = KvIndex()
        sub = r.log.subscribe()
        system = list(range(1000, 1064))  # a 64-token system prompt: 4 pages
        r.put([*system, 5, 6, 7])
        await asyncio.sleep(0)
        assert feed(index, "a:1", r.log, r.log.take(sub))
        prompt = system + list(range(7000, 7100))
        assert index.overlaps(["a:1", "b:1"], prompt, "") == {"a:1": 64, "b:1": 0}
        # Salts never match each other's pages.
        assert index.overlaps(["a:1"], prompt, "tenant-2") == {"a:1": 0}
        r.put([*system, 5, 6, 7], salt="tenant-2")
        await asyncio.sleep(0)
        assert feed(index, "a:1", r.log, r.log.take(sub))
        assert index.overlaps(["a:1"], prompt, "tenant-2") == {"a:1": 64}
        # The index holds exactly what the scheduler holds.
        assert index.replicas["a:1"].pages == set(r.log.take(r.log.subscribe())[0].stored)
        r.evict_all()
        await asyncio.sleep(0)
        assert feed(index, "a:1", r.log, r.log.take(sub))
        assert index.overlaps(["a:1"], prompt, "") == {"a:1": 0} and index.pages == 0

    asyncio.run(run())


def test_a_gap_or_a_new_epoch_clears_the_replica_until_a_snapshot() -> None:
    async def run() -> None:
        r = Replica()
        index = KvIndex()
        sub = r.log.subscribe()
        r.put(list(range(64)))
        await asyncio.sleep(0)
        assert feed(index, "a:1", r.log, r.log.take(sub))
        r.put(list(range(500, 532)))
        await asyncio.sleep(0)
        r.log.take(sub)  # lost on the way
        r.put(list(range(900, 932)))
        await asyncio.sleep(0)
        assert not feed(index, "a:1", r.log, r.log.take(sub))  # id 3 after 1: a gap
        assert index.pages == 0 and index.replicas["a:1"].keying is None
        assert not index.apply("a:1", epoch=r.log.epoch, event_id=4, snapshot=False, stored=[b"x" * 32], removed=[])
        again = r.log.subscribe()  # what the router does: subscribe again
        assert feed(index, "a:1", r.log, r.log.take(again))
        assert index.pages == r.log.cached_pages == 4 + 2 + 2
        assert not index.apply("a:1", epoch=r.log.epoch + 1, event_id=9, snapshot=False, stored=[], removed=[])

    asyncio.run(run())


def test_a_slow_subscriber_gets_a_snapshot_not_a_backlog() -> None:
    async def run() -> None:
        r = Replica(size=4096, queue_batches=4)
        sub = r.log.subscribe()
        r.log.take(sub)
        for i in range(10):  # ten batches, nobody reading
            r.put(list(range(i * 1000, i * 1000 + 32)))
            await asyncio.sleep(0)
        assert len(sub.queue) <= 4
        out = r.log.take(sub)
        assert out[0].snapshot and len(out) == 1 and len(out[0].stored) == 20 and out[0].event_id == 10
        index = KvIndex()
        assert feed(index, "a:1", r.log, out) and index.pages == 20

    asyncio.run(run())


def test_load_only_messages_do_not_count_as_gaps() -> None:
    index = KvIndex()
    assert index.apply("a:1", epoch=7, event_id=3, snapshot=True, stored=[b"k" * 32], removed=[], keying=RKEYING)
    assert index.apply("a:1", epoch=7, event_id=3, snapshot=False, stored=[], removed=[])
    assert index.apply("a:1", epoch=7, event_id=4, snapshot=False, stored=[], removed=[b"k" * 32])
    assert index.pages == 0


def _index_with(pages: dict[str, list[bytes]]) -> KvIndex:
    index = KvIndex()
    for address, ks in pages.items():
        index.apply(address, epoch=1, event_id=1, snapshot=True, stored=ks, removed=[], keying=RKEYING)
    return index


def test_kv_policy_prefers_the_cache_until_the_load_outweighs_it() -> None:
    conv = list(range(3000, 3000 + 512))
    index = _index_with({"a:1": keys(conv), "b:1": [], "c:1": []})
    chooser = Chooser(index, "kv", load_weight=32)
    prompt = conv + list(range(9000, 9040))
    c = chooser.choose(["a:1", "b:1", "c:1"], prompt)
    assert (c.address, c.overlap_tokens) == ("a:1", 512)
    # Queued prefill on a outweighs what its cache saves: go elsewhere.
    # Recomputing the 552 tokens elsewhere weighs 2 x 552; staying weighs 2 x 40 + a's load.
    index.replicas["a:1"].sent_tokens = 900  # prefill this router sent a and is not started
    assert chooser.choose(["a:1", "b:1", "c:1"], prompt).address == "a:1"
    index.replicas["a:1"].sent_tokens = 1200
    assert chooser.choose(["a:1", "b:1", "c:1"], prompt).address in ("b:1", "c:1")
    index.replicas["a:1"].sent_tokens = 0
    index.replicas["a:1"].running = 40  # 1,280 tokens' worth of requests in flight
    assert chooser.choose(["a:1", "b:1", "c:1"], prompt).address != "a:1"


def test_ties_are_spread_and_the_other_policies_ignore_the_cache() -> None:
    conv = list(range(512))
    index = _index_with({"a:1": keys(conv), "b:1": []})
    kv = Chooser(index, "kv")
    fresh = [list(range(5000 + 100 * i, 5100 + 100 * i)) for i in range(4)]  # cached nowhere: ties
    assert {kv.choose(["a:1", "b:1"], p).address for p in fresh} == {"a:1", "b:1"}
    rr = Chooser(index, "round_robin")
    assert [rr.choose(["a:1", "b:1"], conv).address for _ in range(4)] == ["a:1", "b:1", "a:1", "b:1"]
    least = Chooser(index, "least_load")
    index.replicas["a:1"].running = 1
    assert {least.choose(["a:1", "b:1"], conv).address for _ in range(4)} == {"b:1"}
    with pytest.raises(ValueError, match="router policy"):
        Chooser(index, "random")  # type: ignore[arg-type]


def test_overlap_never_claims_the_whole_prompt() -> None:
    conv = list(range(64))
    index = _index_with({"a:1": keys(conv)})
    assert index.overlaps(["a:1"], conv, "") == {"a:1": 63}


def test_a_routed_prompt_is_expected_where_it_went_until_its_events_arrive() -> None:
    """Requests sharing a prefix sent at once follow the first one (its pages are not reported yet:
    the replica has not prefilled them), and the expectation ends after EXPECT_S."""
    index = _index_with({"a:1": [], "b:1": [], "c:1": []})
    kv = Chooser(index, "kv")
    system = list(range(7000, 7000 + 512))
    first = kv.choose(["a:1", "b:1", "c:1"], [*system, 1, 2, 3], now=100.0)
    assert first.overlap_tokens == 0
    # What the router does: the first is queued there (515 uncached tokens, not started); that
    # queued work computes the prefix the others need, so it does not push them elsewhere.
    index.replicas[first.address].sent_tokens += 515
    index.replicas[first.address].sent_running += 1
    for i in range(3):
        c = kv.choose(["a:1", "b:1", "c:1"], system + [10 + i] * 5, now=100.5)
        assert (c.address, c.overlap_tokens) == (first.address, 512)
        index.replicas[first.address].sent_tokens += 5
        index.replicas[first.address].sent_running += 1
    later = kv.choose(["a:1", "b:1", "c:1"], [*system, 99], now=100.0 + kv_index.EXPECT_S + 1)
    assert later.overlap_tokens == 0  # expired: nothing reported it since
    rr = Chooser(_index_with({"a:1": [], "b:1": []}), "round_robin")
    assert len({rr.choose(["a:1", "b:1"], system, now=1.0).address for _ in range(2)}) == 2
