"""Prompt logprobs end to end, as evaluation harnesses ask for them with the official ``openai``
client: ``echo`` + ``logprobs`` on ``/v1/completions`` (the prompt's tokens, the first with a null
logprob, then the completion's), vLLM's ``prompt_logprobs``, ``max_tokens: 0`` scoring a prompt
alone, streaming with echo, and the public gRPC field. Every number is compared with transformers'
fp32 log-softmax on the same checkpoint, cold and with the prompt (or a long prefix of it) already
in the prefix cache: a request that scores its prompt takes no cache hit for the positions it
scores, so both give the same numbers. Prompts longer than the stack's prefill budget (1,024) are
scored over two chunks. The stack is the shared one (``tests/openai_stack.py``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch

from services.supervisor import Stack
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc
from tests.openai_stack import MODEL, http
from tests.reference import hf_model, hf_tokenizer

TOLERANCE = 1e-4
LONG = 1300  # tokens: two prefill chunks at the default budget of 1,024


def _log_softmax(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 log-softmax at every position of ``ids``: row j predicts ``ids[j + 1]``."""
    with torch.inference_mode():
        return hf_model(str(model_dir))(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(n)]


def _echoed(choice: Any, n: int) -> list[float | None]:
    """The echoed prompt's ``token_logprobs`` (the first ``n`` entries, the prompt's own)."""
    lps = choice.logprobs
    assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == len(lps.text_offset)
    return list(lps.token_logprobs[:n])


def _largest_delta(got: list[float | None], ids: list[int], ref: torch.Tensor) -> float:
    assert got[0] is None and None not in got[1:], got[:3]
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return float((torch.tensor(got[1:]) - want).abs().max())


def test_echo_logprobs_equal_transformers_cold_and_cached(openai_client: openai.OpenAI, tiny_qwen3: Path) -> None:
    first, shared = _ids(1, LONG), _ids(2, LONG)
    sibling = first[:1100] + shared[1100:]  # a long prefix of `first`, then its own tail
    deltas, refs = {}, {id(first): _log_softmax(tiny_qwen3, first)}

    def score(ids: list[int], label: str) -> list[float | None]:
        r = openai_client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                             temperature=0)  # fmt: skip
        assert r.usage is not None and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
        assert r.usage.prompt_tokens_details is not None
        assert r.usage.prompt_tokens_details.cached_tokens == 0, label  # scored positions are never a cache hit
        got = _echoed(r.choices[0], len(ids))
        assert len(r.choices[0].logprobs.tokens) == len(ids) + 1  # the prompt, then the completion
        ref = refs[id(ids)] if id(ids) in refs else _log_softmax(tiny_qwen3, ids)
        deltas[label] = _largest_delta(got, ids, ref)
        return got

    cold = score(first, "cold")
    # The scored request's KV did enter the cache: an ordinary request hits it.
    plain = openai_client.completions.create(model=MODEL, prompt=first, max_tokens=1, temperature=0)
    assert plain.usage is not None and plain.usage.prompt_tokens_details is not None
    assert plain.usage.prompt_tokens_details.cached_tokens >= 1024
    again = score(first, "same prompt cached")
    score(sibling, "shared prefix cached")
    assert max(deltas.values()) < TOLERANCE, deltas
    assert max(abs(a - b) for a, b in zip(cold[1:], again[1:], strict=True)) < 1e-6  # type: ignore[operator]


def test_echo_text_tops_and_ranks(openai_client: openai.OpenAI, openai_base: str, tiny_qwen3: Path) -> None:
    prompt = "Strata keeps the cache; the scheduler decides and the worker executes."
    ids = hf_tokenizer(str(tiny_qwen3)).encode(prompt, add_special_tokens=False)
    ref = _log_softmax(tiny_qwen3, ids)
    r = openai_client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=5, max_tokens=3,
                                         temperature=0, extra_body={"prompt_logprobs": 3})  # fmt: skip
    choice = r.choices[0]
    completion = choice.text[len(prompt) :]
    assert choice.text.startswith(prompt) and len(completion) > 0  # the echo is the prompt itself
    lps = choice.logprobs
    assert lps.top_logprobs[0] is None and lps.text_offset[0] == 0
    assert "".join(lps.tokens[: len(ids)]) == prompt
    for j in range(1, len(ids)):  # the 5 best alternatives of every prompt position, best first
        # keyed by text: two ids that decode alike (half a UTF-8 character) keep the likelier
        values, best = list(lps.top_logprobs[j].values()), ref[j - 1].topk(5).values.tolist()
        assert values == sorted(values, reverse=True) and abs(values[0] - best[0]) < TOLERANCE
        assert all(min(abs(v - b) for b in best) < TOLERANCE for v in values) and 1 <= len(values) <= 5
    assert lps.text_offset[len(ids)] == len(prompt)  # the completion's tokens follow the echoed prompt
    # vLLM's prompt_logprobs: null, then per token {id: {logprob, rank, decoded_token}} of the token
    # and its 3 best alternatives (ranks 1-3).
    scored = choice.prompt_logprobs  # type: ignore[attr-defined]
    assert scored[0] is None and len(scored) == len(ids)
    for j, entry in enumerate(scored[1:], start=1):
        row, tok = ref[j - 1], ids[j]
        mine = entry[str(tok)]
        assert abs(mine["logprob"] - float(row[tok])) < TOLERANCE
        assert mine["rank"] == int((row > row[tok]).sum()) + 1
        assert mine["decoded_token"] == hf_tokenizer(str(tiny_qwen3)).decode([tok])
        alternatives = {int(t): v for t, v in entry.items() if int(t) != tok or v["rank"] <= 3}
        want = row.topk(3).indices.tolist()
        assert {t: v["rank"] for t, v in alternatives.items() if t in want} == {t: k + 1 for k, t in enumerate(want)}
        assert len(entry) in (3, 4)  # the token is one of its best 3, or a fourth entry
    # The raw body has the same shape (what a client without vLLM's types reads).
    status, body = http(f"{openai_base}/v1/completions",
                        {"model": MODEL, "prompt": ids[:4], "max_tokens": 1, "prompt_logprobs": 0})  # fmt: skip
    assert status == 200 and body["choices"][0]["logprobs"] is None
    assert body["choices"][0]["prompt_logprobs"][0] is None and len(body["choices"][0]["prompt_logprobs"]) == 4
    assert all(len(e) == 1 for e in body["choices"][0]["prompt_logprobs"][1:])


