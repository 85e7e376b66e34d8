"""End to end on the hybrid model: real etcd, the four services as processes, real gRPC.

A chat through the public API on tiny Qwen3-Next reuses each previous turn (the Mamba radix
cache: the finished turn's state donated, copied on write into the next turn) and every turn's
greedy output equals transformers'.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.etcd_proc import free_port
from services.supervisor import Stack, start_stack
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc
from tests.reference import hf_greedy, hf_tokenizer


@pytest.fixture(scope="module")
def api(tiny_qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[pgrpc.StrataStub]:
    s: Stack = start_stack(tiny_qwen3_next, free_port(), tmp_path_factory.mktemp("hybrid"), say=lambda _: None,
                           grammar_preload=False)  # fmt: skip
    try:
        with grpc.insecure_channel(s.child("tokenizer").address) as ch:
            yield pgrpc.StrataStub(ch)
    finally:
        s.stop()


def test_multi_turn_chat_reuses_each_turn_and_equals_transformers(
    api: pgrpc.StrataStub, tiny_qwen3_next: Path
) -> None:
    tok = hf_tokenizer(str(tiny_qwen3_next))
    history = tok.encode("You are a cache. The user asks about pages.", add_special_tokens=False)
    prev_len = 0
    for turn, question in enumerate(["Where do pages go", "and after that", "then what happens"]):
        prompt = history + tok.encode(" " + question, add_special_tokens=False)
        sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
        resp = api.Generate(pb.GenerateRequest(input_ids=pb.TokenIds(ids=prompt), sampling=sampling))
        ids: list[int] = []
        last = pb.GenerateResponse()
        for r in resp:
            ids += r.token_ids
            last = r
        assert ids == hf_greedy(tiny_qwen3_next, prompt, 12, stop_at_eos=False), turn
        if turn:
            # Everything the previous turn computed: its prompt and all but its last answer token.
            assert last.usage.cached_tokens == prev_len - 1, turn
        prev_len = len(prompt) + len(ids)
        history = prompt + ids
