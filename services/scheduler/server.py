"""The scheduler's gRPC servicer (a thin adapter over ``SchedulerLoop``) and its process."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode, use_span
from prometheus_client import CollectorRegistry

from services.common import step_codec, telemetry, validation
from services.common.discovery import Discovery, Registration, ServiceRecord, advertised_address
from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, Unavailable
from services.common.metrics import serve_metrics
from services.common.server import Server, run_service, settle_heap
from services.scheduler.budget_ledger import BudgetLedger
from services.scheduler.config import SchedulerConfig
from services.scheduler.grammar import Constraint, GrammarService, Matcher
from services.scheduler.l3_lookup import L3Lookup
from services.scheduler.loop import SchedulerLoop
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import FailEvent, FinishEvent, PromptEvent, Req, TokenEvent
from services.scheduler.session import FINISH_PB, prompt_logprobs_pb
from services.scheduler.session import Session as Mux
from services.scheduler.tool_grammar import tool_calls_key
from services.scheduler.worker_link import GrpcWorkerLink, WorkerGone
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc
from strata.v1 import strata_pb2 as pb

log = logging.getLogger(__name__)

# WatchCache: with no cache change, the load is sent at most this often (when it changed).
LOAD_INTERVAL_S = 0.05
DECODE_L3_LOOKUP_S = 1.0  # the decode role's least L3 lookup deadline

_tracer = telemetry.get_tracer(__name__)


class SchedulerServicer(sgrpc.SchedulerServicer):
    def __init__(
        self, loop: SchedulerLoop, tokenizer_dir: str = "", grammar_cache: int = 64, l3: L3Lookup | None = None,
        role: str = "both",
    ) -> None:
        self.loop = loop
        self.role = role
        self.l3 = l3
        self._tokenizer_dir = tokenizer_dir
        self._grammar_cache = grammar_cache
        self._grammars: asyncio.Future[GrammarService] | None = None  # built once, by the first grammar

    async def _matcher(self, c: spb.Constraint) -> Matcher | None:
        """Compile (cached, off the event loop) before the request takes any slot; a bad grammar
        is INVALID_ARGUMENT here."""
        kind = c.WhichOneof("kind")
        if kind is None:
            return None
        if not self._tokenizer_dir:
            raise FailedPrecondition("constraint: this scheduler was started without --tokenizer")
        grammars = await self._grammar_service()
        text = tool_calls_key(c.tool_calls) if kind == "tool_calls" else getattr(c, kind)
        compiled = await grammars.compile(Constraint(kind, text))
        return compiled.matcher()

    async def _grammar_service(self) -> GrammarService:
        """The grammar backend (xgrammar over the tokenizer, sized by the attached worker's
        vocabulary), built once in a thread: by ``preload_grammars`` or the first grammar; callers
        that arrive meanwhile wait for the same build, and a failed build is tried again by the next."""
        info = self.loop.info
        assert info is not None
        if self._grammars is None:
            self._grammars = asyncio.ensure_future(asyncio.to_thread(
                GrammarService, self._tokenizer_dir, info.vocab_size, stop_token_ids=list(info.eos_token_ids),
                cache_size=self._grammar_cache,
            ))  # fmt: skip
        building = self._grammars
        try:
            return await asyncio.shield(building)  # a waiter that leaves does not cancel the build
        except Exception:
            if self._grammars is building:
                self._grammars = None
            raise

    async def preload_grammars(self) -> None:
        """Build the grammar backend as soon as a worker is attached, not at the first constrained
        request: loading xgrammar (and the torch it imports) takes ~4 s of CPU, which that request
        (or one resumed here from a lost replica) would otherwise wait for. A failure is logged;
        the first grammar then tries again and answers with the error."""
        while True:
            try:
                await self.loop.wait_for_worker()
                break
            except Unavailable:  # none within --worker-wait-s (which may be 0): keep waiting
                await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        try:
            await self._grammar_service()
        except Exception as e:  # reported here; the first grammar meets it again
            log.warning("grammar backend failed to load (%s); the first constrained request tries again", e)
            return
        log.info("grammar backend loaded in %.1fs", time.perf_counter() - t0)

    async def _admit(self, request: spb.GenerateRequest, trace_context: dict[str, str], session: bool = False) -> Req:
        """Validate ``request``, compile its grammar, look up L3 and queue it: the one admission
        path of ``Generate`` and ``Session``. Raises ``StrataError`` with the status to return.
        With the prefill role a new request of a session (not a continuation: no ``output_ids``)
        that may run past one token is handed over after its first (``RequestEnd.handoff``)."""
        await self.loop.wait_for_worker()
        limits = self.loop.limits()
        ids = list(request.input_ids)
        validation.check_ids("input_ids", ids, limits)
        validation.check_cache_salt(request.cache_salt)
        scoring = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
        gen = validation.generation(
            request.sampling, len(ids), limits, request.return_logprobs, request.top_logprobs, scoring
        )
        output = list(request.output_ids)
        if output and scoring is not None:
            raise InvalidArgument("prompt_logprobs: not with output_ids (a continuation's prompt was scored "
                                  "where it began)")  # fmt: skip
        if output:
            _check_resumed("output_ids", output, gen.max_new_tokens, limits)
        matcher = await self._matcher(request.constraint)
        if matcher is not None:
            _replay(matcher, output)
        rid = request.request_id or uuid.uuid4().hex
        validation.check_request_id(rid)
        if rid in self.loop.requests:
            raise AlreadyExists(f"request_id: {rid!r} is already running")
        seed = gen.seed if gen.seed is not None else secrets.randbits(63)
        req = Req(rid, ids, gen, seed, request.cache_salt, trace_context=trace_context, grammar=matcher, output=output)
        req.handoff = session and self.role == "prefill" and not output and gen.max_new_tokens > 1
        if self.l3 is not None:
            info = self.loop.info
            assert info is not None
            req.mem.l3_pages = await self.l3.leading_pages(ids, request.cache_salt, info)
        self.loop.submit(req)
        return req

    async def Generate(
        self, request: spb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.GenerateResponse]:
        req = await self._admit(request, telemetry.inject_context())
        rid, prompt_len = req.rid, len(req.prompt)
        scored: pb.PromptLogprobs | None = None  # the scored prompt rides on the next response
        try:
            while True:
                # Everything already queued goes out in one message (tokens first, then the end).
                events = [await req.events.get()]
                while not req.events.empty():
                    events.append(req.events.get_nowait())
                tokens = [e for e in events if isinstance(e, TokenEvent)]
                prompt = next((e for e in events if isinstance(e, PromptEvent)), None)
                if prompt is not None:
                    scored = prompt_logprobs_pb(prompt)
                if tokens:
                    # Usage so far rides along, so a client that stops early still knows its cache hit.
                    usage = pb.Usage(
                        prompt_tokens=prompt_len,
                        completion_tokens=len(req.output),
                        cached_tokens=req.cached_tokens,
                    )
                    yield spb.GenerateResponse(
                        request_id=rid,
                        token_ids=[t for e in tokens for t in e.token_ids],
                        logprobs=[step_codec.logprob_to_pb(lp) for e in tokens for lp in e.logprobs],
                        usage=usage,
                        prompt_logprobs=scored,
                    )
                    scored = None
                failed = next((e for e in events if isinstance(e, FailEvent)), None)
                if failed is not None:
                    raise failed.error
                end = next((e for e in events if isinstance(e, FinishEvent)), None)
                if end is not None:
                    final = _final(rid, end)
                    if scored is not None:  # scored alone (max_new_tokens 0)
                        final.prompt_logprobs.CopyFrom(scored)
                    yield final
                    return
        finally:
            if req.finished is None:  # the client went away: free its memory
                self.loop.abort(rid)
            self.loop.forget(rid)

    async def Session(
        self, request_iterator: AsyncIterator[spb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.SessionEvents]:
        session = Mux(self.loop.abort, self.loop.forget)
        reader = asyncio.create_task(self._read_session(request_iterator, session), name="session reader")
        try:
            while True:
                if not session.wake.is_set() and not reader.done():
                    woken = asyncio.ensure_future(session.wake.wait())
                    await asyncio.wait((woken, reader), return_when=asyncio.FIRST_COMPLETED)
                    woken.cancel()
                msg = session.take()
                if msg is not None:
                    yield msg
                elif reader.done():
                    reader.result()  # a broken client stream ends the call with its error
                    if not session.entries:
                        return  # the client is done sending and every request has ended
                    await session.wake.wait()
        finally:
            reader.cancel()
            session.close()

    async def _read_session(self, requests: AsyncIterator[spb.SessionRequest], session: Mux) -> None:
        async for m in requests:
            if m.WhichOneof("kind") == "abort":
                session.cancel(m.abort)
                continue
            sub = m.submit
            try:
                session.open(sub.handle, functools.partial(self._admit_in_session, session, sub), sub.timeout_s)
            except ValueError as e:
                # A client that reuses a running handle cannot tell its events apart: the session
                # ends with INVALID_ARGUMENT (failing the handle would end the running request).
                raise InvalidArgument(f"handle: {e}") from None

    async def _admit_in_session(self, session: Mux, sub: spb.SessionSubmit) -> None:
        """One submission: admitted under its own SERVER span (a child of the client's), or failed
        with the status ``Generate`` would have returned."""
        parent = telemetry.extract_context(sub.trace_context)
        span = _tracer.start_span(
            "/strata.scheduler.v1.Scheduler/Generate", context=parent, kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "strata.request_id": sub.request.request_id},
        )  # fmt: skip
        try:
            with use_span(span, end_on_exit=False):  # the L3 lookup's client span hangs under it
                req = await self._admit(sub.request, telemetry.inject_context(), session=True)
        except asyncio.CancelledError:
            span.end()
            raise
        except Exception as e:
            span.set_status(Status(StatusCode.ERROR, str(e)))
            span.end()
            session.fail(sub.handle, e)
            return
        session.running(sub.handle, req, span.end)

    async def Abort(self, request: spb.AbortRequest, context: grpc.aio.ServicerContext) -> spb.AbortResponse:
        return spb.AbortResponse(aborted=self.loop.abort(request.request_id))

    async def GetLoad(self, request: spb.GetLoadRequest, context: grpc.aio.ServicerContext) -> spb.Load:
        return self._load()

    async def WatchCache(
        self, request: spb.WatchCacheRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.CacheEvents]:
        log_ = self.loop.cache_events
        sub = log_.subscribe()
        last_load = None
        last_id = 0
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(sub.wake.wait(), LOAD_INTERVAL_S)
                load = self._load()
                batches = log_.take(sub)
                if not batches:  # nothing cached changed: the load alone, when it changed
                    if load == last_load:
                        continue
                    yield spb.CacheEvents(epoch=log_.epoch, event_id=last_id, load=load)
                for b in batches:
                    msg = spb.CacheEvents(
                        epoch=log_.epoch, event_id=b.event_id, snapshot=b.snapshot, stored=b.stored,
                        removed=b.removed, load=load,
                    )
                    if b.snapshot and log_.keying is not None:
                        k = log_.keying
                        msg.keying.CopyFrom(spb.PageKeying(
                            page_tokens=k.page_tokens, model_fingerprint=k.model_fingerprint, layout=k.layout
                        ))
                    last_id = b.event_id
                    yield msg
                last_load = load
        finally:
            log_.unsubscribe(sub)

    def _load(self) -> spb.Load:
        b = self.loop.batcher
        c = self.loop.counters
        load = spb.Load(
            workers=0 if self.loop.link is None else 1,
            prompt_tokens=c.prompt_tokens,
            steps=c.steps,
            worker_busy_s=c.worker_busy_s,
            worker_idle_s=c.worker_idle_s,
        )
        if b is not None:
            u = b.mem.usage()
            load.running, load.waiting = len(b.running), len(b.waiting)
            load.used_slots, load.total_slots, load.evictable_slots = u.used_by_requests, u.size, u.evictable
            load.cached_tokens = b.cached_tokens
        return load


def _check_resumed(name: str, output: list[int], max_new_tokens: int, limits: validation.Limits) -> None:
    """A resumed request's output so far: ids in the vocabulary, fewer than ``max_new_tokens``
    (a request that had them all would have finished where it ran)."""
    validation.check_ids(name, output, limits)
    if len(output) >= max_new_tokens:
        raise InvalidArgument(
            f"{name}: {len(output)} tokens already generated leave nothing to generate "
            f"(sampling.max_new_tokens {max_new_tokens})"
        )


def _replay(matcher: Matcher, output: list[int]) -> None:
    """Advance a resumed request's grammar past the tokens it already streamed."""
    for i, tok in enumerate(output):
        if matcher.is_terminated() or not matcher.accept(tok):
            raise InvalidArgument(f"output_ids[{i}]: token {tok} does not continue the request's grammar")
    if matcher.is_terminated():
        raise InvalidArgument("output_ids: the grammar already ended; there is nothing to generate")


def _final(rid: str, ev: FinishEvent) -> spb.GenerateResponse:
    usage = pb.Usage(
        prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens, cached_tokens=ev.cached_tokens
    )
    return spb.GenerateResponse(request_id=rid, finish_reason=FINISH_PB[ev.reason], usage=usage, error=ev.error)


async def _manage_workers(cfg: SchedulerConfig, loop: SchedulerLoop, stop: asyncio.Event) -> None:
    """Keep one worker attached: a fixed address, or any discovered worker of the model."""
    discovery = None
    if cfg.etcd and not cfg.worker:
        discovery = Discovery(cfg.etcd, "worker")
        await discovery.start()
    current = ""
    try:
        while not stop.is_set():
            if discovery is not None:
                members = {
                    r.address for r in discovery.members().values() if not cfg.model or r.model == cfg.model
                }
                if current and current not in members and loop.link is not None:
                    await loop.detach(f"worker {current} left discovery")
                candidates = sorted(members)
            else:
                candidates = [cfg.worker]
            if loop.link is None:
                current = ""
                for address in candidates:
                    link = GrpcWorkerLink(address, interceptors=telemetry.client_interceptors())
                    try:
                        await link.connect(timeout_s=5.0)
                    except WorkerGone as e:
                        log.info("%s", e)
                        await link.close()
                        continue
                    loop.attach(link)
                    current = address
                    break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    finally:
        if discovery is not None:
            await discovery.stop()


async def serve(cfg: SchedulerConfig, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
    telemetry.setup_tracing("scheduler", cfg.trace_exporter, cfg.trace_target.replace("{service}", "scheduler"))
    registry = CollectorRegistry()
    ledger = None
    if cfg.elastic_shared_budget:  # validated: needs etcd and a budget
        member = cfg.instance_id or f"scheduler-{os.getpid()}"
        ledger = BudgetLedger(cfg.etcd, cfg.elastic_shared_budget, member, cfg.elastic_budget_bytes)
        await ledger.start()
    loop = SchedulerLoop(cfg.loop(), SchedulerMetrics(registry), ledger)
    server = Server(telemetry.server_interceptors())
    # A decode replica's continuations come with their pages just put by a prefill replica: a miss
    # there costs a whole prefill, so its lookup may take longer than a cold request's.
    lookup_s = max(cfg.l3_lookup_timeout_s, DECODE_L3_LOOKUP_S) if cfg.role == "decode" else cfg.l3_lookup_timeout_s
    l3 = L3Lookup(cfg.etcd, lookup_s) if cfg.etcd and cfg.l3_lookup else None
    if l3 is not None:
        await l3.start()
    servicer = SchedulerServicer(loop, cfg.tokenizer, cfg.grammar_cache, l3, cfg.role)
    server.add(sgrpc.add_SchedulerServicer_to_server, servicer, "strata.scheduler.v1.Scheduler")
    port = await server.start(f"{cfg.host}:{cfg.port}")
    address = advertised_address(cfg.host, port, cfg.advertise_host)
    metrics = serve_metrics(cfg.metrics_port, cfg.host, registry)
    registration = None
    if cfg.etcd:
        record = ServiceRecord("scheduler", cfg.instance_id or f"scheduler-{port}", address, model=cfg.model,
                               role=cfg.role)
        registration = Registration(cfg.etcd, record)
        await registration.start()
    tasks = [
        asyncio.create_task(loop.run(stop), name="scheduling loop"),
        asyncio.create_task(_manage_workers(cfg, loop, stop), name="worker watcher"),
    ]
    background: list[asyncio.Task[None]] = []  # cancelled at stop; their end is not the scheduler's
    if cfg.tokenizer and cfg.grammar_preload:
        background.append(asyncio.create_task(servicer.preload_grammars(), name="grammar preload"))
    log.info("scheduler serving on %s", address)
    settle_heap()
    print(f"READY scheduler {address}{metrics}", flush=True)
    if ready is not None:
        ready.set()
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
    died = next((t for t in tasks if t.done()), None)  # the loop or the worker watcher ended by itself
    for t in (stopped, *tasks, *background):
        t.cancel()
    await asyncio.gather(stopped, *tasks, *background, return_exceptions=True)
    if registration is not None:
        await registration.stop()
    if loop.link is not None:
        await loop.link.close()
    if l3 is not None:
        await l3.close()
    if ledger is not None:
        await ledger.stop()
    await server.stop()
    telemetry.shutdown_tracing()
    if died is not None and not stop.is_set():
        # Never keep accepting requests that nothing will run: exit non-zero, to be restarted.
        err = died.exception() if not died.cancelled() else None
        raise RuntimeError(f"the scheduler's {died.get_name()} stopped unexpectedly: {err!r}")


def main(argv: Sequence[str] | None = None) -> None:
    run_service("scheduler", SchedulerConfig, serve, argv)


if __name__ == "__main__":
    main()
