"""The OpenAI-compatible benchmark driver: ``spread`` (pure), ``OpenAIBackend`` against a real Strata
stack on the tiny model (tokens counted from usage, cached tokens on a repeated prefix, a failed
request recorded as failed), and — slow — against ``transformers serve --continuous-batching`` and
as the whole ``strata bench --only servers`` section."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from services.bench.cli import add_bench_parser, run_bench
from services.bench.metrics import RequestRecord, summarize
from services.bench.openai_backend import OpenAIBackend, spread
from services.bench.runner import replay
from services.bench.workloads import RandomSpec, SharedPrefixSpec, Workload, random_workload, shared_prefix_workload
from services.supervisor import Stack

VOCAB = 768  # the tiny checkpoints'
STRATA_NO_EOS = {"ignore_eos": True}


def test_spread_counts_every_token_once() -> None:
    times = [1.0, 2.0, 3.0, 4.0]
    assert spread(times, 4) == [(1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)]
    chunks = spread(times, 9)  # 8 tokens after the first over 3 chunks: 2, 3, 3
    assert chunks == [(1.0, 1), (2.0, 2), (3.0, 3), (4.0, 3)]
    assert spread([5.0], 3) == [(5.0, 3)]
    assert spread([], 3) == []
    rec = RequestRecord(10, 9, 0, 0.0, first_token=1.0, finished=4.0, output_tokens=9, chunks=chunks)
    itls = rec.itls()
    assert len(itls) == 8 and sum(itls) == pytest.approx(3.0)  # the mean ITL is exact


@pytest.fixture(scope="module")
def stack(plain_stack: Stack) -> Stack:  # tests/shared_stacks.py
    return plain_stack


def _base(stack: Stack) -> str:
    return f"http://{stack.child('tokenizer').extra['http']}/v1"


def _replay(backend: OpenAIBackend, workload: Workload, concurrency: int) -> list[RequestRecord]:
    async def go() -> list[RequestRecord]:
        try:
            records, _ = await replay(backend, workload, concurrency, timeout_s=120)
            return records
        finally:
            await backend.close()

    return asyncio.run(go())


def test_strata_http_counts_tokens_and_cached_prefix(stack: Stack, tiny_qwen3: Path) -> None:
    spec = SharedPrefixSpec(groups=1, prompts_per_group=3, system_len=128, question_len=8, output_len=12)
    w = shared_prefix_workload(spec, VOCAB, seed=7)
    b = OpenAIBackend(_base(stack), tiny_qwen3.name, "Strata HTTP", extra_body=STRATA_NO_EOS)
    records = _replay(b, w, concurrency=1)  # one at a time: the later prompts find the prefix cached
    assert [r.error for r in records] == ["", "", ""]
    for r, conv in zip(records, w.conversations, strict=True):
        assert r.output_tokens == 12  # ignore_eos honoured, counted from usage
        assert sum(n for _, n in r.chunks) == 12
        assert r.prompt_tokens == len(conv[0].prompt_for([]))  # ids sent as ids
        assert r.first_token is not None and r.finished is not None and r.first_token <= r.finished
    assert records[0].cached_tokens == 0
    assert all(r.cached_tokens >= 64 for r in records[1:])  # most of the 128-token system prompt
    assert b.reports_cache and b.short == 0 and b.requests == 3
    m = summarize("x", records, 1.0, b.reports_cache)
    assert m.cache_hit_rate is not None and m.cache_hit_rate > 0


def test_text_prompts_are_retokenized_to_about_their_length(stack: Stack, tiny_qwen3: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    w = random_workload(RandomSpec(count=4, input_len=64, output_len=6), VOCAB, seed=3)
    b = OpenAIBackend(_base(stack), tiny_qwen3.name, "Strata HTTP", decode=tok.decode, extra_body=STRATA_NO_EOS)
    records = _replay(b, w, concurrency=4)
    assert all(r.ok and r.output_tokens == 6 for r in records)
    assert 0.75 <= b.prompt_ratio <= 1.5, b.prompt_ratio


def test_a_refused_request_is_recorded_as_failed(stack: Stack) -> None:
    w = random_workload(RandomSpec(count=2, input_len=16, output_len=4), VOCAB, seed=1)
    b = OpenAIBackend(_base(stack), "no-such-model", "Strata HTTP", extra_body=STRATA_NO_EOS)
    records = _replay(b, w, concurrency=2)
    assert len(records) == 2
    assert all(not r.ok and "404" in r.error for r in records)


@pytest.mark.slow
def test_transformers_serve_peer(tiny_qwen3: Path, tmp_path: Path) -> None:
    """The peer path: a real ``transformers serve`` process, text prompts, eos disabled through
    ``generation_config``; it reports no cached tokens."""
    from transformers import AutoTokenizer

    from services.bench.hf_serve import NO_EOS_BODY, TransformersServe

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    w = random_workload(RandomSpec(count=4, input_len=32, output_len=8), VOCAB, seed=5)
    with TransformersServe(tiny_qwen3, tmp_path / "serve.log", ("--cb-num-blocks", "64")) as peer:
        b = OpenAIBackend(peer.base_url, peer.model_name, "transformers serve", decode=tok.decode,
                          extra_body=NO_EOS_BODY)  # fmt: skip
        records = _replay(b, w, concurrency=4)
    assert [r.error for r in records] == [""] * 4
    assert all(r.output_tokens == 8 and sum(n for _, n in r.chunks) == 8 for r in records)
    assert not b.reports_cache and b.short == 0
    assert 0.75 <= b.prompt_ratio <= 1.5


def _bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_servers_section_runs_alone(tiny_qwen3: Path) -> None:
    assert run_bench(_bench_args(["--model", str(tiny_qwen3), "--only", "servers", "--only", "cache"])) == 2


@pytest.mark.slow
def test_servers_section_end_to_end(tiny_qwen3: Path, tmp_path: Path) -> None:
    """``strata bench --only servers --quick`` on the tiny model: both servers answer every request
    and servers.json holds the three ratios."""
    args = _bench_args(["--only", "servers", "--quick", "--model", str(tiny_qwen3), "--out-dir", str(tmp_path),
                        "--run-dir", str(tmp_path / "run"), "--peer-args", "--cb-num-blocks 256"])  # fmt: skip
    assert run_bench(args) == 0
    data = json.loads((tmp_path / "servers.json").read_text())
    assert data["runs"] and all(r["failed"] == 0 and r["output_tokens"] > 0 for r in data["runs"])
    names = [c["name"] for c in data["comparisons"]]
    assert sum("/ transformers serve" in n for n in names) == 2
    assert any("Strata HTTP / Strata gRPC" in n for n in names)
