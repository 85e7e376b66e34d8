"""Prefill/decode disaggregation (issue #31), real processes, public API only: one prefill and one
decode replica behind one tokenizer, with the kvstore between them. A new request is prefilled on
the prefill replica, which ends it after its first token once the prompt's pages are in the kvstore
(``RequestEnd.handoff``); the tokenizer continues it on the decode replica, which loads those pages
(L3 prefetch) instead of recomputing them, and decodes. The client sees one stream; greedy output
equals transformers, dense and hybrid, cold and with prefix hits on either side.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.common.etcd_proc import free_port
from services.supervisor import Stack, start_stack
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc
from tests.reference import hf_greedy

QUIET: dict[str, Any] = {"say": lambda _: None}
ROLES = ("prefill", "decode")  # "scheduler" prefills, "scheduler-1" decodes
PAGE = 64  # the host page (tokens): what goes to the kvstore, and what the decode side can load


def _gen(api: pgrpc.StrataStub, ids: list[int], n: int) -> tuple[list[int], list[pb.GenerateResponse]]:
    req = pb.GenerateRequest(
        input_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True),
        stream=True,
    )
    out = list(api.Generate(req, timeout=60))
    return [t for r in out for t in r.token_ids], out


def _load(address: str) -> spb.Load:
    with grpc.insecure_channel(address) as ch:
        return sgrpc.SchedulerStub(ch).GetLoad(spb.GetLoadRequest(), timeout=5)


def _metrics_text(stack: Stack, service: str) -> str:
    import urllib.request

    return urllib.request.urlopen(f"http://{stack.child(service).extra['metrics']}/metrics", timeout=5).read().decode()


def _metric(stack: Stack, service: str, name: str) -> float:
    """A Prometheus counter of ``service`` (summed over its labels)."""
    text = _metrics_text(stack, service)
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def _pd_stack(model: Path, tmp: Path, direct: bool = False) -> Stack:
    """``direct``: the prefill worker hands over from its outbox (``--outbox-bytes``), not the kvstore."""
    return start_stack(model, free_port(), tmp, roles=ROLES, common_args=("--metrics-port", "0"),
                       worker_args=("--host-cache-bytes", "64MiB", "--l3", "true"),
                       replica_worker_args=[("--outbox-bytes", "32MiB")] if direct else (),
                       **QUIET, grammar_preload=False)  # fmt: skip


def _gauge(stack: Stack, service: str, name: str) -> float:
    text = _metrics_text(stack, service)
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + " "))


@pytest.fixture(scope="module")
def dense(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = _pd_stack(tiny_qwen3, tmp_path_factory.mktemp("pd-dense"))
    yield s
    s.stop()


def test_dense_requests_are_prefilled_handed_over_and_decoded_exactly(dense: Stack, tiny_qwen3: Path) -> None:
    rng = random.Random(3)
    system = [rng.randrange(3, 250) for _ in range(3 * PAGE)]
    prompts = [system + [rng.randrange(3, 250) for _ in range(20 + 7 * i)] for i in range(3)]
    prompts.append([rng.randrange(3, 250) for _ in range(40)])  # shorter than a page: nothing to load
    with grpc.insecure_channel(dense.child("tokenizer").address) as ch:
        api = pgrpc.StrataStub(ch)
        for p in prompts:
            got, msgs = _gen(api, p, 12)
            assert got == hf_greedy(tiny_qwen3, p, 12, stop_at_eos=False), len(p)
            assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].usage.completion_tokens == 12
    # Every request was handed over once; the decode replica decoded them and did not prefill the
    # prompts' whole pages again: it loaded them (L3 prefetch), the rest it computed.
    assert _metric(dense, "tokenizer", "strata_tokenizer_handed_over_requests_total") == len(prompts)
    # ... each once its pages were acknowledged in the kvstore, none by the deadline
    assert _metric(dense, "scheduler", "strata_scheduler_handoffs_total") == len(prompts)
    text = _metrics_text(dense, "scheduler")
    assert f'strata_scheduler_handoffs_total{{outcome="stored"}} {float(len(prompts))}' in text, text
    prefill, decode = _load(dense.child("scheduler").address), _load(dense.child("scheduler-1").address)
    assert prefill.prompt_tokens >= sum(map(len, prompts)) - 2 * PAGE  # the shared system prompt once
    whole = sum(len(p) // PAGE * PAGE for p in prompts)
    assert decode.cached_tokens >= whole, (decode.cached_tokens, whole)


def test_a_max_tokens_of_one_ends_on_the_prefill_replica(dense: Stack, tiny_qwen3: Path) -> None:
    before = _metric(dense, "tokenizer", "strata_tokenizer_handed_over_requests_total")
    ids = list(range(5, 5 + 2 * PAGE + 9))
    with grpc.insecure_channel(dense.child("tokenizer").address) as ch:
        got, msgs = _gen(pgrpc.StrataStub(ch), ids, 1)
    assert got == hf_greedy(tiny_qwen3, ids, 1, stop_at_eos=False)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert _metric(dense, "tokenizer", "strata_tokenizer_handed_over_requests_total") == before


def test_a_decode_replica_killed_mid_stream_loses_nothing(dense: Stack, tiny_qwen3: Path) -> None:
    """SIGKILL the decode replica's scheduler while a handed-over stream runs: the tokenizer resumes
    the stream from the tokens it has (on the prefill replica once the dead one's registration
    is gone: a continuation is decoded whole wherever it lands); the client sees one stream, equal
    to transformers. (Last in this module: the stack keeps one replica.)"""
    ids = [(7 * i) % 240 + 3 for i in range(2 * PAGE + 5)]
    n = 48
    req = pb.GenerateRequest(
        input_ids=pb.TokenIds(ids=ids), stream=True,
        sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True),
    )  # fmt: skip
    got: list[int] = []
    decode = dense.child("scheduler-1").proc
    assert decode is not None
    with grpc.insecure_channel(dense.child("tokenizer").address) as ch:
        for msg in pgrpc.StrataStub(ch).Generate(req, timeout=60):
            got += msg.token_ids
            if len(got) >= 4 and decode.poll() is None:
                decode.kill()
    assert decode.poll() is not None and len(got) == n
    assert got == hf_greedy(tiny_qwen3, ids, n, stop_at_eos=False)


def test_direct_hand_over_moves_the_pages_from_the_prefill_worker(tiny_qwen3: Path, tmp_path: Path) -> None:
    """``--outbox-bytes`` on the prefill worker: its prompts' pages stay in its own outbox and the
    decode worker reads them from there (the kvstore is never asked for one). Output is exact."""
    s = _pd_stack(tiny_qwen3, tmp_path, direct=True)
    try:
        rng = random.Random(5)
        system = [rng.randrange(3, 250) for _ in range(2 * PAGE)]
        prompts = [system + [rng.randrange(3, 250) for _ in range(PAGE + 9 * i)] for i in range(3)]
        with grpc.insecure_channel(s.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)
            for p in prompts:
                got, _ = _gen(api, p, 10)
                assert got == hf_greedy(tiny_qwen3, p, 10, stop_at_eos=False), len(p)
        text = _metrics_text(s, "scheduler")
        assert f'strata_scheduler_handoffs_total{{outcome="stored"}} {float(len(prompts))}' in text, text
        whole = sum(len(p) // PAGE for p in prompts)
        assert _load(s.child("scheduler-1").address).cached_tokens >= whole * PAGE
        # Every distinct page came out of the prefill worker's outbox (the system prompt's two once:
        # later prompts found them in the decode replica's own cache), none out of the kvstore.
        distinct = 2 + len(prompts)
        assert _gauge(s, "worker", "strata_worker_outbox_pages") >= distinct
        assert _gauge(s, "worker", "strata_worker_outbox_hits") >= distinct
        assert _gauge(s, "kvstore", "strata_kvstore_hits") == 0
    finally:
        s.stop()


def test_hybrid_prefix_and_state_reach_the_decode_replica(tiny_qwen3_next: Path, tmp_path: Path) -> None:
    """The hybrid model: the decode replica starts from the prompt's pages and the Mamba / DeltaNet
    state stored with them (or recomputes from the deepest state it finds): output is exact."""
    s = _pd_stack(tiny_qwen3_next, tmp_path)
    try:
        rng = random.Random(4)
        prompts = [[rng.randrange(3, 250) for _ in range(2 * PAGE + 11 * i)] for i in range(1, 3)]
        with grpc.insecure_channel(s.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)
            for p in prompts:
                got, _ = _gen(api, p, 10)
                assert got == hf_greedy(tiny_qwen3_next, p, 10, stop_at_eos=False), len(p)
        assert _metric(s, "tokenizer", "strata_tokenizer_handed_over_requests_total") == len(prompts)
        # The decode replica started from stored pages and a state (where the prefill checkpointed one).
        assert _load(s.child("scheduler-1").address).cached_tokens > 0
    finally:
        s.stop()
