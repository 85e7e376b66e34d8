"""Run the real scheduler loop against the real engine in one process (no gRPC), for tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from services.common import validation
from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.request import FailEvent, FinishEvent, Req, TokenEvent
from services.scheduler.worker_link import InProcessWorkerLink
from services.worker.engine import Engine, EngineConfig
from strata.v1 import strata_pb2 as pb
from tests.device import TEST_DEVICE

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Outcome:
    ids: list[int]
    finish: str
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Spec:
    prompt: list[int]
    max_new_tokens: int = 8
    ignore_eos: bool = True
    salt: str = ""
    delay_s: float = 0.0
    temperature: float = 0.0
    seed: int = 0
    grammar: object = None  # a Matcher, used by one request only
    l3_pages: int = 0  # what the server's L3 lookup would have found


async def one(loop: SchedulerLoop, rid: str, spec: Spec) -> Outcome:
    if spec.delay_s:
        await asyncio.sleep(spec.delay_s)
    sp = pb.SamplingParams(
        temperature=spec.temperature, max_new_tokens=spec.max_new_tokens, ignore_eos=spec.ignore_eos
    )
    gen = validation.generation(sp, len(spec.prompt), loop.limits(), False, 0)
    req = Req(rid, list(spec.prompt), gen, seed=spec.seed, cache_salt=spec.salt, grammar=spec.grammar)
    req.mem.l3_pages = spec.l3_pages
    ids, ev = await stream(loop, req)
    return Outcome(ids, ev.reason.value, ev.prompt_tokens, ev.cached_tokens)


async def stream(loop: SchedulerLoop, req: Req) -> tuple[list[int], FinishEvent]:
    """Submit ``req`` and collect its tokens until it finishes (a ``FailEvent`` raises its error)."""
    loop.submit(req)
    ids: list[int] = []
    while True:
        ev = await req.events.get()
        if isinstance(ev, TokenEvent):
            ids += ev.token_ids
        elif isinstance(ev, FinishEvent):
            loop.forget(req.rid)
            return ids, ev
        elif isinstance(ev, FailEvent):
            raise ev.error


def run(
    engine: Engine, specs: list[Spec], cfg: LoopConfig, waves: int = 1,
    setup: Callable[[SchedulerLoop], None] | None = None,
) -> tuple[list[Outcome], SchedulerLoop]:
    """Submit every spec at once (``waves`` times in sequence); returns outcomes in spec order.
    ``setup`` sees the loop once its worker is attached, before any request."""

    async def main() -> tuple[list[Outcome], SchedulerLoop]:
        loop = SchedulerLoop(cfg)
        loop.attach(InProcessWorkerLink(engine))
        if setup is not None:
            setup(loop)
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(stop))
        outs: list[Outcome] = []
        try:
            for w in range(waves):
                outs += await asyncio.gather(*(one(loop, f"w{w}-r{i}", s) for i, s in enumerate(specs)))
        finally:
            stop.set()
            await task
            if loop.link is not None:
                await loop.link.close()
        return outs, loop

    return asyncio.run(main())


def engine(
    model: Path, kv_cache_bytes: int = 1 << 22, max_rows: int = 32, mamba_slots: int = 0, page_size: int = 1,
    **elastic: int,
) -> Engine:
    """An engine on the test device (``STRATA_TEST_DEVICE``, tests/device.py; default the CPU).
    ``elastic``: ``kv_max_bytes`` / ``mamba_max_slots`` reservations (see EngineConfig)."""
    cfg = EngineConfig(device=TEST_DEVICE, kv_cache_bytes=kv_cache_bytes, max_rows=max_rows, mamba_slots=mamba_slots,
                       page_size=page_size, **elastic)
    return Engine(model, cfg)


def serve(engine: Engine, cfg: LoopConfig, body: Callable[[SchedulerLoop], Awaitable[T]]) -> tuple[T, SchedulerLoop]:
    """Run ``body(loop)`` while a scheduler loop serves ``engine`` in-process; returns its result."""

    async def main() -> tuple[T, SchedulerLoop]:
        loop = SchedulerLoop(cfg)
        loop.attach(InProcessWorkerLink(engine))
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(stop))
        try:
            return await body(loop), loop
        finally:
            stop.set()
            await task
            if loop.link is not None:
                await loop.link.close()

    return asyncio.run(main())
