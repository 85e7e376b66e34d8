"""The worker's gRPC servicer (a thin adapter over ``Engine``) and its process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from services.common import glibc_heap, step_codec, telemetry
from services.common.discovery import ModelRegistry, Registration, ServiceRecord, advertised_address
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.metrics import MetricFactory, serve_metrics
from services.common.server import Server, run_service, settle_heap
from services.common.step import LateMasks, StepRequest, StepResult
from services.kvstore.backends import MemoryBackend
from services.kvstore.client import DEFAULT_BATCH_BYTES
from services.kvstore.outbox import OUTBOX_KIND
from services.kvstore.server import SERVICE_NAME as KVSTORE_SERVICE
from services.kvstore.server import KVStoreServicer, backend_gauges
from services.worker import memory_report, tp_group
from services.worker.config import WorkerConfig, cpu_list
from services.worker.engine import Engine, EngineConfig
from services.worker.host_malloc import Trimmer, cap_arenas
from services.worker.l3_port import KVStorePort
from services.worker.tp import SINGLE, GroupBroken
from strata.kvstore.v1 import kvstore_pb2_grpc as kvgrpc
from strata.worker.v1 import worker_pb2 as wpb
from strata.worker.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)

# A step waiting for its late bitmasks gives up after this long (the scheduler sends them as soon
# as the previous step's result is committed: milliseconds).
LATE_MASK_TIMEOUT_S = 60.0


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        m = MetricFactory(registry, "worker")
        self.steps = m.counter("steps", "Steps executed.")
        self.tokens = m.counter("tokens", "Tokens run through the model, by kind.", ["kind"])
        self.forward_seconds = m.histogram("forward_seconds", "Forward pass time per step.")
        self.sample_seconds = m.histogram("sample_seconds", "Sampling time per step.")
        self.idle_seconds = m.histogram("idle_seconds", "Time waiting for the next step.")
        heap_bytes = m.gauge(
            "heap_bytes",
            "glibc's heap (mallinfo2), by state: in_use, free (held for reuse, not returned), mmap (own mappings).",
            ["state"],
        )
        heap_bytes.labels("in_use").set_function(lambda: glibc_heap.heap().in_use_bytes)
        heap_bytes.labels("free").set_function(lambda: glibc_heap.heap().free_bytes)
        heap_bytes.labels("mmap").set_function(lambda: glibc_heap.heap().mmap_bytes)

    def observe(self, step: StepRequest, result: StepResult) -> None:
        self.steps.inc()
        new = sum(r.num_new for r in step.reqs)
        self.tokens.labels("sampled").inc(len(result.outputs))
        self.tokens.labels("computed").inc(new)
        self.forward_seconds.observe(result.forward_s)
        self.sample_seconds.observe(result.sample_s)
        self.idle_seconds.observe(result.idle_s)


class WorkerServicer(wgrpc.WorkerServicer):
    """Executes steps in order on the engine, one stream (one scheduler) at a time."""

    def __init__(
        self,
        engine: Engine,
        metrics: WorkerMetrics | None = None,
        thread: ThreadPoolExecutor | None = None,
        group: tp_group.Followers | None = None,
    ) -> None:
        """``thread``: where steps run (one thread: see ``host_malloc`` for why it is always the same);
        ``group``: the other tensor-parallel ranks, told when a step breaks the group."""
        self.engine = engine
        self.group = group
        self.metrics = metrics
        self.thread = thread or ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.trimmer = Trimmer()
        self._busy = False
        self._tracer = telemetry.get_tracer("strata.worker")

    async def GetInfo(self, request: wpb.GetInfoRequest, context: grpc.aio.ServicerContext) -> wpb.WorkerInfo:
        return step_codec.info_to_pb(self.engine.info)

    async def GetMemory(self, request: wpb.GetMemoryRequest, context: grpc.aio.ServicerContext) -> wpb.MemoryReport:
        r = memory_report.report()
        return wpb.MemoryReport(
            rss_bytes=r.rss_bytes,
            heap_arena_bytes=r.heap.arena_bytes,
            heap_in_use_bytes=r.heap.in_use_bytes,
            heap_free_bytes=r.heap.free_bytes,
            heap_mmap_bytes=r.heap.mmap_bytes,
            arena_bytes=r.arena_bytes,
            python_blocks=r.python_blocks,
            traced_bytes=r.traced_bytes,
            tensors=r.tensors.count,
            tensor_bytes=r.tensors.nbytes,
            threads=r.threads,
        )

    async def Step(
        self, request_iterator: AsyncIterator[wpb.StepRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.StepResult]:
        if self._busy:
            raise FailedPrecondition("this worker already serves a scheduler's step stream")
        self._busy = True
        loop = asyncio.get_running_loop()
        it = request_iterator.__aiter__()

        async def next_late_masks() -> LateMasks:
            msg = await it.__anext__()
            masks = step_codec.late_masks_from_pb(msg)
            if masks is None:
                raise InvalidArgument(f"step {msg.step_id} arrived while a step waited for its late masks")
            return masks

        def wait_late_masks() -> LateMasks:  # called from the engine's thread
            return asyncio.run_coroutine_threadsafe(next_late_masks(), loop).result(LATE_MASK_TIMEOUT_S)

        try:
            async for msg in it:
                if msg.HasField("late_masks"):
                    raise InvalidArgument(f"late masks for step {msg.late_masks.step_id} with no step waiting")
                try:
                    step = step_codec.step_from_pb(msg)
                except ValueError as e:
                    raise InvalidArgument(f"step {msg.step_id}: {e}") from e
                self._trace_new_requests(step)
                raw = msg.SerializeToString() if self.engine.tp.size > 1 else b""
                result = await loop.run_in_executor(self.thread, self._step, step, raw, wait_late_masks)
                if self.metrics is not None:
                    self.metrics.observe(step, result)
                yield step_codec.result_to_pb(result)
        finally:
            self._busy = False

    def _step(self, step: StepRequest, raw: bytes, wait_late_masks: Callable[[], LateMasks]) -> StepResult:
        """On the engine thread: the step (sent first to the other tensor-parallel ranks, ``raw``),
        then the free heap back to the kernel when due."""
        try:
            if raw:
                self.engine.tp.send_bytes(raw)
            result = self.engine.step(step, wait_late_masks)
        except GroupBroken as e:  # the ranks are out of step for good (other failures end the step on all)
            if self.group is not None:
                self.group.break_group(e)
            raise
        self.trimmer.maybe()
        return result

    def _trace_new_requests(self, step: StepRequest) -> None:
        """One span per request on its first step, in the request's own trace."""
        for r in step.reqs:
            if r.trace_context:
                ctx = telemetry.extract_context(r.trace_context)
                with self._tracer.start_as_current_span("worker.admit", context=ctx) as span:
                    span.set_attribute("strata.request_id", r.request_id)
                    span.set_attribute("strata.prompt_tokens", r.start_pos + len(r.input_ids))
                    span.set_attribute("strata.cached_tokens", len(r.prefix_slots))


