"""Smoke test of the hierarchical-cache TTFT benchmark (``services.bench.hicache``) on the tiny
model: every tier serves every prompt with the recomputed token, and the JSON has its shape.
Timings are not checked: they are the benchmark's business, not a test's."""

from __future__ import annotations

import json
from pathlib import Path

from services.bench import hicache

PAGE = 16  # short prompts still span several host / L3 pages
LENGTHS = (40, 97)
REPEATS = 2


def test_every_tier_serves_the_recomputed_token(tiny_qwen3: Path, tmp_path: Path) -> None:
    out = tmp_path / "hicache.json"
    rc = hicache.main([
        "--model", str(tiny_qwen3), "--lengths", ",".join(map(str, LENGTHS)), "--repeats", str(REPEATS),
        "--host-page-tokens", str(PAGE), "--max-prefill-tokens", "32", "--kvstore", "inproc",
        "--timeout-s", "30", "--out", str(out),
    ])
    report = json.loads(out.read_text())
    assert rc == 0 and report["ok"]

    samples = report["samples"]
    assert len(samples) == len(LENGTHS) * REPEATS * len(hicache.TIERS)
    for s in samples:
        cached = (s["length"] - 1) // PAGE * PAGE
        assert s["token_ok"] and s["tier_ok"], s
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
