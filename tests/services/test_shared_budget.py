"""Two workers (two models: dense Qwen3 and hybrid Qwen3-Next) under one memory budget shared
through a real etcd (``BudgetLedger``): each grows when busy and gives memory back when idle, the
other grows into what was given back, and the pools' committed bytes together never pass the
budget. Outputs stay equal to transformers."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from services.scheduler.budget_ledger import BudgetLedger
from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.worker_link import InProcessWorkerLink
from services.worker.engine import Engine
from tests import sched_harness as h
from tests.reference import hf_greedy

OUT = 16


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(60, 140))] for _ in range(n)]


def _committed(eng: Engine) -> int:
    return eng.kv.committed_bytes + (eng.mamba.committed_bytes if eng.mamba is not None else 0)


def test_two_workers_share_one_budget(tiny_qwen3: Path, tiny_qwen3_next: Path, etcd_endpoint: str) -> None:
    kv_a = h.engine(tiny_qwen3, kv_cache_bytes=1 << 16, max_rows=2).info.bytes_per_slot
    probe = h.engine(tiny_qwen3_next, kv_cache_bytes=1 << 16, max_rows=2).info
    kv_b, m_b = probe.bytes_per_slot, probe.bytes_per_mamba_slot
    # Both start at their minimums (256 KV slots, 1 state) and may reserve far more than the budget.
    a = h.engine(tiny_qwen3, kv_cache_bytes=256 * kv_a, max_rows=16, kv_max_bytes=4096 * kv_a)
    b = h.engine(tiny_qwen3_next, kv_cache_bytes=256 * kv_b, max_rows=16, mamba_slots=8,
                 kv_max_bytes=4096 * kv_b, mamba_max_slots=64)
    total = 500 * kv_a + 500 * kv_b + 24 * m_b
    cfg = LoopConfig(max_prefill_tokens=256, elastic_budget_bytes=total, elastic_idle_s=0.3, elastic_min_kv_slots=256)
    # Five waves of 16 requests per phase: long enough for the budget to move (ledger syncs every
    # 50 ms; an idle scheduler re-plans every 0.5 s and counts as idle after 0.3 s).
    pa, pb = _prompts(a.info.vocab_size, 80, 1), _prompts(b.info.vocab_size, 80, 2)
    samples: list[tuple[str, int, int]] = []  # (phase, committed A, committed B)
    phase = "start"

    async def sample(stop: asyncio.Event) -> None:
        while not stop.is_set():
            samples.append((phase, _committed(a), _committed(b)))
            await asyncio.sleep(0.01)

    async def waves(loop: SchedulerLoop, name: str, prompts: list[list[int]]) -> list[h.Outcome]:
        outs: list[h.Outcome] = []
        for w in range(0, len(prompts), 16):
            batch = prompts[w : w + 16]
            outs += await asyncio.gather(*(h.one(loop, f"{name}{w + i}", h.Spec(p, OUT)) for i, p in enumerate(batch)))
        return outs

    async def main() -> tuple[list[h.Outcome], list[h.Outcome], dict[str, int]]:
        nonlocal phase
        ledgers = [BudgetLedger(etcd_endpoint, "pair", m, total, period_s=0.05) for m in ("a", "b")]
        loops = [SchedulerLoop(cfg, ledger=lg) for lg in ledgers]
        stop = asyncio.Event()
        for lg in ledgers:
            await lg.start()
        for loop, eng in zip(loops, (a, b), strict=True):
            loop.attach(InProcessWorkerLink(eng))
        tasks = [asyncio.create_task(loop.run(stop)) for loop in loops] + [asyncio.create_task(sample(stop))]
        try:
            await asyncio.sleep(0.5)
            phase = "a busy"
            outs_a = await waves(loops[0], "a", pa)
            phase = "b busy"
            outs_b = await waves(loops[1], "b", pb)
            phase = "idle"
            await asyncio.sleep(1.5)
            claims, _ = await ledgers[0].read()
            return list(outs_a), list(outs_b), {m: e.claim for m, e in claims.items()}
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            for loop in loops:
                if loop.link is not None:
                    await loop.link.close()
            for lg in ledgers:
                await lg.stop()

    outs_a, outs_b, claims = asyncio.run(main())
    for p, o in zip(pa, outs_a, strict=True):
        assert o.ids == hf_greedy(tiny_qwen3, p, OUT, stop_at_eos=False)
    for p, o in zip(pb, outs_b, strict=True):
        assert o.ids == hf_greedy(tiny_qwen3_next, p, OUT, stop_at_eos=False)

    worst = max(x + y for _, x, y in samples)
    assert worst <= total, (worst, total)
    start_a = max(x for ph, x, _ in samples if ph == "start")
    start_b = max(y for ph, _, y in samples if ph == "start")
    peak_a = max(x for ph, x, _ in samples if ph == "a busy")
    peak_b = max(y for ph, _, y in samples if ph == "b busy")
    end_a = samples[-1][1]
    end_b = samples[-1][2]
    print(f"total {total}: A start {start_a} peak {peak_a} end {end_a}; B start {start_b} peak {peak_b} "
          f"end {end_b}; worst sum {worst}; claims {claims}")
    assert peak_a > start_a and peak_b > start_b  # each grew when busy
    assert peak_a + peak_b > total  # B grew into bytes A had given back: neither could hold both peaks
    assert end_a < peak_a and end_b < peak_b  # and each gave memory back once idle
    assert sum(claims.values()) <= total
