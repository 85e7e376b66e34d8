"""Forcing and proving a tier for ``benchmarks.hicache``: the flushes that empty and scribble
over the device and host tiers, and the counters that say which tier served a request, for a dense
worker and a hybrid one (KV pages *and* Mamba states): one host tier design for both.

A hybrid prefix is reusable only up to a checkpoint with a state; the scheduler checkpoints a
prompt at its last whole page and at the last page a resend may match (its last token is always
computed), so every cached tier reuses ``(L - 1) // page * page`` tokens, as the dense one does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Literal, NamedTuple

from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.request import Event, Req
from services.scheduler.worker_link import InProcessWorkerLink

if TYPE_CHECKING:
    from services.worker.engine import Engine

Tier = Literal["recompute", "device", "host", "l3"]
TIERS: tuple[Tier, ...] = ("recompute", "device", "host", "l3")  # the ones tabulated, in order


class Counts(NamedTuple):
    """The counters that say which tier served a request (their growth during it, once subtracted)."""

    load_tokens: int  # tokens loaded from the host pool into the device
    prefetched_pages: int  # pages prefetched from L3 into the host pool (scheduler's count)
    worker_l3_pages: int  # pages the worker wrote into its host pool from the kvstore
    state_loads: int = 0  # hybrid: Mamba states loaded from the host
    states_prefetched: int = 0  # hybrid: states prefetched from L3 (scheduler's count)
    worker_l3_states: int = 0  # hybrid: states the worker wrote into its host pool from the kvstore

    def minus(self, before: Counts) -> Counts:
        return Counts(*(a - b for a, b in zip(self, before, strict=True)))


class Tiers:
    """The loop's memory (with a host tier) and the engine's pools, and the flushes that force a
    tier: the memory through its public verbs (``flush``, ``stats``, ``pending``), the worker's
    pools scribbled over directly.

    ``order`` is the sequence of requests one prompt gets; ``cached(tier, n)`` is what a request
    of that tier must reuse of an ``n``-token prompt, and ``expect`` how the counters must grow.
    With a state pool (hybrid models) a cached tier also loads (or prefetches) the state at the
    prefix's end."""

    order: tuple[Tier, ...] = TIERS

    def __init__(self, loop: SchedulerLoop, task: asyncio.Task[None], engine: Engine) -> None:
        self.loop, self.task, self.engine = loop, task, engine
        assert engine.host is not None, "the worker needs a host pool"
        self.host = engine.host
        b = loop.batcher
        assert b is not None and b.mem.host is not None, "a memory with a host tier"
        self.mem = b.mem
        self.hybrid = b.mem.states is not None
        assert not self.hybrid or (engine.mamba is not None and self.host.states is not None)

    @property
    def page(self) -> int:
        """Tokens per host / L3 page."""
        return self.mem.cache_page

    def counts(self) -> Counts:
        c, h = self.mem.stats()["host_events"], self.host
        return Counts(c["load_tokens"], c["prefetched_pages"], h.pages_got, c["state_loads"],
                      c["states_prefetched"], h.states_got)  # fmt: skip

    def quiet(self) -> bool:
        """No backup, put, load or prefetch in flight or queued."""
        return not self.mem.pending

    def flush_device(self) -> None:
        """Drop every device copy (write_through put each on the host already) and scribble over
        the device pools, so a prefix can only come back through a load."""
        if not self.mem.flush():
            raise RuntimeError("device flush incomplete: a device page or state is still held")
        kv, mamba = self.engine.kv, self.engine.mamba
        states = (*mamba.conv, *mamba.ssm) if mamba is not None else ()
        for t in (*kv.k, *kv.v, *states):
            t.normal_()

    def flush_host(self) -> None:
        """``flush_device``, then drop every host entry and scribble over the host pools."""
        self.flush_device()
        if not self.mem.flush(host=True):
            raise RuntimeError("host flush incomplete: a host page or state is still held")
        self.host.pool.pages.normal_()
        if self.host.states is not None:
            self.host.states.states.random_(0, 256)

    def check_idle(self) -> None:
        self.mem.check_idle()

    def cached(self, tier: Tier, length: int) -> int:
        """Whole pages of the prompt less its last token (that token is always computed)."""
        return 0 if tier == "recompute" else (length - 1) // self.page * self.page

    def expect(self, tier: Tier, cached: int) -> Counts:
        loaded = cached if tier in ("host", "l3") else 0
        fetched = cached // self.page if tier == "l3" else 0
        if not self.hybrid:
            return Counts(loaded, fetched, fetched)
        one = int(tier == "l3")
        return Counts(loaded, fetched, fetched, int(tier in ("host", "l3")), one, one)

    async def next_event(self, req: Req, timeout_s: float) -> Event:
        """``req``'s next event; raises when the loop died instead (its error) or after ``timeout_s``."""
        get = asyncio.ensure_future(req.events.get())
        done, _ = await asyncio.wait({get, self.task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        if self.task.done():
            raise RuntimeError("the scheduler loop stopped") from self.task.exception()
        raise TimeoutError(f"request {req.rid}: no event in {timeout_s:.0f}s")

    async def settle(self, timeout_s: float) -> None:
        """Wait until the loop is idle and every backup and put it queued was acknowledged (seen
        twice in a row: an acknowledged backup queues its put for the loop's next plan)."""
        deadline = time.monotonic() + timeout_s
        seen = False
        while True:
            b = self.loop.batcher
            assert b is not None
            if b.idle and self.quiet():
                if seen:
                    return
                seen = True
            else:
                seen = False
            if self.task.done():
                raise RuntimeError("the scheduler loop stopped") from self.task.exception()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the loop did not settle in {timeout_s:.0f}s: host jobs still in flight")
            await asyncio.sleep(0.01)


@asynccontextmanager
async def serving(eng: Engine, cfg: LoopConfig) -> AsyncIterator[Tiers]:
    """A scheduler loop serving ``eng`` in this process, for as long as the block runs; the loop
    picks its memory from the worker's info, and so do the tiers."""
    loop = SchedulerLoop(cfg)
    link = InProcessWorkerLink(eng)
    loop.attach(link)
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    try:
        yield Tiers(loop, task, eng)
    finally:
        stop.set()
        await asyncio.wait({task}, timeout=10.0)
        if not task.done():
            task.cancel()
        await link.close()