def engine_config(cfg: WorkerConfig) -> EngineConfig:
    return EngineConfig(
        device=cfg.device,
        dtype=cfg.dtype,
        kv_cache_bytes=cfg.kv_cache_bytes,
        kv_mem_fraction=cfg.kv_mem_fraction,
        max_rows=cfg.max_rows,
        max_context=cfg.max_context or None,
        mamba_slots=cfg.mamba_slots,
        page_size=cfg.page_size,
        kv_max_bytes=cfg.kv_max_bytes,
        mamba_max_slots=cfg.mamba_max_slots,
        host_cache_bytes=cfg.host_cache_bytes,
        host_page_tokens=cfg.host_page_tokens,
        host_state_share=cfg.host_state_share,
        packed_weights=cfg.packed_weights,
        native_linear=cfg.native_linear,
        kv_populate=cfg.kv_populate,
        attention=cfg.attention,
        threads=cfg.threads or (len(cpu_list(cfg.cpus)) if cfg.cpus else 0),
        serial_step_mflops=cfg.serial_step_mflops,
        cuda_graph_max_batch=cfg.cuda_graph_max_batch,
        draft_model=cfg.speculative_draft_model,
        mtp=cfg.speculative_mtp,
    )


def _pin(cpus: set[int]) -> None:
    """Every thread of this process on ``cpus``: those started at import too; threads started
    later (the engine's, its OpenMP team, gRPC's) inherit the mask."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


async def serve(cfg: WorkerConfig, stop: asyncio.Event) -> None:
    if cfg.cpus:
        _pin(cpu_list(cfg.cpus))
    followers = tp_group.Followers(cfg) if cfg.tp > 1 and not cfg.tp_rank else None  # before any thread
    outbox = MemoryBackend(cfg.outbox_bytes) if cfg.outbox_bytes else None
    port_l3 = KVStorePort(cfg.etcd, outbox=outbox) if cfg.l3 else None
    if port_l3 is not None:
        await port_l3.start()
    if cfg.tp_rank:  # a follower: no server, no registration (see tp_group)
        await tp_group.serve_follower(cfg, stop, lambda tp: Engine(Path(cfg.model), engine_config(cfg), port_l3, tp))
        return
    telemetry.setup_tracing("worker", cfg.trace_exporter, cfg.trace_target.replace("{service}", "worker"))
    thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
    loop = asyncio.get_running_loop()
    try:
        tp = SINGLE if followers is None else await loop.run_in_executor(
            thread, tp_group.join, cfg, followers.init_method
        )
        engine = await loop.run_in_executor(thread, Engine, Path(cfg.model), engine_config(cfg), port_l3, tp)
    except BaseException:
        if followers is not None:
            followers.stop()
        raise
    info = engine.info
    name = cfg.model_name or info.model
    if cfg.etcd:
        async with ModelRegistry(cfg.etcd) as models:  # refuses a different model under this name
            await models.claim(name, info.fingerprint, {"architecture": info.architecture})
    server = Server(telemetry.server_interceptors())
    registry = CollectorRegistry()
    servicer = WorkerServicer(engine, WorkerMetrics(registry), thread, followers)
    server.add(wgrpc.add_WorkerServicer_to_server, servicer, "strata.worker.v1.Worker")
    if outbox is not None:  # other workers read this worker's hand-over pages with the kvstore's service
        server.add(kvgrpc.add_KVStoreServicer_to_server, KVStoreServicer(outbox, DEFAULT_BATCH_BYTES),
                   KVSTORE_SERVICE)  # fmt: skip
        backend_gauges(MetricFactory(registry, "worker_outbox"), outbox)
    port = await server.start(f"{cfg.host}:{cfg.port}")
    address = advertised_address(cfg.host, port, cfg.advertise_host)
    metrics = serve_metrics(cfg.metrics_port, cfg.host, registry)
    registration = None
    published = contextlib.AsyncExitStack()
    if cfg.etcd:
        capacity = {
            "num_slots": info.num_slots,
            "num_rows": info.num_rows,
            "mamba_slots": info.num_mamba_slots,
        }
        record = ServiceRecord("worker", cfg.instance_id or f"worker-{port}", address, name, "rank0", capacity)
        registration = Registration(cfg.etcd, record, ttl_s=cfg.lease_ttl_s)
        await registration.start()
        if outbox is not None:
            box = ServiceRecord(OUTBOX_KIND, record.instance_id, address, capacity={"capacity_bytes": cfg.outbox_bytes})
            await published.enter_async_context(Registration(cfg.etcd, box, ttl_s=cfg.lease_ttl_s))
    log.info(
        "worker serving %s on %s (%d slots, %d rows, %d host pages, %d host states, L3 %s, tp %d)",
        name,
        address,
        info.num_slots,
        info.num_rows,
        info.host_pages,
        info.host_states,
        "on" if info.l3 else "off",
        info.tp_size,
    )
    memory_report.remember_frozen()
    settle_heap()
    print(f"READY worker {address}{metrics}", flush=True)
    failed = asyncio.ensure_future(followers.failure()) if followers is not None else None
    alive = (
        asyncio.ensure_future(followers.keep_alive(tp, thread, cfg.tp_timeout_s / 3)) if followers is not None else None
    )
    await asyncio.wait([asyncio.ensure_future(stop.wait()), *([failed] if failed else [])],
                       return_when=asyncio.FIRST_COMPLETED)
    if failed is not None and failed.done():  # the group cannot serve: say why, loudly
        message = failed.result()
        log.error("%s", message)
        if registration is not None:
            await registration.stop()
        followers.kill()  # type: ignore[union-attr]
        print(f"worker: {message}", file=sys.stderr, flush=True)
        os._exit(1)  # the engine thread may sit in a collective until its timeout: do not wait for it
    if registration is not None:
        await published.aclose()
        await registration.stop()
    await server.stop()
    if followers is not None:
        for task in (failed, alive):
            if task is not None:
                task.cancel()
        await loop.run_in_executor(thread, tp.send_bytes, b"")  # the followers' stop message
        followers.stop()
    if port_l3 is not None:
        await port_l3.close()
    telemetry.shutdown_tracing()


def main(argv: Sequence[str] | None = None) -> None:
    cap_arenas()  # before any thread allocates (see host_malloc)
    run_service("worker", WorkerConfig, serve, argv)


if __name__ == "__main__":
    main()
