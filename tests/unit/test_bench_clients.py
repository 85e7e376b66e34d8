"""`make bench-clients` (benchmarks/clients.py, issue #28), without GuideLLM: the committed figures are
what GuideLLM's committed raw report says, that report ran the workload and the GuideLLM version the
code and the Makefile name, and docs/benchmarks.md quotes that run."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

from benchmarks.clients import Workload, scenario, summarize

REPO = Path(__file__).resolve().parents[2]
REPORT = json.loads((REPO / "docs" / "bench" / "guidellm.json").read_text())
SUMMARY = json.loads((REPO / "docs" / "bench" / "clients.json").read_text())


def test_summary_is_read_back_from_the_raw_report() -> None:
    assert [asdict(r) for r in summarize(REPORT)] == SUMMARY["rows"]
    assert all(r["requests"] > 0 and r["errored"] == 0 for r in SUMMARY["rows"])
    assert [r["streams"] for r in SUMMARY["rows"]] == list(Workload().streams)


def test_report_ran_the_committed_workload_and_pinned_version() -> None:
    pinned = re.search(r"^GUIDELLM_VERSION := (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert pinned and REPORT["metadata"]["guidellm_version"] == pinned.group(1)
    assert SUMMARY["tool"] == f"guidellm {pinned.group(1)}"
    w = Workload()
    assert SUMMARY["workload"] == {**asdict(w), "streams": list(w.streams)}
    ran = REPORT["config"]["spec"]
    ours = scenario(w, ran["backend"]["target"], "qwen3-bench", Path("tok"), Path("out.json"))["spec"]
    assert ran["profile"]["streams"] == ours["profile"]["streams"]
    assert ran["profile"]["warmup"]["value"] == w.warmup_s
    assert ran["constraints"][0]["seconds"] == w.seconds
    assert ran["backend"]["request_format"] == ours["backend"]["request_format"] == "/v1/completions"
    data = ran["data"][0]
    assert (data["prompt_tokens"], data["output_tokens"]) == (w.prompt_tokens, w.output_tokens)
    # the server's usage agreed with what GuideLLM asked for, request by request
    for b in REPORT["benchmarks"]:
        counts = b["metrics"]["prompt_token_count"]["successful"], b["metrics"]["output_token_count"]["successful"]
        assert [(c["min"], c["max"]) for c in counts] == [(w.prompt_tokens,) * 2, (w.output_tokens,) * 2]


def test_docs_quote_the_committed_run() -> None:
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    section = doc[doc.index("(`make bench-clients`, issue #28)") :]
    section = section[: section.index("\n## ")]
    assert f"GuideLLM {REPORT['metadata']['guidellm_version']}" in section
    for r in SUMMARY["rows"]:
        row = (f"| {r['streams']} | {r['requests']} ({r['errored']}) | {r['requests_per_s']:.2f} | "
               f"{r['ttft_ms_p50']:,.0f} / {r['ttft_ms_p99']:,.0f} | {r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f} | "
               f"{r['output_tokens_per_s']:,.0f} |")  # fmt: skip
        assert row in section, row
