"""Device ↔ host (L2) page copy throughput of ``HostPool``, against a raw torch copy of the same bytes.

    .venv/bin/python benchmarks/host_cache_copy.py [--layers 8] [--kv-heads 4] [--head-dim 64]
        [--page-size 16] [--dtype float32] [--pages 256] [--threads 0] [--device cpu]

The "device" pool is a ``KVPool`` on ``--device`` (the CPU by default, so both sides share DRAM).
Rows, in GB/s of page bytes moved (1 GB = 1e9 bytes), best of ``--repeats``:

- backup / load, pages in order: slots page-aligned and consecutive, host pages consecutive
- backup / load, pages scattered: the same pages in a shuffled order on both sides
- page_bytes → bytes / write_page: the L3 send and receive copies, one page at a time
- raw copy_: one contiguous ``dst.copy_(src)`` of the same byte count (the memory-bandwidth ceiling)
- raw gather: per layer and K/V, ``index_select`` of the slots (what a page-first layout must pay)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.worker.host_cache import HostPool  # noqa: E402
from services.worker.pools import KVPool  # noqa: E402


def best_of(repeats: int, fn: Callable[[], object], sync: Callable[[], None]) -> float:
    fn()  # warm up: first touch of fresh pages, allocator caches
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--pages", type=int, default=256, help="pages moved per operation")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = torch's default")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ps, n = args.page_size, args.pages

    # Twice the pages in each pool, so scattered runs have somewhere to scatter to.
    kv = KVPool(args.layers, 2 * n * ps, args.kv_heads, args.head_dim, dtype, device)
    for t in (*kv.k, *kv.v):
        t.normal_()
    host = HostPool(2 * n, ps, args.layers, args.kv_heads, args.head_dim, dtype, device.type == "cuda")
    total = n * host.bytes_per_page

    in_order_slots = list(range(n * ps))
    in_order_pages = list(range(n))
    rng = random.Random(0)
    dev_pages = rng.sample(range(2 * n), n)
    scattered_slots = [s for pg in dev_pages for s in range(pg * ps, pg * ps + ps)]
    scattered_pages = rng.sample(range(2 * n), n)
    blobs = [bytes(host.page_bytes(pg)) for pg in in_order_pages]

    src = torch.empty(total, dtype=torch.uint8, device=device).random_()
    dst = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    slot_idx = torch.tensor(scattered_slots, device=device)

    def l3_receive() -> None:
        for pg, blob in zip(in_order_pages, blobs, strict=True):
            host.write_page(pg, blob)

    def raw_gather() -> None:
        for t in (*kv.k, *kv.v):
            t.index_select(0, slot_idx)

    rows: list[tuple[str, Callable[[], object]]] = [
        ("backup, pages in order", lambda: host.backup(kv, in_order_slots, in_order_pages)),
        ("load, pages in order", lambda: host.load(kv, in_order_pages, in_order_slots)),
        ("backup, pages scattered", lambda: host.backup(kv, scattered_slots, scattered_pages)),
        ("load, pages scattered", lambda: host.load(kv, scattered_pages, scattered_slots)),
        ("page_bytes -> bytes (L3 send)", lambda: [bytes(host.page_bytes(pg)) for pg in in_order_pages]),
        ("write_page (L3 receive)", l3_receive),
        ("raw copy_ of the same bytes", lambda: dst.copy_(src)),
        ("raw gather (index_select only)", raw_gather),
    ]
    print(
        f"shape: L{args.layers} H{args.kv_heads} D{args.head_dim} P{ps} {args.dtype}, "
        f"{host.bytes_per_page // 1024} KiB/page, {n} pages = {total / 2**20:.0f} MiB per op, "
        f"device={device}, torch threads={torch.get_num_threads()}"
    )
    for name, fn in rows:
        secs = best_of(args.repeats, fn, sync)
        print(f"  {name:34s} {total / secs / 1e9:7.2f} GB/s   ({secs * 1e3:7.2f} ms)")


if __name__ == "__main__":
    main()
