"""Smoke test of the hierarchical-cache TTFT benchmark (``benchmarks.hicache``) on the tiny
models, dense and hybrid: every tier serves every prompt with the recomputed token, the counters
show that tier served it, and the JSON has its shape. Timings are not checked: they are the
benchmark's business, not a test's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks import hicache

PAGE = 16  # short prompts still span several host / L3 pages
LENGTHS = (40, 97)
REPEATS = 2
CHUNK = 32  # --max-prefill-tokens, hence a hybrid model's checkpoint grid


def _bench(model: Path, out: Path, lengths: tuple[int, ...]) -> tuple[int, dict[str, Any]]:
    rc = hicache.main([
        "--model", str(model), "--lengths", ",".join(map(str, lengths)), "--repeats", str(REPEATS),
        "--host-page-tokens", str(PAGE), "--max-prefill-tokens", str(CHUNK), "--kvstore", "inproc",
        "--timeout-s", "30", "--out", str(out),
    ])
    return rc, json.loads(out.read_text())


def test_every_tier_serves_the_recomputed_token(tiny_qwen3: Path, tmp_path: Path) -> None:
    rc, report = _bench(tiny_qwen3, tmp_path / "hicache.json", LENGTHS)
    assert rc == 0 and report["ok"]
    assert "first_resend" not in report

    samples = report["samples"]
    assert len(samples) == len(LENGTHS) * REPEATS * len(hicache.TIERS)
    for s in samples:
        cached = (s["length"] - 1) // PAGE * PAGE
        assert s["token_ok"] and s["tier_ok"], s
        assert "state_loads" not in s, s
        assert s["cached_tokens"] == (0 if s["tier"] == "recompute" else cached), s
        if s["tier"] == "l3":  # really fetched from the kvstore, then loaded
            assert s["prefetched_pages"] == s["worker_l3_pages"] == cached // PAGE > 0, s
            assert s["load_tokens"] == cached, s
        elif s["tier"] == "host":
            assert s["load_tokens"] == cached and s["prefetched_pages"] == 0, s
        else:
            assert s["load_tokens"] == s["prefetched_pages"] == 0, s
    # Distinct prompts: each repeat of a length starts cold, with nothing in L3.
    colds = [s for s in samples if s["tier"] == "recompute"]
    assert all(s["l3_pages"] == 0 for s in colds)

    rows = report["rows"]
    assert [r["length"] for r in rows] == list(LENGTHS)
    for r in rows:
        assert set(r["ttft_ms"]) == set(hicache.TIERS) and all(v > 0 for v in r["ttft_ms"].values())
        assert set(r["recompute_over"]) == {"device", "host", "l3"}
        assert r["cached"] == (r["length"] - 1) // PAGE * PAGE and r["ok"]


# 40 tokens reuse 32; 128 tokens (whole pages) reuse 112: the scheduler checkpoints the last page
# a resend can match, not only the prompt's end.
LENGTHS_HYBRID = (40, 128)


def test_hybrid_every_tier_serves_pages_and_state(tiny_qwen3_next: Path, tmp_path: Path) -> None:
    rc, report = _bench(tiny_qwen3_next, tmp_path / "hicache-hybrid.json", LENGTHS_HYBRID)
    assert rc == 0 and report["ok"]

    samples = report["samples"]
    order = ["recompute", "device", "host", "l3"]
    assert [s["tier"] for s in samples] == order * (len(LENGTHS_HYBRID) * REPEATS)
    for s in samples:
        tier, cached = s["tier"], (s["length"] - 1) // PAGE * PAGE
        if tier == "recompute":
            cached = 0
        assert s["token_ok"] and s["tier_ok"], s
        assert s["cached_tokens"] == s["expected_cached"] == cached, s
        loaded = cached if tier in ("host", "l3") else 0
        fetched = cached // PAGE if tier == "l3" else 0
        # The prefix's pages and the one state at its end came through the tier under test.
        assert (s["load_tokens"], s["state_loads"]) == (loaded, int(loaded > 0)), s
        assert s["prefetched_pages"] == s["worker_l3_pages"] == fetched, s
        assert s["states_prefetched"] == s["worker_l3_states"] == int(fetched > 0), s
        assert (s["l3_pages"] == 0) == (tier == "recompute"), s

    assert "first_resend" not in report
    rows = report["rows"]
    assert [r["length"] for r in rows] == list(LENGTHS_HYBRID)
    for r in rows:
        assert set(r["ttft_ms"]) == set(hicache.TIERS) and all(v > 0 for v in r["ttft_ms"].values())
        assert r["cached"] == (r["length"] - 1) // PAGE * PAGE and r["ok"]
