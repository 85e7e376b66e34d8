"""The chaos run's load (benchmarks/chaos.py): prompts whose greedy output is certain, their
reference outputs, and client loops on both public fronts that record every request's stream.

Prompts (``make_prompts``): documents of 20-320 words, each followed by several short questions
(prompts that share a long prefix), standalone prompts of 2-40 words, and chat prompts (a document
as the system message, a question as the user's), each with its own ``max_new_tokens`` (16, 32 or
64, eos ignored). Words come from the tiny models' training list: the text path sees ordinary text.

Reference (``reference``): transformers' greedy decoding of the prompt's token ids as the
tokenizer service makes them (HTTP ``/tokenize``, the chat template for chat prompts). A prompt
whose greedy path passes through a near-tie (top-1 minus top-2 logit below ``margin`` at some
step) gets a new question: the stack's attention paths (cascade, chunked prefill, recomputation
after a resume) differ from transformers by ~1e-5 in fp32, so only a prompt with a clear winner at
every step has *one* right answer. The reference text is the tokenizer's whole decode of those
ids (special tokens skipped, as the services stream it). Before any fault every prompt runs once
through each of its fronts on the undisturbed stack (``verify``): ids and text must equal the
reference.

Clients (``client_loop``): each holds its own connection — a gRPC channel that reconnects within a
second, its calls ``wait_for_ready`` so that a request sent while the tokenizer is down waits for
it, or an ``openai.AsyncOpenAI`` client that retries a refused connection — and sends one streamed
request after another until the run ends, recording every chunk's arrival time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import grpc
import openai

from services.worker.tiny import WORDS
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

Kind = Literal["text", "chat"]
# How a request travels: gRPC with text / token ids / chat messages, or HTTP completions / chat.
Front = Literal["grpc-text", "grpc-ids", "grpc-chat", "http-completions", "http-chat"]
FRONTS: dict[Kind, dict[str, tuple[Front, ...]]] = {
    "text": {"grpc": ("grpc-text", "grpc-ids"), "http": ("http-completions",)},
    "chat": {"grpc": ("grpc-chat",), "http": ("http-chat",)},
}
MAX_NEW_TOKENS = (16, 32, 64)
DOC_WORDS = (20, 80, 200, 320)
GRPC_OPTIONS = [  # a client that is back within a second of a restarted tokenizer
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
HTTP_RETRIES = 8  # openai's backoff (0.5 s doubling to 8 s) covers a tokenizer's restart


@dataclass(slots=True)
class Prompt:
    key: str  # "doc2-q1", "solo3", "chat1-q0": the prompts of one document share it as a prefix
    kind: Kind
    prefix: str  # the shared document (chat: the system message); "" for a standalone prompt
    question: str  # what follows it (chat: the user message)
    max_new_tokens: int = 32
    ids: list[int] = field(default_factory=list)  # as the tokenizer service tokenizes it
    want_ids: list[int] = field(default_factory=list)  # transformers' greedy output
    want_text: str = ""  # the whole decode of want_ids
    margin: float = 0.0  # the smallest top-1 minus top-2 logit along the greedy path

    @property
    def text(self) -> str:
        return f"{self.prefix} {self.question}" if self.prefix else self.question

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.prefix}, {"role": "user", "content": self.question}]


def _words(rng: random.Random, lo: int, hi: int | None = None) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi or lo)))


def make_prompts(rng: random.Random, docs: int = 4, questions: int = 3, solos: int = 6, chats: int = 2) -> list[Prompt]:
    """Candidates (not yet tokenized or checked): ``docs`` x ``questions`` text prompts sharing a
    document each, ``solos`` standalone ones and ``chats`` x ``questions`` chat prompts."""
    out: list[Prompt] = []
    for d in range(docs):
        doc = _words(rng, DOC_WORDS[d % len(DOC_WORDS)])
        out += [Prompt(f"doc{d}-q{q}", "text", doc, _words(rng, 3, 12)) for q in range(questions)]
    out += [Prompt(f"solo{s}", "text", "", _words(rng, 2, 40)) for s in range(solos)]
    for c in range(chats):
        doc = _words(rng, DOC_WORDS[(c + 1) % len(DOC_WORDS)])
        out += [Prompt(f"chat{c}-q{q}", "chat", doc, _words(rng, 3, 12)) for q in range(questions)]
    for p in out:
        p.max_new_tokens = rng.choice(MAX_NEW_TOKENS)
    return out


def redraw(p: Prompt, rng: random.Random) -> None:
    """A new question for ``p``; its document (the prefix it shares) stays."""
    p.question = _words(rng, 2, 40) if not p.prefix else _words(rng, 3, 12)


def _post(http: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://{http}{path}", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def tokenize(http: str, p: Prompt) -> list[int]:
    """The prompt's ids as the tokenizer service makes them (chat template for chat prompts)."""
    body: dict[str, Any] = (
        {"messages": p.messages(), "add_generation_prompt": True} if p.kind == "chat" else {"prompt": p.text}
    )
    return [int(t) for t in _post(http, "/tokenize", body)["tokens"]]


