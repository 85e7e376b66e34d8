"""Smoke test of the replicas benchmark (``benchmarks.replicas``) on the tiny model with two
replicas, and of its router-cost microbenchmark at a small size. Timings are not checked: they are
the benchmark's business. What is: the report has its shape, every request is accounted for per
replica, and on a shared-prefix trace that round-robin scatters KV-aware routing reuses more."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import replicas

CLIENTS, TURNS = 2, 2
GROUPS, PER_GROUP, SYSTEM = 3, 6, 256


def test_kv_routing_reuses_more_than_round_robin(tiny_qwen3: Path, tmp_path: Path) -> None:
    out = tmp_path / "replicas.json"
    rc = replicas.main([
        "--model", str(tiny_qwen3), "--replicas", "2", "--setups", "kv,round_robin", "--repeats", "1",
        "--clients", str(CLIENTS), "--turns", str(TURNS), "--turn-tokens", "100", "--answer-tokens", "4",
        # Three groups over two replicas, one request at a time: round-robin sends every group to both
        # replicas (each computes each system prompt), kv sends a group's later requests to its holder.
        "--groups", str(GROUPS), "--group-requests", str(PER_GROUP), "--system-tokens", str(SYSTEM),
        "--user-tokens", "8", "--shared-concurrency", "1",
        "--router-pages", "1000", "--router-prompt-tokens", "160", "--router-lookups", "20",
        "--run-dir", str(tmp_path / "run"), "--out", str(out),
    ])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())

    runs = report["runs"]
    assert sorted((r["setup"], r["workload"]) for r in runs) == sorted(
        (s, w) for s in ("kv", "round_robin") for w in replicas.WORKLOADS
    )
    for r in runs:
        n = CLIENTS * TURNS if r["workload"] == "multi_turn" else GROUPS * PER_GROUP
        assert r["requests"] == n and r["failed"] == 0, r
        assert set(r["per_replica"]) == {"r0", "r1"} and sum(r["per_replica"].values()) == n, r
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"], r
        assert r["hit_rate"] == r["cached_tokens"] / r["prompt_tokens"], r
        assert r["output_tokens"] == n * 4 and r["output_tps"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0, r

    sums = {(s["setup"], s["workload"]): s for s in report["summaries"]}
    assert len(sums) == 4 and all(s["hit_vs_single"] is None for s in sums.values())  # no single setup
    kv, rr = sums[("kv", "shared_prefix")], sums[("round_robin", "shared_prefix")]
    assert kv["hit_rate"]["median"] > rr["hit_rate"]["median"], (kv, rr)
    # kv serves every later request of a group from its holder: the ideal reuse of one replica.
    shared_kv = next(r for r in runs if r["setup"] == "kv" and r["workload"] == "shared_prefix")
    assert shared_kv["cached_tokens"] >= shared_kv["ideal_tokens"] == GROUPS * (PER_GROUP - 1) * SYSTEM
    # Multi-turn: every later turn follows its conversation under kv.
    multi_kv = next(r for r in runs if r["setup"] == "kv" and r["workload"] == "multi_turn")
    assert multi_kv["cached_tokens"] >= multi_kv["ideal_tokens"] > 0

    # Only the throughput goal: the hit-rate goal needs the single setup.
    assert [(g["name"], g["workload"]) for g in report["goals"]] == [
        ("kv throughput / round_robin's", w) for w in replicas.WORKLOADS
    ]
    assert report["router_cost"]["pages"] == 1000 and report["router_cost"]["routed_to_holder"] == 1.0


def test_router_cost_fills_the_index_and_routes_each_prompt_to_its_holder() -> None:
    c = replicas.router_cost(pages=1000, replicas=3, prompt_tokens=160, lookups=30)
    assert (c.pages, c.replicas, c.prompt_tokens, c.lookups) == (1000, 3, 160, 30)
    assert c.routed_to_holder == 1.0
    timings = (c.snapshot_us_per_page, c.stored_us_per_page, c.removed_us_per_page, c.choose_hit_us,
               c.choose_miss_us, c.keys_us)  # fmt: skip
    assert all(0 < t < 1e6 for t in timings), c


def test_setups_and_sizes_are_checked() -> None:
    assert replicas.Setup.parse("round_robin+l3") == replicas.Setup("round_robin+l3", "round_robin", True)
    assert replicas.Setup.parse("single") == replicas.Setup("single", None, False)
    for bad in ("kv+l4", "random", "single+"):
        with pytest.raises(ValueError, match="setup"):
            replicas.Setup.parse(bad)
    with pytest.raises(ValueError, match="distinct"):
        replicas.ReplicasConfig(Path("m"), setups=("kv", "kv"))
    with pytest.raises(ValueError, match=">= 1"):
        replicas.ReplicasConfig(Path("m"), clients=0)
