"""Attention paths on the bench model's shapes, against the floor of this machine measured in the same run.

    python benchmarks/attention_micro.py            # or: make bench-attention

One layer (Hq 8, Hkv 4, D 64, fp32). Decode: 64 requests in 4 groups sharing a 512-slot prefix plus
64-slot tails, and 64 unrelated requests of 288 slots (a 256-slot contiguous prompt, then scattered
decode slots, as the allocator hands them out). Prefill: one cold prompt of 1,024 and 4,096 tokens.
Paths: the torch reference (whole rows gathered token by token, padded), the fast CPU path without
groups (``flat``: runs read in place, the rest gathered, or the native paged kernel) and with them
(``cascade``). Floor = max(FLOPs / GEMM rate, bytes of distinct K/V read / copy rate). Medians of 7.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import native
from kernels.attention.cpu import plan_attention, run_attention
from kernels.attention.prefix_groups import find_prefix_groups
from kernels.attention.reference import decode_attention_torch, extend_attention_torch
from services.bench.speed import machine_rates, median_time
from services.worker.host_malloc import keep_large_blocks_on_heap

HQ, HKV, D = 8, 4, 64
SCALE = D**-0.5


def timed(fn, repeats: int = 7) -> float:  # type: ignore[no-untyped-def]
    return median_time(fn, repeats)


def decode_case(shared: bool) -> tuple[torch.Tensor, list[int], list[int], int]:
    """(slot table, rows, seq lens, distinct slots) of 64 decodes."""
    table = torch.zeros(64, 1024, dtype=torch.int64)
    lens, distinct, nxt = [], 0, 0
    if shared:
        heads = [torch.arange(g * 600, g * 600 + 512) for g in range(4)]
        distinct = 4 * 512
        nxt = 4 * 600
    for b in range(64):
        if shared:
            table[b, :512] = heads[b % 4]
            table[b, 512:576] = torch.arange(nxt, nxt + 64)
            nxt += 64
            lens.append(576)
            distinct += 64
        else:
            table[b, :256] = torch.arange(nxt, nxt + 256)
            nxt += 256
            table[b, 256:288] = torch.arange(100_000 + b, 100_000 + b + 64 * 32, 64)  # one decode slot per step
            lens.append(288)
            distinct += 288
    return table, list(range(64)), lens, distinct


def decode_rows(
    name: str, shared: bool, k_cache: torch.Tensor, v_cache: torch.Tensor, gflops: float, gbs: float
) -> None:
    table, rows, lens, distinct = decode_case(shared)
    q = torch.randn(64, HQ, D)
    starts = [n - 1 for n in lens]
    new = torch.stack([table[r, n - 1] for r, n in zip(rows, lens, strict=True)])
    k_new, v_new = k_cache[new], v_cache[new]
    flops = 4 * HQ * D * sum(lens)
    floor = max(flops / gflops / 1e9, distinct * 2 * HKV * D * 4 / gbs / 1e9)
    paths: dict[str, Callable[[], object]] = {
        "reference": lambda: decode_attention_torch(q, k_cache, v_cache, table, torch.tensor(rows),
                                                    torch.tensor(lens), SCALE),
    }
    for label, grouped, nat in (("flat, gathered", False, False), ("flat, native", False, True),
                                ("cascade, gathered", True, False), ("cascade, native", True, True)):
        if nat and native.load() is None:
            continue
        groups = find_prefix_groups(table, rows, starts) if grouped else None
        plan = plan_attention(table, rows, starts, [1] * 64, groups, nat)
        paths[label] = partial(run_attention, plan, q, k_new, v_new, k_cache, v_cache, SCALE)
    for label, fn in paths.items():
        t = timed(fn)
        print(f"| {name} | {label} | {t * 1e3:.2f} | {floor * 1e3:.2f} | {t / floor:.2f} |")
    t_find = timed(lambda: find_prefix_groups(table, rows, starts))
    t_plan = timed(lambda: plan_attention(table, rows, starts, [1] * 64, find_prefix_groups(table, rows, starts),
                                          native.load() is not None))
    print(f"| {name} | finding the groups (once per step) | {t_find * 1e3:.2f} | | |")
    print(f"| {name} | groups + plan (once per step) | {t_plan * 1e3:.2f} | | |")


def main() -> None:
    keep_large_blocks_on_heap()
    gflops, gbs = machine_rates()
    print(f"machine: fp32 GEMM {gflops:.0f} GFLOP/s, copy {gbs:.1f} GB/s, torch threads {torch.get_num_threads()}, "
          f"native paged decode {'built' if native.load() is not None else 'unavailable'}")
    slot_bytes = 2 * HKV * D * 4  # K and V of one token in one layer
    k_cache, v_cache = torch.randn(200_000, HKV, D), torch.randn(200_000, HKV, D)
    print("\n| case | path | ms | floor ms | x floor |\n|---|---|---:|---:|---:|")
    for name, shared in (("decode, 4 groups x 16 on 512 + 64", True), ("decode, 64 x 288 unrelated", False)):
        decode_rows(name, shared, k_cache, v_cache, gflops, gbs)
    for n in (1024, 4096):
        table = torch.arange(1, n + 1, dtype=torch.int64)[None]
        q, k_new, v_new = torch.randn(n, HQ, D), k_cache[1 : n + 1], v_cache[1 : n + 1]
        flops = 2 * HQ * D * n * n  # causal: half of 4 * n * n per head
        floor = max(flops / gflops / 1e9, n * slot_bytes / gbs / 1e9)
        plan = plan_attention(table, [0], [0], [n], None)
        for label, fn in (
            ("reference", lambda n=n, q=q, table=table: extend_attention_torch(
                q, k_cache, v_cache, table, torch.tensor([0]), torch.tensor([0]), torch.tensor([n]), SCALE)),
            ("fast (flash, causal)", lambda plan=plan, q=q, k_new=k_new, v_new=v_new: run_attention(
                plan, q, k_new, v_new, k_cache, v_cache, SCALE)),
        ):
            t = timed(fn, 3)
            print(f"| prefill, cold {n} tokens | {label} | {t * 1e3:.1f} | {floor * 1e3:.1f} | {t / floor:.2f} |")


if __name__ == "__main__":
    main()