def greedy(model: Any, ids: list[int], n: int) -> tuple[list[int], float]:
    """transformers' greedy ids for ``ids`` (eos ignored) and the smallest top-1 minus top-2 logit."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n,
            do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    top2 = [s[0].topk(2).values for s in out.scores]
    return out.sequences[0, len(ids) :].tolist(), min(float(v[0] - v[1]) for v in top2)


def reference(model_dir: Path, http: str, prompts: list[Prompt], rng: random.Random, margin: float,
              tries: int = 20) -> None:  # fmt: skip
    """Fill ``ids``, ``want_ids``, ``want_text`` and ``margin`` of every prompt, drawing a new
    question for one whose greedy path has a step closer than ``margin`` (ValueError after ``tries``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for p in prompts:
        for _ in range(tries):
            p.ids = tokenize(http, p)
            p.want_ids, p.margin = greedy(model, p.ids, p.max_new_tokens)
            if p.margin >= margin:
                break
            redraw(p, rng)
        else:
            raise ValueError(f"{p.key}: no question in {tries} tries has a greedy margin >= {margin}")
        p.want_text = str(tok.decode(p.want_ids, skip_special_tokens=True))


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it."""

    n: int  # order of sending
    front: Front
    prompt: str  # Prompt.key
    sent: float  # monotonic seconds
    ended: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of every chunk that carried output
    ids: list[int] = field(default_factory=list)  # gRPC: the token ids streamed
    text: str = ""  # the text streamed
    finish: str = ""  # finish reason ("length", ...); "" when the stream broke
    error: str = ""  # why it failed: gRPC status and details, or the HTTP client's exception


async def _grpc_request(api: pgrpc.StrataStub, front: Front, p: Prompt, o: Outcome, timeout_s: float) -> None:
    sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=p.max_new_tokens, ignore_eos=True)
    req = pb.GenerateRequest(request_id=f"chaos-{o.n}", sampling=sampling, stream=True)
    if front == "grpc-ids":
        req.input_ids.ids.extend(p.ids)
    elif front == "grpc-chat":
        for m in p.messages():
            req.messages.messages.add(role=m["role"], content=m["content"])
    else:
        req.text = p.text
    try:
        async for r in api.Generate(req, timeout=timeout_s, wait_for_ready=True):
            if r.token_ids or r.text:
                o.times.append(time.monotonic())
            o.ids += r.token_ids
            o.text += r.text
            if r.finish_reason:
                o.finish = pb.FinishReason.Name(r.finish_reason).removeprefix("FINISH_REASON_").lower()
                if r.finish_reason == pb.FINISH_REASON_ERROR:
                    o.error = f"FINISH_REASON_ERROR {r.error}"
    except grpc.aio.AioRpcError as e:
        o.error = f"{e.code().name} {e.details()}"


async def _http_request(client: openai.AsyncOpenAI, model: str, front: Front, p: Prompt, o: Outcome) -> None:
    extra = {"ignore_eos": True}
    try:
        if front == "http-chat":
            messages = cast("list[ChatCompletionMessageParam]", p.messages())
            chat = await client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=p.max_new_tokens,
                temperature=0,
                stream=True,
                extra_body=extra,
            )
            async for c in chat:
                if c.choices and c.choices[0].delta.content:
                    o.times.append(time.monotonic())
                    o.text += c.choices[0].delta.content
                if c.choices and c.choices[0].finish_reason:
                    o.finish = c.choices[0].finish_reason
        else:
            comp = await client.completions.create(
                model=model, prompt=p.text, max_tokens=p.max_new_tokens, temperature=0, stream=True, extra_body=extra
            )
            async for d in comp:
                if d.choices and d.choices[0].text:
                    o.times.append(time.monotonic())
                    o.text += d.choices[0].text
                if d.choices and d.choices[0].finish_reason:
                    o.finish = d.choices[0].finish_reason
    except Exception as e:
        o.error = f"{type(e).__name__} {e}".strip()


@dataclass(slots=True)
class Endpoints:
    grpc: str  # the tokenizer's strata.v1.Strata address
    http: str  # its HTTP host:port
    model: str  # the served model name


async def client_loop(
    ep: Endpoints, side: Literal["grpc", "http"], prompts: list[Prompt], rng: random.Random,
    running: Callable[[], bool], record: Callable[[Outcome], None], number: Callable[[], int],
    timeout_s: float = 120.0, think_s: float = 0.2,
) -> None:  # fmt: skip
    """Streamed requests one after another while ``running()``: a random prompt, a random front of
    this ``side`` that fits it, then up to ``think_s`` of pause."""
    async with grpc.aio.insecure_channel(ep.grpc, options=GRPC_OPTIONS) as channel:
        api = pgrpc.StrataStub(channel)
        client = openai.AsyncOpenAI(
            base_url=f"http://{ep.http}/v1", api_key="none", max_retries=HTTP_RETRIES, timeout=timeout_s
        )
        try:
            while running():
                p = rng.choice(prompts)
                front = rng.choice(FRONTS[p.kind][side])
                o = Outcome(number(), front, p.key, time.monotonic())
                if side == "grpc":
                    await _grpc_request(api, front, p, o, timeout_s)
                else:
                    await _http_request(client, ep.model, front, p, o)
                o.ended = time.monotonic()
                record(o)
                await asyncio.sleep(rng.random() * think_s)
        finally:
            await client.close()


def _problem(p: Prompt, o: Outcome) -> str:
    """How an undisturbed run of ``p`` differs from the reference ("" when it does not)."""
    if o.error:
        return o.error
    if o.front.startswith("grpc") and o.ids != p.want_ids:
        return "ids differ from transformers"
    return "text differs from transformers' decode" if o.text != p.want_text else ""


async def verify(ep: Endpoints, prompts: list[Prompt], timeout_s: float = 120.0) -> list[str]:
    """Every prompt once through every front that fits it, on the undisturbed stack; return what
    disagrees with the reference."""
    async with grpc.aio.insecure_channel(ep.grpc, options=GRPC_OPTIONS) as channel:
        api = pgrpc.StrataStub(channel)
        client = openai.AsyncOpenAI(base_url=f"http://{ep.http}/v1", api_key="none", timeout=timeout_s)
        try:
            pairs = [(p, f) for p in prompts for f in FRONTS[p.kind]["grpc"]]  # numbered -1, -2, ...: unique ids
            runs = [(p, Outcome(-1 - i, f, p.key, time.monotonic())) for i, (p, f) in enumerate(pairs)]
            await asyncio.gather(*(_grpc_request(api, o.front, p, o, timeout_s) for p, o in runs))
            problems = [f"{p.key} {o.front}: {_problem(p, o)}" for p, o in runs if _problem(p, o)]
            http = [(p, Outcome(-1, FRONTS[p.kind]["http"][0], p.key, time.monotonic())) for p in prompts]
            await asyncio.gather(*(_http_request(client, ep.model, o.front, p, o) for p, o in http))
            problems += [f"{p.key} {o.front}: {_problem(p, o)}" for p, o in http if _problem(p, o)]
            return problems
        finally:
            await client.close()
