"""The public ``strata.v1.Strata`` service: tokenize, route to a scheduler, detokenize."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from prometheus_client import CollectorRegistry

from services.common import telemetry, validation
from services.common.auth import ApiKeys, AuthInterceptor
from services.common.discovery import ModelRegistry, Registration, ServiceRecord, advertised_address
from services.common.errors import AlreadyExists, InvalidArgument, StrataError
from services.common.etcd_proc import follow_parent
from services.common.metrics import LENGTH_BUCKETS, REQUEST_BUCKETS_S, MetricFactory, serve_metrics
from services.common.server import Server, run_service, settle_heap
from services.tokenizer.answer import Answer
from services.tokenizer.chat import Prepared, chat_inputs, render
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.fronts import Fronts, check_port_free
from services.tokenizer.http_server import HttpServer
from services.tokenizer.kv_index import Choice
from services.tokenizer.model_files import ModelCard, load_tokenizer, read_card
from services.tokenizer.openai_api import OpenAIFront
from services.tokenizer.reasoning import ReasoningFormat, prompt_closes_reasoning, prompt_opens_reasoning
from services.tokenizer.router import Router, Ticket
from services.tokenizer.session import Chunk, Inbox
from services.tokenizer.tool_parsers import ToolFormat
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc

log = logging.getLogger(__name__)
_tracer = telemetry.get_tracer(__name__)

PUBLIC_MAX_BYTES = 32 << 20  # one request on the public port (as the HTTP body limit)
RESUBMIT_S = 0.2  # pause before submitting again after a scheduler was lost (it may be restarting)
ABORT_TIMEOUT_S = 5.0  # how long an Abort waits for each scheduler it asks
FINGERPRINT_READ_S = 2.0  # GetModelInfo waits this long for etcd while the fingerprint is unknown
TOKENIZE_THREADS = 2  # encodes run here, off the event loop; more wait in the pool's queue
T = TypeVar("T")


class Relay(StrataError):
    """A scheduler's error status, passed on unchanged."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class TokenizerMetrics:
    """Per-request metrics of the public API (gRPC and HTTP alike), labelled by served model."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        m = MetricFactory(registry, "tokenizer")
        M = ["model_name"]
        self.requests = m.counter("requests", "Requests finished, by finish reason.", [*M, "finish_reason"])
        self.prompt_tokens = m.counter("prompt_tokens", "Prompt tokens of finished requests.", M)
        self.cached_tokens = m.counter("cached_tokens", "Prompt tokens served from a cache.", M)
        self.completion_tokens = m.counter("completion_tokens", "Tokens generated.", M)
        self.ttft_seconds = m.histogram("ttft_seconds", "Time to first token.", M, REQUEST_BUCKETS_S)
        self.itl_seconds = m.histogram("inter_token_latency_seconds", "Time between output tokens.", M)
        self.latency_seconds = m.histogram("e2e_latency_seconds", "Request to last token.", M, REQUEST_BUCKETS_S)
        self.prompt_len = m.histogram("request_prompt_tokens", "Prompt length per request.", M, LENGTH_BUCKETS)
        self.output_len = m.histogram("request_generation_tokens", "Output length per request.", M, LENGTH_BUCKETS)
        R = ["replica"]
        self.routed_requests = m.counter("routed_requests", "Requests finished, by the scheduler routed to.", R)
        self.routed_prompt = m.counter("routed_prompt_tokens", "Prompt tokens of those requests.", R)
        self.routed_cached = m.counter("routed_cached_tokens", "Their prompt tokens the replica served from cache.", R)
        self.routed_predicted = m.counter(
            "routed_predicted_cached_tokens", "Their prompt tokens the router expected the replica to hold.", R
        )
        self.resumed = m.counter(
            "resumed_requests", "Requests that went on on another (or a restarted) scheduler after theirs was lost.", M
        )
        self.handoffs = m.counter(
            "handed_over_requests", "Requests a prefill replica handed to a decode replica after one token.", M
        )
        self.index_pages = m.gauge("router_index_pages", "Page keys in the router's cache index (every replica).")
        self.model = model
        self._itl = self.itl_seconds.labels(model)  # observed per chunk: the labelled child, looked up once

    def tokens(self, n: int, gap_s: float) -> None:
        """``n`` tokens arrived ``gap_s`` after the previous ones."""
        if n > 0:
            self._itl.observe(gap_s / n)

    def routed(self, choice: Choice, usage: pb.Usage) -> None:
        """Where a finished request went: predicted and realised cache hits per replica."""
        a = choice.address
        self.routed_requests.labels(a).inc()
        self.routed_prompt.labels(a).inc(usage.prompt_tokens)
        self.routed_cached.labels(a).inc(usage.cached_tokens)
        self.routed_predicted.labels(a).inc(choice.overlap_tokens)

    def finished(self, last: pb.GenerateResponse, t0: float, first: float | None) -> None:
        name = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        model = self.model
        self.requests.labels(model, name).inc()
        self.prompt_tokens.labels(model).inc(last.usage.prompt_tokens)
        self.cached_tokens.labels(model).inc(last.usage.cached_tokens)
        self.completion_tokens.labels(model).inc(last.usage.completion_tokens)
        self.prompt_len.labels(model).observe(last.usage.prompt_tokens)
        self.output_len.labels(model).observe(last.usage.completion_tokens)
        now = time.perf_counter()
        if first is not None:
            self.ttft_seconds.labels(model).observe(first - t0)
        self.latency_seconds.labels(model).observe(now - t0)


class StrataServicer(pgrpc.StrataServicer):
    def __init__(
        self,
        tokenizer: object,
        card: ModelCard,
        router: Router,
        fingerprint: str | Callable[[], Awaitable[str]] = "",
        metrics: TokenizerMetrics | None = None,
        resume_wait_s: float = 10.0,
        tool_format: ToolFormat = "hermes",
        reasoning: ReasoningFormat = "none",
        shared_ids: bool = False,
    ) -> None:
        """``tool_format``, ``reasoning``: the model's formats (``--tool-call-parser``,
        ``--reasoning-parser``), which tool-call grammars follow. ``shared_ids``: other front
        processes serve the same ports (``--front-processes``), so an ``Abort`` of an id unknown
        here goes to every scheduler. ``fingerprint``: the model's, or how to read it (from etcd,
        where the first worker registers it: a tokenizer may start before any worker), read again
        by ``GetModelInfo`` until it is known."""
        self.metrics = metrics
        self.shared_ids = shared_ids
        self.tool_format: ToolFormat = tool_format
        self.reasoning: ReasoningFormat = reasoning
        self.resume_wait_s = resume_wait_s  # a request whose scheduler was lost waits this long for another
        self.tok = tokenizer
        self.card = card
        self.router = router
        self.fingerprint = fingerprint if isinstance(fingerprint, str) else ""
        self._read_fingerprint = None if isinstance(fingerprint, str) else fingerprint
        self.limits = validation.Limits(card.vocab_size, card.context_length)
        self._running: dict[str, str] = {}  # request id -> scheduler address
        self._pool = ThreadPoolExecutor(max_workers=TOKENIZE_THREADS, thread_name_prefix="tokenize")
        # The detokenizer decodes twice per token: transformers' decode is the Rust decoder behind
        # ~4 µs of Python, so call the decoder itself when that is all the wrapper would do.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._decode = backend.decode if backend is not None and not cleanup else tokenizer.decode  # type: ignore[attr-defined]
        self._backend = backend if backend is not None and not cleanup else None  # the detokenizer's DecodeStream

    # -- helpers --------------------------------------------------------------------------------
    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(list(ids), skip_special_tokens=True)

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        """Tokenizer work in the bounded pool: a long text must not hold the event loop (other
        requests, the etcd lease) while it is encoded."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def prepare(self, request: pb.GenerateRequest) -> Prepared:
        """Validate and tokenize the request's input (a conversation rendered by the chat template,
        with its tools) and turn its constraint into what the scheduler compiles (a tool-call
        constraint becomes the EBNF of the calls)."""
        kind = request.WhichOneof("input")
        tok = self.tok
        chat = None
        text = ""
        if kind == "text":
            if not request.text:
                raise InvalidArgument("input.text: must not be empty")
            validation.check_text("input.text", len(request.text), self.limits)
            text = request.text
        elif kind == "messages":
            chat = chat_inputs(request.messages)
            validation.check_text("input.messages", chat.chars, self.limits)
            text = await self._off_loop(lambda: render(tok, chat))
        elif kind != "input_ids":
            raise InvalidArgument("input: one of text, messages or input_ids is required")
        if kind == "input_ids":
            ids = list(request.input_ids.ids)
        else:
            ids = await self._off_loop(lambda: list(tok.encode(text, add_special_tokens=False)))  # type: ignore[attr-defined]
        validation.check_ids(
            f"input.{kind}" if kind != "input_ids" else "input.input_ids.ids", ids, self.limits
        )
        thinking = self.reasoning != "none" and chat is not None
        reasoning_open = thinking and prompt_opens_reasoning(text)
        constraint: spb.Constraint | None = None
        ckind = request.WhichOneof("constraint")
        if ckind == "tool_calls":
            if chat is None or not chat.specs:
                raise InvalidArgument("constraint.tool_calls: needs a conversation (messages) with tools")
            tc = request.tool_calls
            if tc.name and tc.name not in {t.name for t in chat.specs}:
                raise InvalidArgument(f"constraint.tool_calls.name: {tc.name!r} is not one of the tools")
            prefix = "none"
            if thinking and not prompt_closes_reasoning(text):
                prefix = "open" if reasoning_open else "optional"
            # The scheduler builds the calls' grammar from the tools (it holds xgrammar; this
            # process stays without it, and without torch).
            calls = spb.ToolCalls(tools=chat.specs, format=self.tool_format, name=tc.name,
                                  parallel=tc.parallel, reasoning=prefix)  # fmt: skip
            constraint = spb.Constraint(tool_calls=calls)
        elif ckind:
            validation.check_grammar(f"constraint.{ckind}", getattr(request, ckind))
            constraint = spb.Constraint(**{ckind: getattr(request, ckind)})
        return Prepared(ids, constraint, reasoning_open, chat.schemas if chat is not None else {})

    # -- RPCs -----------------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for resp in self.generate(request, context.time_remaining()):
            yield resp

    async def generate(
        self, request: pb.GenerateRequest, timeout_s: float | None = None, prepared: Prepared | None = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The one path of every generation request, gRPC and HTTP: validate, tokenize, route,
        detokenize. ``prepared``: the request's ``prepare`` already done (the HTTP front prepares
        a body once for all its choices). Raises ``StrataError`` subclasses (a scheduler's status
        as ``Relay``)."""
        rid = request.request_id or uuid.uuid4().hex
        validation.check_request_id(rid)
        validation.check_cache_salt(request.cache_salt)
        if prepared is None:
            prepared = await self.prepare(request)
        sreq, gen = self._scheduler_request(request, prepared, rid)
        if rid in self._running:  # checked and claimed with no await between: the id is ours
            raise AlreadyExists(f"request_id: {rid!r} is already running")
        self._running[rid] = ""
        # Our own CLIENT span, ended below whatever way the stream ends (an interceptor's span stays
        # open when the tokenizer stops reading early, and the scheduler's span loses its parent).
        span = _tracer.start_span(
            "/strata.scheduler.v1.Scheduler/Generate",
            kind=SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "strata.request_id": rid},
        )
        trace_context = telemetry.inject_context(set_span_in_context(span))
        detok = IncrementalDetokenizer(self.decode, gen.stop, prompt_tail=prepared.ids, backend=self._backend)
        answer = Answer(rid, request.stream, len(prepared.ids), detok,
                        self.metrics.tokens if self.metrics is not None else None)  # fmt: skip
        inbox: Inbox | None = None
        ticket: Ticket | None = None
        tried: set[str] = set()  # schedulers that answered UNAVAILABLE (no worker) for this request
        try:
            inbox, chunk, ticket = await self._open(rid, sreq, trace_context, timeout_s, tried, role="prefill")
            span.set_attribute("strata.replica", ticket.choice.address)
            span.set_attribute("strata.predicted_cached_tokens", ticket.choice.overlap_tokens)
            while True:
                end = chunk.end
                failure = end if end is not None and end.status_code else None
                # A prefill replica's hand-over: its tokens go out, then a decode replica goes on.
                handoff = end is not None and end.handoff and failure is None
                # A failure's or hand-over's tokens (sampled before it) still go out first.
                final = answer.take(chunk, None if failure is not None or handoff else end, inbox.cached_tokens)
                resume = failure is not None and self._resumable(chunk, failure, ticket, tried, answer.progressed)
                if failure is not None and not final.finish_reason and not resume:
                    if request.stream and final.token_ids:
                        yield final
                    code = _CODES.get(failure.status_code, grpc.StatusCode.UNKNOWN)
                    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {failure.error}"))
                    raise Relay(code, failure.error or code.name)
                if request.stream:
                    if final.token_ids or final.finish_reason or not (resume or handoff):
                        yield final
                else:
                    answer.keep(final)
                if final.finish_reason:
                    self._finished(span, answer, final, ticket)
                    if not request.stream:
                        yield answer.whole(final)
                    return
                if resume or handoff:
                    inbox, chunk, ticket = await self._go_on(
                        answer, sreq, gen.max_new_tokens, chunk, inbox, ticket, handoff, trace_context, timeout_s,
                        tried, span,
                    )  # fmt: skip
                    continue
                chunk = await inbox.next()
        finally:
            self._running.pop(rid, None)
            if inbox is not None:
                inbox.close()
            if ticket is not None:
                ticket.finish()
            span.end()

    def _scheduler_request(
        self, request: pb.GenerateRequest, prepared: Prepared, rid: str
    ) -> tuple[spb.GenerateRequest, validation.Generation]:
        """The request as the scheduler takes it, and its checked generation settings."""
        ids = prepared.ids
        scoring = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
        gen = validation.generation(
            request.sampling, len(ids), self.limits, request.return_logprobs, request.top_logprobs, scoring
        )
        sreq = spb.GenerateRequest(
            request_id=rid,
            input_ids=ids,
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            return_logprobs=request.return_logprobs,
            top_logprobs=request.top_logprobs,
            prompt_logprobs=scoring,
        )
        if not sreq.sampling.HasField("seed"):  # ours, so that a resumed stream draws as this one would
            sreq.sampling.seed = secrets.randbits(63)
        if prepared.constraint is not None:
            sreq.constraint.CopyFrom(prepared.constraint)
        return sreq, gen

    def _finished(self, span: Span, answer: Answer, final: pb.GenerateResponse, ticket: Ticket | None) -> None:
        span.set_attribute("strata.cached_tokens", final.usage.cached_tokens)
        if self.metrics is not None:
            self.metrics.finished(final, answer.t0, answer.first)
            if ticket is not None:
                self.metrics.routed(ticket.choice, final.usage)

    async def _go_on(
        self, answer: Answer, sreq: spb.GenerateRequest, max_new_tokens: int, chunk: Chunk, inbox: Inbox,
        ticket: Ticket, handoff: bool, trace_context: dict[str, str], timeout_s: float | None, tried: set[str],
        span: Span,
    ) -> tuple[Inbox, Chunk, Ticket]:
        """The scheduler died (or lost its worker for good) mid-stream, or a prefill replica handed
        the request over: it goes on from the tokens already streamed, on another replica (a decode
        one after a hand-over) or the restarted one."""
        if not handoff:
            why = "lost" if chunk.lost else "has no worker"
            log.info("request %s: scheduler %s %s after %d tokens; resuming", answer.rid, ticket.choice.address,
                     why, len(answer.streamed))  # fmt: skip
        if answer.cached is None and answer.streamed:
            answer.cached = inbox.cached_tokens
        inbox.close()
        ticket.finish()
        if not handoff and chunk.lost:
            self.router.set_aside(ticket.choice.address)
        left = None if timeout_s is None else max(timeout_s - (time.perf_counter() - answer.t0), 0.001)
        cont = _continuation(sreq, answer.streamed, max_new_tokens)
        inbox, chunk, ticket = await self._open(answer.rid, cont, trace_context, left, tried, role="decode")
        answer.progressed = False
        if self.metrics is not None:
            (self.metrics.handoffs if handoff else self.metrics.resumed).labels(self.metrics.model).inc()
        span.add_event("handed over" if handoff else "resumed",
                       {"strata.replica": ticket.choice.address, "strata.tokens": len(answer.streamed)})  # fmt: skip
        return inbox, chunk, ticket

    def _resumable(
        self, chunk: Chunk, failure: spb.RequestEnd, ticket: Ticket, tried: set[str], progressed: bool
    ) -> bool:
        """Whether a request that failed with ``failure`` on its ticket's scheduler goes on
        elsewhere: when that scheduler was lost after it had sent tokens (``_open`` then waits for
        one to take it; a lost one that sent nothing is what ``_open`` gave up on); when it answered
        UNAVAILABLE (its worker is gone), while another scheduler is registered (``tried`` grows by
        one each time: bounded)."""
        if chunk.lost:
            return progressed
        if failure.status_code != grpc.StatusCode.UNAVAILABLE.value[0]:
            return False
        tried.add(ticket.choice.address)
        return len(tried) < self.router.count()

    async def _open(
        self, rid: str, sreq: spb.GenerateRequest, trace_context: dict[str, str], timeout_s: float | None,
        tried: set[str], role: str = "",
    ) -> tuple[Inbox, Chunk, Ticket]:
        """Submit ``sreq`` to a scheduler and wait for its first chunk. A scheduler that answers
        nothing before its session breaks (dead: still registered until its lease ends, or not yet
        restarted) is set aside and the request submitted again, to another replica or the same
        address once it serves again, for up to ``--resume-wait-s``; one that answers
        UNAVAILABLE (no worker) joins ``tried`` while another scheduler is registered, so a dead
        or restarted scheduler costs a request nothing while another serves."""
        unavailable = grpc.StatusCode.UNAVAILABLE.value[0]
        deadline = time.monotonic() + self.resume_wait_s
        lost = False
        tokens = [*sreq.input_ids, *sreq.output_ids]
        while True:
            ticket, session = await self.router.pick(exclude=tried, tokens=tokens, salt=sreq.cache_salt, role=role)
            address = ticket.choice.address
            self._running[rid] = address
            # The client's deadline goes with the request: the scheduler drops it when it passes.
            inbox = session.submit(sreq, trace_context, timeout_s)
            first = await inbox.next()
            end = first.end
            if end is not None and end.status_code == unavailable and not first.token_ids:
                if first.lost and time.monotonic() < deadline:
                    ticket.finish()
                    # Once per request at info: it is tried every RESUBMIT_S while the scheduler restarts.
                    log.log(logging.DEBUG if lost else logging.INFO, "scheduler %s lost (%s); submitting again",
                            address, end.error)  # fmt: skip
                    lost = True
                    self.router.set_aside(address)
                    await asyncio.sleep(RESUBMIT_S)
                    continue
                if not first.lost and len(tried) + 1 < self.router.count():
                    ticket.finish()
                    log.info("scheduler %s unavailable (%s); trying another", address, end.error)
                    self.router.set_aside(address)
                    tried.add(address)
                    continue
            ticket.first_token()
            return inbox, first, ticket

    # -- the HTTP front's tokenizer routes (/tokenize, /detokenize) ------------------------------
    async def tokenize_text(self, text: str, add_special_tokens: bool) -> list[int]:
        validation.check_text("input.text", len(text), self.limits)
        tok = self.tok
        return await self._off_loop(lambda: list(tok.encode(text, add_special_tokens=add_special_tokens)))  # type: ignore[attr-defined]

    async def tokenize_chat(
        self, chat: pb.ChatMessages, add_generation_prompt: bool, continue_final: bool, add_special_tokens: bool
    ) -> list[int]:
        """A conversation's ids as ``prepare`` renders it, with vLLM's /tokenize options."""
        inputs = chat_inputs(chat)
        validation.check_text("input.messages", inputs.chars, self.limits)
        tok = self.tok
        text = await self._off_loop(lambda: render(tok, inputs, add_generation_prompt, continue_final))
        return await self._off_loop(lambda: list(tok.encode(text, add_special_tokens=add_special_tokens)))  # type: ignore[attr-defined]

    def token_strs(self, ids: list[int]) -> list[str]:
        return list(self.tok.convert_ids_to_tokens(ids))  # type: ignore[attr-defined]

    def detokenize_ids(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens included."""
        bad = [i for i in ids if i >= self.limits.vocab_size]
        if bad:
            raise InvalidArgument(f"tokens: {bad[0]} is out of range; ids must be below {self.limits.vocab_size}")
        return str(self.tok.decode(ids, skip_special_tokens=False))  # type: ignore[attr-defined]

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        validation.check_text("text", len(request.text), self.limits)
        tok, text = self.tok, request.text
        ids = await self._off_loop(lambda: tok.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
        return pb.TokenizeResponse(ids=ids)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        ids = list(request.ids)
        bad = [i for i in ids if i >= self.limits.vocab_size]
        if bad:
            raise InvalidArgument(
                f"ids: {bad[0]} is out of range; ids must be below {self.limits.vocab_size}"
            )
        text = self.tok.decode(ids, skip_special_tokens=request.skip_special_tokens)  # type: ignore[attr-defined]
        return pb.DetokenizeResponse(text=text)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        address = self._running.get(request.request_id)
        if address:
            addresses = [address]
        elif self.shared_ids and request.request_id not in self._running:  # another front process's?
            addresses = self.router.addresses()
        else:  # unknown, or not yet on a scheduler
            return pb.AbortResponse(aborted=False)
        metadata = tuple(telemetry.inject_context().items())
        sreq = spb.AbortRequest(request_id=request.request_id)
        # Every scheduler at once, each bounded: one that is dead or frozen (still registered)
        # neither hides the others nor holds the client. The answer is an error only when no
        # scheduler answered at all.
        answers = await asyncio.gather(
            *(self.router.stub(a).Abort(sreq, metadata=metadata, timeout=ABORT_TIMEOUT_S) for a in addresses),
            return_exceptions=True,
        )
        replies = [r for r in answers if isinstance(r, spb.AbortResponse)]
        if not replies:
            error = next(r for r in answers if isinstance(r, BaseException))
            raise error
        return pb.AbortResponse(aborted=any(r.aborted for r in replies))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        c = self.card
        if not self.fingerprint and self._read_fingerprint is not None:
            try:  # best effort: the model's answer does not wait on an etcd outage
                self.fingerprint = await asyncio.wait_for(self._read_fingerprint(), FINGERPRINT_READ_S)
            except Exception as e:  # any etcd failure leaves the field empty, as before a worker registers
                log.warning("model fingerprint not read from etcd: %s", e)
        return pb.ModelInfo(
            name=c.name,
            architecture=c.architecture,
            vocab_size=c.vocab_size,
            context_length=c.context_length,
            eos_token_ids=c.eos_token_ids,
            fingerprint=self.fingerprint,
            hybrid=c.hybrid,
        )


def _continuation(sreq: spb.GenerateRequest, streamed: list[int], max_new_tokens: int) -> spb.GenerateRequest:
    """``sreq`` resumed after ``streamed`` output tokens: the same prompt, seed, stop conditions
    and grammar, the tokens so far as ``output_ids`` (they count against ``max_new_tokens``)."""
    cont = spb.GenerateRequest()
    cont.CopyFrom(sreq)
    cont.output_ids[:] = streamed
    cont.sampling.max_new_tokens = max_new_tokens
    cont.ClearField("prompt_logprobs")  # scored where it began, sent with the first token
    return cont


async def serve(cfg: TokenizerConfig, stop: asyncio.Event) -> None:
    if cfg.front_index:  # started by the first front process: end with it
        follow_parent(f"tokenizer-front{cfg.front_index}")
    telemetry.setup_tracing(
        "tokenizer", cfg.trace_exporter, cfg.trace_target.replace("{service}", "tokenizer")
    )
    model_dir = Path(cfg.model)
    card = read_card(model_dir, cfg.model_name)
    tok = await asyncio.to_thread(load_tokenizer, model_dir)

    async def read_fingerprint() -> str:
        async with ModelRegistry(cfg.etcd) as models:
            rec = await models.get(card.name)
        return rec.fingerprint if rec is not None else ""

    router = Router(
        cfg.scheduler, cfg.etcd, card.name, cfg.scheduler_wait_s, cfg.router_policy, cfg.router_load_weight
    )
    await router.start()
    keys = ApiKeys.load(cfg.api_key, cfg.api_key_file)
    shared = cfg.front_processes > 1  # the ports are shared with the other front processes (fronts.py)
    if shared and cfg.front_index == 0 and cfg.port:
        check_port_free(cfg.host, cfg.port)  # SO_REUSEPORT below would share it with anything else
    server = Server(
        [*telemetry.server_interceptors(), AuthInterceptor(keys)], max_receive_bytes=PUBLIC_MAX_BYTES,
        client_auth=False, reuse_port=shared,
    )  # fmt: skip
    registry = CollectorRegistry()
    metrics = TokenizerMetrics(registry, card.name)
    metrics.index_pages.set_function(lambda: router.index.pages)
    servicer = StrataServicer(
        tok, card, router, read_fingerprint if cfg.etcd else "", metrics, resume_wait_s=cfg.resume_wait_s,
        tool_format=cfg.tool_call_parser, reasoning=cfg.reasoning_parser, shared_ids=shared,
    )  # fmt: skip
    server.add(pgrpc.add_StrataServicer_to_server, servicer, "strata.v1.Strata")
    port = await server.start(f"{cfg.host}:{cfg.port}")
    address = advertised_address(cfg.host, port, cfg.advertise_host)
    http = None
    ready_line = f"READY tokenizer {address}{serve_metrics(cfg.metrics_port, cfg.host, registry)}"
    if cfg.http_port:
        front = OpenAIFront(
            servicer, card.name, card.context_length, keys, registry, router.ready,
            cfg.tool_call_parser, cfg.reasoning_parser,
        )  # fmt: skip
        http = HttpServer(front.app(), cfg.host, max(cfg.http_port, 0), cfg.tls_cert, cfg.tls_key, cfg.http_fd)
        await http.start()
        ready_line += f" {'https' if cfg.tls_cert else 'http'}={cfg.host}:{http.port}"
        log.info("tokenizer serving the OpenAI-compatible API on http://%s:%d/v1", cfg.host, http.port)
    registration = None
    if cfg.etcd:
        record = ServiceRecord("tokenizer", cfg.instance_id or f"tokenizer-{port}", address, card.name)
        registration = Registration(cfg.etcd, record)
        await registration.start()
    fronts = None
    if shared and cfg.front_index == 0:
        fronts = Fronts(cfg, port, http.fd if http is not None else -1)
        await fronts.start(stop)
    log.info("tokenizer serving strata.v1.Strata on %s", address)
    settle_heap()
    print(ready_line, flush=True)
    await stop.wait()
    if fronts is not None:
        await fronts.stop()
    if http is not None:
        await http.stop()
    if registration is not None:
        await registration.stop()
    await server.stop()
    await router.close()
    telemetry.shutdown_tracing()
    if fronts is not None and fronts.lost:
        raise SystemExit(f"tokenizer: {fronts.lost}")


def main(argv: Sequence[str] | None = None) -> None:
    run_service("tokenizer", TokenizerConfig, serve, argv)


if __name__ == "__main__":
    main()