def test_max_tokens_zero_scores_the_prompt_alone(openai_client: openai.OpenAI, tiny_qwen3: Path) -> None:
    ids = _ids(3, 300)
    r = openai_client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert len(choice.logprobs.tokens) == len(ids)
    assert _largest_delta(_echoed(choice, len(ids)), ids, _log_softmax(tiny_qwen3, ids)) < TOLERANCE
    assert choice.text == hf_tokenizer(str(tiny_qwen3)).decode(ids, skip_special_tokens=True)
    # Echo alone: the text, no logprobs; a one-token prompt has nothing to score but its null.
    r = openai_client.completions.create(model=MODEL, prompt="Hello", echo=True, max_tokens=0)
    assert r.choices[0].text == "Hello" and r.choices[0].logprobs is None and r.choices[0].finish_reason == "length"
    r = openai_client.completions.create(model=MODEL, prompt=ids[:1], echo=True, logprobs=0, max_tokens=0)
    assert r.choices[0].logprobs.token_logprobs == [None]


def test_streamed_echo_joins_to_the_whole_answer(openai_client: openai.OpenAI) -> None:
    """As vLLM streams it: a choice's first chunk carries the prompt and its first token."""
    ids = _ids(4, 40)
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=[ids, ids[:20]], echo=True, logprobs=2, max_tokens=4,
                                  temperature=0)  # fmt: skip
    whole = openai_client.completions.create(**kwargs)
    text: dict[int, str] = {}
    lps: dict[int, list[float | None]] = {}
    offsets: dict[int, list[int]] = {}
    for chunk in openai_client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            if c.index not in text:  # the first chunk of a choice: the whole prompt
                assert c.logprobs is not None and len(c.logprobs.tokens) >= (40 if c.index == 0 else 20)
            text[c.index] = text.get(c.index, "") + c.text
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
                offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
    for c in whole.choices:
        assert text[c.index] == c.text and offsets[c.index] == c.logprobs.text_offset
        # The two calls may be batched differently (the second finds the prompts cached, and the
        # scheduler's overlap depends on measured step times), so a logprob may differ by fp32
        # rounding (4e-6 seen in CI); the prompt's null and every value otherwise line up.
        got, want = lps[c.index], c.logprobs.token_logprobs
        assert len(got) == len(want) and got[0] is None and want[0] is None
        assert all(abs(g - w) < 1e-4 for g, w in zip(got[1:], want[1:], strict=True)), (got, want)


def test_grpc_prompt_logprobs_and_chat(openai_stack: Stack, openai_client: openai.OpenAI, tiny_qwen3: Path) -> None:
    ids = _ids(5, 50)
    ref = _log_softmax(tiny_qwen3, ids)
    address = openai_stack.child("tokenizer").address
    with grpc.insecure_channel(address) as channel:
        stub = pgrpc.StrataStub(channel)
        req = pb.GenerateRequest(input_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_new_tokens=0),
                                 prompt_logprobs=2)  # fmt: skip
        metadata = (("authorization", "Bearer sk-test-strata"),)
        (resp,) = list(stub.Generate(req, metadata=metadata, timeout=60))
        scored = resp.prompt_logprobs
        assert resp.finish_reason == pb.FINISH_REASON_LENGTH and not resp.token_ids
        assert scored.first_token_id == ids[0] and [x.token_id for x in scored.logprobs] == ids[1:]
        got = [x.logprob for x in scored.logprobs]
        assert _largest_delta([None, *got], ids, ref) < TOLERANCE
        assert all(len(x.top) == 2 for x in scored.logprobs) and len(scored.ranks) == len(ids) - 1
        with pytest.raises(grpc.RpcError) as err:  # 0 tokens without scoring is refused
            list(stub.Generate(pb.GenerateRequest(input_ids=pb.TokenIds(ids=ids),
                                                  sampling=pb.SamplingParams(max_new_tokens=0)),
                               metadata=metadata, timeout=60))  # fmt: skip
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.max_new_tokens" in (err.value.details() or "")
    # Chat: vLLM returns the scored conversation at the top level.
    r = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                              extra_body={"prompt_logprobs": 1})  # fmt: skip
    scored_chat = r.prompt_logprobs  # type: ignore[attr-defined]
    assert scored_chat[0] is None and len(scored_chat) == r.usage.prompt_tokens  # type: ignore[union-attr]
