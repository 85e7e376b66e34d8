"""Micro-benchmark of the radix prefix cache (and the slot allocator) on long prefixes.

    .venv/bin/python benchmarks/radix_micro.py [--lengths 1024 4096 32768] [--page-size 1]

Prints µs per call and tokens per µs (higher is better) for each operation and prefix length.
Keys are given both as list[int] (what a protobuf repeated field gives) and as array('i') (no
conversion inside the cache). Each figure is the best of several timed rounds.
"""

from __future__ import annotations

import argparse
import functools
import random
import timeit
from array import array
from collections.abc import Callable

from services.scheduler.memory.allocator import SlotAllocator
from services.scheduler.memory.base import CacheKey
from services.scheduler.memory.tree import PrefixTree


def _best_us(fn: Callable[[], object], number: int, rounds: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=rounds)) / number * 1e6


def _bench_length(n: int, page_size: int, rng: random.Random) -> list[tuple[str, float]]:
    alloc = SlotAllocator(4 * n, page_size)
    cache = PrefixTree(page_size, alloc.free)
    tokens = [rng.randrange(150_000) for _ in range(n)]
    packed = array("i", tokens)
    slots = alloc.alloc(n)
    assert slots is not None
    cache.insert(CacheKey(packed), slots)
    number = max(3, 200_000 // n)
    rows: list[tuple[str, float]] = []

    rows.append(("match hit, list key", _best_us(lambda: cache.match_prefix(CacheKey(tokens)), number)))
    rows.append(("match hit, array key", _best_us(lambda: cache.match_prefix(CacheKey(packed)), number)))
    half = array("i", packed)
    half[n // 2] = -1  # diverges mid-edge: the first call splits, later calls walk two nodes
    cache.match_prefix(CacheKey(half))
    rows.append(("match half hit, array key", _best_us(lambda: cache.match_prefix(CacheKey(half)), number)))
    dup = list(slots)
    rows.append(
        ("insert duplicate, array key", _best_us(lambda: cache.insert(CacheKey(packed), dup), number))
    )

    # A cold insert needs a fresh tree each time: time insert only, evict outside the clock.
    fresh = array("i", (rng.randrange(150_000) for _ in range(n)))
    other = alloc.alloc(n)
    assert other is not None
    best = float("inf")
    for _ in range(5):
        c = PrefixTree(page_size, lambda s: None)
        t = timeit.timeit(functools.partial(c.insert, CacheKey(fresh), other), number=1)
        best = min(best, t * 1e6)
    rows.append(("insert new, array key", best))

    cache.evict(4 * n)  # empty the tree into the allocator, then time the allocator alone
    alloc.free(other)

    def alloc_free() -> None:
        got = alloc.alloc(n)
        assert got is not None
        alloc.free(got)

    rows.append(("allocator alloc+free", _best_us(alloc_free, number)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 32768])
    parser.add_argument("--page-size", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"page_size={args.page_size}")
    print(f"{'operation':<30}{'tokens':>8}{'µs/call':>12}{'tokens/µs':>12}")
    for n in args.lengths:
        for name, us in _bench_length(n, args.page_size, rng):
            print(f"{name:<30}{n:>8}{us:>12.1f}{n / us:>12.1f}")


if __name__ == "__main__":
    main()
