"""Elastic pools driven by the scheduler loop against the real engine: the orchestrator's plans
travel as PoolResize ops, pools grow under load and give memory back when idle, live data and
greedy outputs (== transformers) are untouched, and the accounting holds throughout."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.worker.engine import Engine
from tests import sched_harness as h
from tests.reference import hf_greedy


def _skip_coarse_pages(eng: Engine, min_kv_slots: int) -> None:
    """These workloads use a few thousand KV slots: on a device whose commit unit is larger (CUDA VMM
    pages are 2 MiB, 16,384 slots of the tiny model) the pools cannot grow or shrink under them at
    all. The VMM pool itself is tested in tests/unit/test_elastic.py and test_engine_device.py."""
    if eng.info.slot_granularity > min_kv_slots:
        pytest.skip(f"the device's pool pages hold {eng.info.slot_granularity} KV slots ({eng.info.pool_page_bytes} "
                    f"bytes), more than this workload's minimum pool of {min_kv_slots}")


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(20, 120))] for _ in range(n)]


def test_hybrid_pools_grow_under_load_shrink_when_idle_and_outputs_equal_transformers(
    tiny_qwen3_next: Path,
) -> None:
    probe = h.engine(tiny_qwen3_next, kv_cache_bytes=1 << 16, max_rows=8)
    kv_b, m_b = probe.info.bytes_per_slot, probe.info.bytes_per_mamba_slot
    # Start small, reserve far more than the budget lets the loop use.
    eng = h.engine(tiny_qwen3_next, kv_cache_bytes=256 * kv_b, max_rows=8, mamba_slots=8,
                   kv_max_bytes=8192 * kv_b, mamba_max_slots=64)
    _skip_coarse_pages(eng, 128)
    assert eng.info.elastic and eng.info.max_slots >= 8192
    budget = 4096 * kv_b + 32 * m_b
    cfg = LoopConfig(max_prefill_tokens=64, elastic_budget_bytes=budget, elastic_idle_s=0.2, elastic_min_kv_slots=128)
    prompts = _prompts(eng.info.vocab_size, 12, seed=2)
    seen: dict[str, int] = {}

    async def body(loop: SchedulerLoop) -> list[h.Outcome]:
        assert loop.batcher is not None and loop.batcher.elastic is not None
        el = loop.batcher.elastic
        outs = await asyncio.gather(*(h.one(loop, f"r{i}", h.Spec(p, 8)) for i, p in enumerate(prompts)))
        seen["peak_kv"] = el.sent.kv_slots
        seen["busy_bytes"] = eng.kv.committed_bytes + eng.mamba.committed_bytes  # type: ignore[union-attr]
        await asyncio.sleep(1.5)  # idle: the loop gives memory back
        seen["idle_kv"] = el.sent.kv_slots
        seen["resizes"] = el.resizes
        seen["idle_bytes"] = eng.kv.committed_bytes + eng.mamba.committed_bytes  # type: ignore[union-attr]
        return list(outs)

    outs, loop = h.serve(eng, cfg, body)
    for p, o in zip(prompts, outs, strict=True):
        assert o.ids == hf_greedy(tiny_qwen3_next, p, 8, stop_at_eos=False)
    assert seen["resizes"] >= 2, seen
    assert seen["idle_kv"] < seen["peak_kv"] and seen["idle_bytes"] < seen["busy_bytes"], seen
    assert eng.kv.num_slots == seen["idle_kv"]  # the worker applied what the loop sent
    assert loop.batcher is not None
    loop.batcher.mem.check_idle()


def test_waiting_requests_without_a_free_row_do_not_size_the_pools(tiny_qwen3_next: Path) -> None:
    """A burst of 40 short requests on 8 rows after a long-prompt phase: only the 8 that can run
    at once are demand. The Mamba pool is sized for them (not for 40, whose states could never be
    used at once), and the KV pool, which has room for them, is not drained to pay for those
    states (the long prompts stay cached)."""
    probe = h.engine(tiny_qwen3_next, kv_cache_bytes=1 << 16, max_rows=8)
    kv_b, m_b = probe.info.bytes_per_slot, probe.info.bytes_per_mamba_slot
    rows = 8
    eng = h.engine(tiny_qwen3_next, kv_cache_bytes=256 * kv_b, max_rows=rows, mamba_slots=8,
                   kv_max_bytes=8192 * kv_b, mamba_max_slots=64)
    _skip_coarse_pages(eng, 256)
    budget = 1400 * kv_b + 48 * m_b
    # Idle shrinking is not this test's subject (the test above has it): a long idle timeout keeps a
    # slow machine's pause between the two phases from reading as idle and shrinking the KV pool.
    cfg = LoopConfig(max_prefill_tokens=256, elastic_budget_bytes=budget, elastic_idle_s=5.0, elastic_min_kv_slots=256)
    rng = random.Random(5)
    vocab = eng.info.vocab_size
    long = [[rng.randrange(3, vocab) for _ in range(200)] for _ in range(4)]
    short = [[rng.randrange(3, vocab) for _ in range(24)] for _ in range(40)]
    seen: dict[str, int] = {}

    async def body(loop: SchedulerLoop) -> list[h.Outcome]:
        assert loop.batcher is not None and loop.batcher.elastic is not None
        el = loop.batcher.elastic
        outs = list(await asyncio.gather(*(h.one(loop, f"l{i}", h.Spec(p, 8)) for i, p in enumerate(long))))
        seen["kv_after_long"] = el.sent.kv_slots
        peak = {"kv_low": el.sent.kv_slots, "states": el.sent.mamba_slots}

        async def watch() -> None:
            while True:
                peak["kv_low"] = min(peak["kv_low"], el.sent.kv_slots)
                peak["states"] = max(peak["states"], el.sent.mamba_slots)
                await asyncio.sleep(0)

        w = asyncio.create_task(watch())
        outs += await asyncio.gather(*(h.one(loop, f"s{i}", h.Spec(p, 4)) for i, p in enumerate(short)))
        w.cancel()
        seen.update(peak)
        seen["evicted"] = loop.batcher.mem.evicted
        seen["retractions"] = loop.batcher.retractions
        return outs

    outs, _ = h.serve(eng, cfg, body)
    assert all(o.finish == "length" for o in outs) and len(outs) == 44
    unit = eng.info.mamba_slot_granularity
    rows_with_headroom = -(-rows * 5 // 4)  # ElasticConfig's default headroom: 25 %
    assert seen["states"] <= -(-rows_with_headroom // unit) * unit, seen  # old: sized for 40 waiting (>= 32)
    assert seen["kv_low"] == seen["kv_after_long"] and seen["evicted"] == 0, seen
    assert seen["retractions"] == 0, seen
