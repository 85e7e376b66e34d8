"""TTFT of a long prompt recomputed vs served from each tier of the hierarchical KV cache.

    python -m services.bench.hicache --model models/qwen3-bench [--lengths 1024,2048,4096] [--repeats 3]

One worker (an engine with a host pool and a kvstore port), one scheduler loop and one kvstore
server — its own process by default, reached through gRPC on loopback — with the services'
defaults (write_through, wait_complete prefetch, 64-token host / L3 pages). For every
length and repeat a fresh random prompt P (no two runs share a page) is sent four times, one
greedy request of ``max_new_tokens=1`` each, the tiers flushed in between:

1. recompute — nothing of P is cached anywhere: the whole prompt is prefilled;
2. device — P again, its prefix still in the device cache;
3. host — the device cache emptied and its pool scribbled over: the prefix is loaded back from
   the host pool;
4. L3 — device and host emptied and scribbled over: the submission-time lookup finds P's pages in
   the kvstore, the scheduler prefetches them into the host pool, then loads them.

TTFT runs from the L3 lookup (the scheduler's servicer does it before submitting) to the first
token event; each tier's median over the repeats is reported, with recompute / tier ratios. A
cached run reuses ``cached`` = the whole pages of P less its last token (that token is always
computed, and the tree holds whole pages; 4096 tokens: 4032 reused, 64 prefilled). Every cached
run is checked: its token equals the recomputed one, ``cached_tokens`` is ``cached``, and the
tier really served it (host: ``load_tokens`` grew by ``cached``; L3: ``prefetched_pages`` by
``cached`` / page and the worker wrote that many pages from the kvstore). Writes ``--out``
(JSON) and prints a markdown table; progress goes to stderr. Exit status 1 when a check fails.

Torch gets one intra-op thread by default (``--threads``): on a shared 2-core machine two
threads make a prefill's time swing 2-3x from run to run, and one leaves the other core to the
event loop and the kvstore process, which in a deployment run elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

from services.bench.runner import greedy_req
from services.kvstore.config import KVStoreConfig
from services.kvstore.server import build_server
from services.kvstore.sharded import ShardedKVStore
from services.scheduler.hi_memory import HiConfig, HiMemory
from services.scheduler.l3_lookup import L3_PAGE_TOKENS, leading_pages
from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.request import Event, Finish, Req, TokenEvent
from services.scheduler.worker_link import InProcessWorkerLink

if TYPE_CHECKING:
    from services.worker.engine import Engine

Tier = Literal["recompute", "device", "host", "l3"]
TIERS: tuple[Tier, ...] = ("recompute", "device", "host", "l3")
GOAL_LENGTH, GOAL_RATIO = 4096, 3.0  # issue #7: L3 at least 3x faster than recompute at 4k tokens
_READY_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Sample:
    """One request: what it cost, what it returned, and what the cache did for it."""

    tier: Tier
    length: int
    repeat: int
    ttft_s: float  # lookup + submit → first token event
    lookup_s: float  # the L3 lookup alone
    l3_pages: int  # what the lookup found
    token: int
    cached_tokens: int
    expected_cached: int
    load_tokens: int  # HiMemory counters' growth during the request
    prefetched_pages: int
    worker_l3_pages: int  # pages the worker wrote into its host pool from the kvstore
    token_ok: bool  # == the recomputed token
    tier_ok: bool  # cached_tokens and the counters say this tier served it


@dataclass(frozen=True, slots=True)
class Row:
    length: int
    cached: int  # tokens a cached run reuses
    ttft_ms: dict[str, float]  # median per tier
    recompute_over: dict[str, float]  # recompute TTFT / tier TTFT (medians)
    ok: bool


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"lengths: comma-separated integers, got {text!r}") from None
    if not out or min(out) < 2 or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"lengths: distinct, each >= 2 tokens, got {text!r}")
    return out


def kv_bytes_per_token(model: Path) -> int:
    """K and V of every layer for one token, fp32 (the engine's default dtype)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4


# -- the kvstore -------------------------------------------------------------------------------------


@contextmanager
def kvstore_process(capacity_bytes: int) -> Iterator[str]:
    """A kvstore server process on loopback; yields its address once it prints READY."""
    cmd = [sys.executable, "-m", "services.kvstore.server", "--host", "127.0.0.1", "--port", "0",
           "--capacity-bytes", str(capacity_bytes), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    watchdog = threading.Timer(_READY_TIMEOUT_S, proc.kill)  # a server that never gets ready
    watchdog.start()
    try:
        address = ""
        for line in proc.stdout:
            if line.startswith("READY kvstore "):
                address = line.split()[-1]
                break
        watchdog.cancel()
        if not address:
            raise RuntimeError(f"the kvstore server exited with {proc.wait()} before it was ready")
        # Keep reading, so a chatty server never blocks on a full pipe.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield address
    finally:
        watchdog.cancel()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@asynccontextmanager
async def kvstore_inproc(capacity_bytes: int) -> AsyncIterator[str]:
    """A kvstore server on this event loop (quicker to start; shares the process with the loop)."""
    server, _ = build_server(KVStoreConfig(capacity_bytes=capacity_bytes))
    port = await server.start("127.0.0.1:0")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop()


# -- forcing a tier ----------------------------------------------------------------------------------


class Tiers:
    """The loop's hierarchical memory and the engine's pools, and the flushes that force a tier."""

    def __init__(self, loop: SchedulerLoop, task: asyncio.Task[None], engine: Engine) -> None:
        assert loop.batcher is not None and isinstance(loop.batcher.mem, HiMemory), "the worker needs a host pool"
        self.loop, self.task, self.mem, self.engine = loop, task, loop.batcher.mem, engine

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
        """Wait until the loop is idle and every backup and put it queued was acknowledged."""
        deadline = time.monotonic() + timeout_s
        while True:
            b = self.loop.batcher
            assert b is not None
            if b.idle and self.mem.inflight == 0 and not self.mem.hi.queued_writes:
                return
            if self.task.done():
                raise RuntimeError("the scheduler loop stopped") from self.task.exception()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the loop did not settle in {timeout_s:.0f}s: {self.mem.inflight} jobs in flight")
            await asyncio.sleep(0.01)

    def flush_device(self) -> None:
        """Drop every device copy (write_through put each on the host already) and scribble over
        the device pool, so a prefix can only come back through a load."""
        hi = self.mem.hi
        ev = hi.evict_device(hi.evictable_size)
        if ev.pending or hi.evictable_size or self.mem.slots.available != self.mem.size:
            raise RuntimeError("device flush incomplete: a device page is still held")
        kv = self.engine.kv
        for t in (*kv.k, *kv.v):
            t.normal_()

    def flush_host(self) -> None:
        """``flush_device``, then drop every host page and scribble over the host pool."""
        self.flush_device()
        self.mem.hi.evict_host(self.mem.hi.host_evictable_size)
        if self.mem.host.available != self.mem.host.num_pages:
            raise RuntimeError("host flush incomplete: a host page is still held")
        assert self.engine.host is not None
        self.engine.host.pool.pages.normal_()


class Served(NamedTuple):
    ttft_s: float  # lookup + submit → first token event
    lookup_s: float
    l3_pages: int  # what the lookup found
    token: int
    cached_tokens: int


async def request(tiers: Tiers, store: ShardedKVStore, prompt: list[int], timeout_s: float) -> Served:
    """Serve ``prompt`` as the scheduler's servicer does (L3 lookup, then submit): one greedy token."""
    loop = tiers.loop
    info = loop.info
    assert info is not None
    t0 = time.perf_counter()
    l3 = await leading_pages(store, prompt, "", info)
    lookup = time.perf_counter() - t0
    req = greedy_req(prompt, 1, loop.limits())
    req.l3_pages = l3
    loop.submit(req)
    ttft, token = 0.0, -1
    try:
        while True:
            ev = await tiers.next_event(req, timeout_s)
            if isinstance(ev, TokenEvent):
                if token < 0 and ev.token_ids:
                    ttft, token = time.perf_counter() - t0, ev.token_ids[0]
                continue
            if ev.reason in (Finish.ERROR, Finish.ABORT) or token < 0:
                raise RuntimeError(f"request ended with {ev.reason.name} and no token: {ev.error}")
            return Served(ttft, lookup, l3, token, ev.cached_tokens)
    finally:
        loop.forget(req.rid)


async def one_prompt(
    tiers: Tiers, store: ShardedKVStore, prompt: list[int], repeat: int, timeout_s: float
) -> list[Sample]:
    """The four tiers for one prompt, in order, the tiers flushed between them."""
    mem, host = tiers.mem, tiers.engine.host
    assert host is not None
    page = mem.hi.page_size
    cached = (len(prompt) - 1) // page * page  # the last token is always computed
    out: list[Sample] = []
    ref = -1
    for tier in TIERS:
        if tier == "host":
            tiers.flush_device()
        elif tier == "l3":
            tiers.flush_host()
        load0, pre0, got0 = mem.counters.load_tokens, mem.counters.prefetched_pages, host.pages_got
        r = await request(tiers, store, prompt, timeout_s)
        load, pre, got = mem.counters.load_tokens - load0, mem.counters.prefetched_pages - pre0, host.pages_got - got0
        await tiers.settle(timeout_s)  # its backups and puts are not part of its TTFT
        if tier == "recompute":
            ref = r.token
        # What each tier must show: cold = nothing anywhere (not even in L3); host and L3 = the
        # prefix was loaded; L3 = every page of it came from the kvstore through the worker.
        expect = 0 if tier == "recompute" else cached
        tier_ok = (
            r.cached_tokens == expect
            and (r.l3_pages == 0 if tier == "recompute" else r.l3_pages >= cached // page)
            and load == (cached if tier in ("host", "l3") else 0)
            and pre == got == (cached // page if tier == "l3" else 0)
        )
        out.append(Sample(tier, len(prompt), repeat, r.ttft_s, r.lookup_s, r.l3_pages, r.token, r.cached_tokens,
                          expect, load, pre, got, r.token == ref, tier_ok))
    return out


# -- the run -----------------------------------------------------------------------------------------


@asynccontextmanager
async def serving(eng: Engine, cfg: LoopConfig) -> AsyncIterator[Tiers]:
    """A scheduler loop serving ``eng`` in this process, for as long as the block runs."""
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


@asynccontextmanager
async def _kvstore(kind: str, capacity: int) -> AsyncIterator[str]:
    if kind == "inproc":
        async with kvstore_inproc(capacity) as address:
            yield address
        return
    with kvstore_process(capacity) as address:
        yield address


def _prompt(vocab: int, length: int, repeat: int, seed: int) -> list[int]:
    r = random.Random(f"hicache/{seed}/{length}/{repeat}")
    return [r.randrange(3, vocab) for _ in range(length)]


async def _run(args: argparse.Namespace) -> list[Sample]:
    from services.worker.engine import Engine, EngineConfig
    from services.worker.l3_port import KVStorePort

    per_token = kv_bytes_per_token(args.model)
    longest = max(args.lengths) + args.host_page_tokens
    # Each pool holds two of the longest prompts: the one being served and the last one's cache.
    ecfg = EngineConfig(device=args.device, kv_cache_bytes=2 * longest * per_token, max_rows=4,
                        host_cache_bytes=2 * longest * per_token, host_page_tokens=args.host_page_tokens)
    # Room for every prompt of the run (and the warm-up): the kvstore never evicts.
    capacity = 2 * (sum(args.lengths) * args.repeats + longest) * per_token
    async with _kvstore(args.kvstore, capacity) as address:
        port = KVStorePort([address])
        await port.start()
        store = ShardedKVStore([address])
        try:
            eng = Engine(args.model, ecfg, port)
            vocab = eng.info.vocab_size
            _say(f"kvstore {args.kvstore} at {address}; device pool {eng.info.num_slots} slots, "
                f"host pool {eng.info.host_pages} pages of {args.host_page_tokens} tokens")
            cfg = LoopConfig(max_prefill_tokens=args.max_prefill_tokens, hicache=HiConfig())
            async with serving(eng, cfg) as tiers:
                # First-call costs (channels, allocations) stay out of the timed runs.
                await one_prompt(tiers, store, _prompt(vocab, min(256, min(args.lengths)), -1, args.seed), -1,
                                 args.timeout_s)
                samples: list[Sample] = []
                for length in args.lengths:
                    for rep in range(args.repeats):
                        got = await one_prompt(tiers, store, _prompt(vocab, length, rep, args.seed), rep,
                                               args.timeout_s)
                        samples += got
                        _say(f"   {length} tokens #{rep}: " + ", ".join(
                            f"{s.tier} {s.ttft_s * 1e3:.0f} ms{'' if s.token_ok and s.tier_ok else ' FAILED'}"
                            for s in got))
                tiers.mem.check_idle_invariant()
                return samples
        finally:
            await store.close()
            await port.close()


def rows(samples: list[Sample]) -> list[Row]:
    out = []
    for length in sorted({s.length for s in samples}):
        mine = [s for s in samples if s.length == length]
        med: dict[str, float] = {t: statistics.median(s.ttft_s for s in mine if s.tier == t) * 1e3 for t in TIERS}
        ratios: dict[str, float] = {t: med["recompute"] / med[t] for t in TIERS if t != "recompute"}
        cached = max(s.expected_cached for s in mine)
        out.append(Row(length, cached, med, ratios, all(s.token_ok and s.tier_ok for s in mine)))
    return out


def table(rs: list[Row]) -> str:
    lines = ["| prompt tokens | reused | recompute ms | device ms | host ms | L3 ms | recompute / device | "
             "recompute / host | recompute / L3 | same token, right tier |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        t, q = r.ttft_ms, r.recompute_over
        lines.append(f"| {r.length} | {r.cached} | {t['recompute']:.0f} | {t['device']:.0f} | {t['host']:.0f} | "
                     f"{t['l3']:.0f} | {q['device']:.1f}x | {q['host']:.1f}x | {q['l3']:.1f}x | "
                     f"{'yes' if r.ok else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("models/qwen3-bench"))
    p.add_argument("--lengths", type=_lengths, default=[1024, 2048, 4096], help="prompt tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="prompts per length (the median TTFT is reported)")
    p.add_argument("--host-page-tokens", type=int, default=L3_PAGE_TOKENS, help="tokens per host / L3 page")
    p.add_argument("--max-prefill-tokens", type=int, default=LoopConfig().max_prefill_tokens)
    p.add_argument("--kvstore", choices=("process", "inproc"), default="process",
                   help="the kvstore server: its own process, or on the bench's event loop")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0 = torch's default")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request and per settle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/bench/hicache.json"))
    args = p.parse_args(argv)
    if not (args.model / "config.json").exists():
        p.error(f"{args.model} is not a model directory (make models/qwen3-bench/config.json makes one)")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    samples = asyncio.run(_run(args))
    elapsed = time.perf_counter() - t0
    rs = rows(samples)
    goal = next((r.recompute_over["l3"] for r in rs if r.length == GOAL_LENGTH), None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "rows": [asdict(r) for r in rs],
        "samples": [asdict(s) for s in samples],
        "goal": {"length": GOAL_LENGTH, "recompute_over_l3_at_least": GOAL_RATIO, "measured": goal},
        "ok": all(r.ok for r in rs),
        "elapsed_s": elapsed,
    }, indent=2) + "\n")
    print(table(rs))
    print(f"\nmedian TTFT of {args.repeats} prompts per length; {elapsed:.0f}s in all")
    if goal is not None:
        print(f"recompute / L3 at {GOAL_LENGTH} tokens: {goal:.1f}x (goal >= {GOAL_RATIO:.0f}x: "
              f"{'met' if goal >= GOAL_RATIO else 'MISSED'})")
    return 0 if all(r.ok for r in rs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
