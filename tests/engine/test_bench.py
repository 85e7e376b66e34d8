"""The benchmark harness computes what it claims: seeded workloads, exact counts, cache reuse that
is > 0 with the prefix cache on and exactly 0 with it off, metrics from known timings, reports."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from services.bench import report
from services.bench.cli import add_bench_parser, run_bench
from services.bench.metrics import BenchResults, Comparison, RequestRecord, percentile, summarize
from services.bench.runner import InProcessBackend, replay
from services.bench.workloads import (
    FIRST_ID,
    MultiTurnSpec,
    RandomSpec,
    SharedPrefixSpec,
    Workload,
    ideal_shared_prefix_reuse,
    max_context_needed,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
)
from services.scheduler.loop import LoopConfig
from services.worker.engine import Engine, EngineConfig

VOCAB = 768  # the tiny checkpoint's
RUN_TIMEOUT_S = 60.0  # a stalled scheduler fails the test instead of hanging it
SHARED = SharedPrefixSpec(groups=2, prompts_per_group=4, system_len=48, question_len=8, output_len=4)


# -- workloads -------------------------------------------------------------------------------------


def test_workloads_are_seeded_and_in_range() -> None:
    for make, spec in (
        (random_workload, RandomSpec(count=6, input_len=20, output_len=3, range_ratio=0.5)),
        (shared_prefix_workload, SHARED),
        (multi_turn_workload, MultiTurnSpec(clients=3, rounds=2, request_len=5, output_len=2)),
    ):
        a, b, c = make(spec, VOCAB, 1), make(spec, VOCAB, 1), make(spec, VOCAB, 2)  # type: ignore[operator]
        assert a == b and a != c
        ids = [t for conv in a.conversations for turn in conv for t in (*turn.prefix, *turn.question)]
        assert min(ids) >= FIRST_ID and max(ids) < VOCAB


def test_random_lengths_respect_range_ratio() -> None:
    w = random_workload(RandomSpec(count=50, input_len=40, output_len=3, range_ratio=0.5), VOCAB)
    lens = [len(c[0].prompt_for([])) for c in w.conversations]
    assert min(lens) >= 20 and max(lens) <= 40 and len(set(lens)) > 1
    assert all(c[0].ideal_reuse([]) == 0 for c in w.conversations)


def test_shared_prefix_ideal_matches_closed_form() -> None:
    w = shared_prefix_workload(SHARED, VOCAB)
    assert w.num_requests == SHARED.groups * SHARED.prompts_per_group
    assert sum(c[0].ideal_reuse([]) for c in w.conversations) == ideal_shared_prefix_reuse(SHARED)
    prompts = [c[0].prompt_for([]) for c in w.conversations]
    assert all(len(p) == SHARED.system_len + SHARED.question_len for p in prompts)
    assert len({tuple(p[: SHARED.system_len]) for p in prompts}) == SHARED.groups


def test_multi_turn_prompt_is_history_plus_question() -> None:
    spec = MultiTurnSpec(clients=1, rounds=3, request_len=5, output_len=2)
    (conv,) = multi_turn_workload(spec, VOCAB).conversations
    history = [*conv[0].prompt_for([]), 7, 8]  # turn 0 and its answer
    p1 = conv[1].prompt_for(history)
    assert p1 == history + list(conv[1].question)
    assert conv[1].ideal_reuse(history) == len(history) - 1  # the last answer token has no KV
    assert max_context_needed(Workload("multi_turn", "x", (conv,))) == 3 * (5 + 2)


# -- metrics ---------------------------------------------------------------------------------------


def test_summarize_from_known_timings() -> None:
    a = RequestRecord(10, 3, 4, submitted=0.0, first_token=1.0, finished=3.0, output_tokens=3, cached_tokens=4)
    a.chunks = [(1.0, 1), (3.0, 2)]  # two tokens coalesced in the second chunk: 1 s each
    b = RequestRecord(20, 3, 0, submitted=1.0, first_token=2.0, finished=5.0, output_tokens=3, cached_tokens=0)
    b.chunks = [(2.0, 1), (3.0, 1), (5.0, 1)]
    failed = RequestRecord(30, 3, 5, submitted=0.0, error="boom")
    m = summarize("t", [a, b, failed], duration_s=5.0)
    assert (m.requests, m.failed, m.prompt_tokens, m.output_tokens) == (2, 1, 30, 6)
    assert m.request_throughput == pytest.approx(0.4) and m.total_throughput == pytest.approx(36 / 5)
    assert m.cache_hit_rate == pytest.approx(4 / 30) and m.reuse_vs_ideal == pytest.approx(1.0)
    assert m.ttft_s is not None and m.ttft_s.mean == pytest.approx(1.0)
    assert m.itl_s is not None and m.itl_s.mean == pytest.approx((1 + 1 + 1 + 2) / 4)
    assert m.e2e_s is not None and m.e2e_s.median == pytest.approx(3.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)


# -- in-process runs on the tiny model -------------------------------------------------------------


def _run(model: Path, w: Workload, cache: str, concurrency: int = 64) -> tuple[list[RequestRecord], float]:
    async def go() -> tuple[list[RequestRecord], float]:
        engine = Engine(model, EngineConfig(kv_cache_bytes=8 << 20, max_rows=16))
        async with InProcessBackend(engine, LoopConfig(cache=cache, max_running=16), cache) as b:
            return await replay(b, w, concurrency, timeout_s=RUN_TIMEOUT_S)

    return asyncio.run(go())


@pytest.mark.parametrize("cache", ["radix", "none"])
def test_shared_prefix_reuse_with_cache_on_and_off(tiny_qwen3: Path, cache: str) -> None:
    w = shared_prefix_workload(SHARED, VOCAB)
    # Two in flight: the first prompt of each group computes the prefix, the others can reuse it.
    records, duration = _run(tiny_qwen3, w, cache, concurrency=2)
    m = summarize(cache, records, duration)
    assert (m.requests, m.failed) == (w.num_requests, 0)
    assert m.output_tokens == w.num_requests * SHARED.output_len  # ignore_eos: exact lengths
    assert m.prompt_tokens == w.num_requests * (SHARED.system_len + SHARED.question_len)
    assert m.ideal_reuse == ideal_shared_prefix_reuse(SHARED)
    if cache == "radix":
        assert m.cached_tokens > 0 and 0 < m.cache_hit_rate < 1
    else:
        assert m.cached_tokens == 0 and m.cache_hit_rate == 0.0


def test_sequential_shared_prefix_reaches_ideal_reuse(tiny_qwen3: Path) -> None:
    """One request at a time, every later prompt of a group finds the whole system prompt."""
    w = shared_prefix_workload(SHARED, VOCAB)
    m = summarize("seq", *_run(tiny_qwen3, w, "radix", concurrency=1))
    assert m.cached_tokens >= m.ideal_reuse and m.reuse_vs_ideal is not None and m.reuse_vs_ideal >= 1.0


def test_multi_turn_reuses_history(tiny_qwen3: Path) -> None:
    spec = MultiTurnSpec(clients=2, rounds=3, request_len=6, output_len=3, max_parallel=2)
    w = multi_turn_workload(spec, VOCAB)
    m = summarize("mt", *_run(tiny_qwen3, w, "radix"))
    assert (m.requests, m.output_tokens) == (6, 6 * 3)
    # Turn k's prompt = k * (request + answer) + request tokens.
    assert m.prompt_tokens == 2 * sum(k * 9 + 6 for k in range(3))
    assert m.cached_tokens > 0 and m.reuse_vs_ideal is not None and m.reuse_vs_ideal >= 0.9


def test_hf_batched_produces_exact_lengths(tiny_qwen3: Path) -> None:
    from services.bench.hf import hf_batched, load_hf_model

    w = random_workload(RandomSpec(count=3, input_len=12, output_len=5, range_ratio=0.5), VOCAB)
    records, _ = hf_batched(load_hf_model(tiny_qwen3), w, batch_size=2)
    assert [r.output_tokens for r in records] == [5, 5, 5]
    assert all(r.ok and r.first_token is None for r in records)


# -- reports and the command line ------------------------------------------------------------------


def test_report_writes_json_plots_and_keeps_hand_written_text(tmp_path: Path) -> None:
    rec = RequestRecord(10, 2, 5, 0.0, first_token=0.5, finished=1.0, output_tokens=2, cached_tokens=5)
    rec.chunks = [(0.5, 1), (1.0, 1)]
    results = BenchResults(config={"model": "m"}, machine={"cores": 2})
    results.runs = [summarize("a", [rec], 1.0), summarize("b", [rec], 2.0)]
    results.comparisons = [Comparison("a / b", "total tokens/s", "a", "b", 2.0, 0.9)]
    report.write_json(results, tmp_path / "results.json")
    assert json.loads((tmp_path / "results.json").read_text())["comparisons"][0]["met"] is True
    pngs = report.write_plots(results, tmp_path)
    assert {p.name for p in pngs} == {"throughput.png", "ratios.png", "latency.png"}
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nmethod text\n\n{report.BEGIN}\nold\n{report.END}\n\nfooter\n")
    report.update_doc(doc, report.markdown(results))
    text = doc.read_text()
    assert "method text" in text and "footer" in text and "old" not in text
    assert "| a / b | total tokens/s | 2.000 | met (≥ 0.9) |" in text


def test_a_time_ratio_is_met_below_its_goal() -> None:
    assert Comparison("ttft", "s", "a", "b", 0.9, 1.1, lower_is_better=True).met is True
    assert Comparison("ttft", "s", "a", "b", 1.2, 1.1, lower_is_better=True).met is False
    assert Comparison("tok/s", "x", "a", "b", 1.2, 1.1).met is True


def test_decode_floor_measures_a_step_against_the_machine(tiny_qwen3: Path) -> None:
    """The floor section's measurement on the tiny model: rates measured, the step slower than its
    floor, and the KV bytes counting the shared prefix once (fewer bytes than every row read)."""
    from services.bench.speed import decode_floor, machine_rates

    gflops, gbs = machine_rates(repeats=1)
    assert gflops > 1 and gbs > 0.1
    f = decode_floor(tiny_qwen3, "cascade", gflops, gbs, groups=2, per_group=4, prefix=40, question=8, steps=4)
    assert f.batch == 8 and f.step_s > 0 and f.ratio > 1.0
    assert f.distinct_slots == pytest.approx(f.rows_slots - 6 * 40)  # 2 prefixes of 40 read once, not 8 times


def test_attention_share_of_a_profile(tiny_qwen3: Path) -> None:
    from services.bench.profile import profile_in_process
    from services.scheduler.loop import LoopConfig
    from services.worker.engine import Engine, EngineConfig

    w = shared_prefix_workload(SharedPrefixSpec(groups=2, prompts_per_group=3, system_len=40, question_len=4,
                                                output_len=4), VOCAB)
    text, share = profile_in_process(Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=1 << 22, max_rows=8)),
                                     LoopConfig(cache="radix"), w, 8, VOCAB, 5)
    assert 0.0 < share < 1.0 and "attention:" in text


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_cli_flags_override_presets() -> None:
    from services.bench.cli import _specs

    specs = _specs(_args(["--quick", "--shared-system-len", "99", "--multi-rate", "2.5"]))
    assert specs["shared"].system_len == 99 and specs["shared"].groups == 2
    assert specs["multi"].request_rate == 2.5


@pytest.mark.slow
def test_quick_bench_end_to_end(tiny_qwen3: Path, tmp_path: Path) -> None:
    """``strata bench --quick`` on the tiny model: every section runs and writes its files."""
    args = _args(
        [
            "--quick",
            "--model",
            str(tiny_qwen3),
            "--out-dir",
            str(tmp_path / "bench"),
            "--doc",
            str(tmp_path / "benchmarks.md"),
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert run_bench(args) == 0
    data = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert all(r["failed"] == 0 for r in data["runs"])
    names = [c["name"] for c in data["comparisons"]]
    assert any("gRPC stack / in-process" in n for n in names)
    assert any("transformers generate" in n for n in names)
    assert "engine thread" in data["profile"]


def test_hybrid_bench_runs_every_side_and_writes_its_figures(
    tiny_qwen3: Path, tiny_qwen3_next: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make bench-hybrid` at toy size: dense and hybrid reuse every turn of the pure trace
    (hybrid / dense hit rate 1.0 here), and both policies complete the mixed trace."""
    from benchmarks import hybrid

    out = tmp_path / "hybrid.json"
    args = ["--dense", str(tiny_qwen3), "--hybrid", str(tiny_qwen3_next), "--clients", "3", "--rounds", "2",
            "--rows", "4", "--request-len", "12", "--output-len", "4", "--oneoffs", "4", "--oneoff-len", "8",
            "--tight-states", "6", "--out", str(out)]
    assert hybrid.main(args) == 0
    data = json.loads(out.read_text())
    runs = {r["label"]: r for r in data["results"]}
    assert len(runs) == 4 and all(r["failed"] == 0 for r in runs.values())
    assert data["hybrid_vs_dense"] == pytest.approx(1.0)
    assert runs["dense Qwen3 · radix"]["reuse_vs_ideal"] == pytest.approx(1.0)
    assert "| mixed · hybrid · LRU · 6 states |" in capsys.readouterr().out


def test_elastic_bench_runs_static_splits_and_elastic(tiny_qwen3_next: Path, tmp_path: Path) -> None:
    """The phase benchmark at toy size: every run completes both phases under one budget, and the
    elastic run resizes and holds no more than its working set when idle."""
    from benchmarks import elastic

    out = tmp_path / "elastic.json"
    args = ["--model", str(tiny_qwen3_next), "--budget", str(1 << 20), "--rows", "8", "--long", "2",
            "--long-len", "200", "--short", "12", "--short-len", "16", "--out-len", "4", "--max-states", "32",
            "--idle-s", "0.3", "--out", str(out)]
    assert elastic.main(args) == 0
    runs = {r["label"]: r for r in json.loads(out.read_text())["results"]}
    assert all(r["completed"] == 14 for r in runs.values()), runs
    el = runs["elastic"]
    assert el["resizes"] >= 2 and el["idle_committed_mib"] <= 1.5 * el["working_set_mib"], el
