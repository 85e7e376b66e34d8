"""A hypothesis state machine over the composed ``Memory``, for every composition the factory makes:
{dense, hybrid} x {device only, host tier}, under every write and eviction policy.

A symbolic worker stands in for the pools: every device KV slot, state slot, host page, host state
and L3 key holds the token prefix its bytes stand for, and it runs each step's ops in list order
(the order ``memory/ops.py`` decides), then the step's forward. Requests are driven through
``Memory``'s verbs as the batcher calls them (admit, chunk_limit, start, extend, planned,
take_ops, on_results, commit_chunk, commit_fork, release), with tiny pools so eviction, host
write-back, refused jobs and retraction all happen. Checked:

- before every forward, the KV the request's row points at and its working state are exactly the
  prefix it is about to extend (a wrong copy, a load into the wrong slot, a slot reused while
  still read, a state donated at the wrong position all fail here);
- always: ``free + evictable + protected + held by requests == size`` for KV slots and for
  states; when idle (after the jobs drain): ``Memory.check_idle`` (every pool, the tree's recount).
"""

from __future__ import annotations

import itertools
import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.common.step import (
    GREEDY,
    CacheOp,
    HostBackup,
    HostLoad,
    JobResult,
    L3Get,
    L3Put,
    MambaCopy,
    MambaReset,
    PoolResize,
    ReleaseRow,
    StateBackup,
    StateLoad,
    WorkerInfo,
)
from services.common.validation import Generation
from services.scheduler.memory import HiConfig, Memory, MemoryConfig, build_memory
from services.scheduler.request import Req

VOCAB = 6
BASES = [[1, 2, 3, 4, 5, 1, 2, 3], [1, 2, 3, 4, 2, 2], [5, 4, 3, 2, 1, 5, 4, 3, 2, 1]]


class Pools:
    """The worker's pools, symbolically: each unit holds the prefix its bytes stand for."""

    def __init__(self, host_page: int) -> None:
        self.p = host_page
        self.kv: dict[int, tuple[int, ...]] = {}  # device slot -> tokens through this one
        self.state: dict[int, tuple[int, ...]] = {}  # state slot -> tokens absorbed
        self.host: dict[int, tuple[tuple[int, ...], ...]] = {}  # host page -> its tokens' prefixes
        self.hstate: dict[int, tuple[int, ...]] = {}
        self.l3: dict[bytes, object] = {}

    def run(self, ops: list[CacheOp]) -> list[JobResult]:
        out: list[JobResult] = []
        p = self.p
        for op in ops:
            if isinstance(op, MambaCopy):
                assert op.src in self.state, f"copy from a state never written: {op}"
                self.state[op.dst] = self.state[op.src]
            elif isinstance(op, MambaReset):
                self.state[op.slot] = ()
            elif isinstance(op, ReleaseRow | PoolResize):
                pass
            elif isinstance(op, HostBackup):
                for j, hp in enumerate(op.host_pages):
                    self.host[hp] = tuple(self.kv[s] for s in op.slots[j * p : (j + 1) * p])
                out.append(JobResult(op.job_id, True, len(op.host_pages)))
            elif isinstance(op, HostLoad):
                for j, hp in enumerate(op.host_pages):
                    for i, s in enumerate(op.slots[j * p : (j + 1) * p]):
                        self.kv[s] = self.host[hp][i]
                out.append(JobResult(op.job_id, True, len(op.host_pages)))
            elif isinstance(op, StateBackup):
                for s, h in zip(op.slots, op.host_states, strict=True):
                    self.hstate[h] = self.state[s]
                out.append(JobResult(op.job_id, True, len(op.slots)))
            elif isinstance(op, StateLoad):
                for h, s in zip(op.host_states, op.slots, strict=True):
                    self.state[s] = self.hstate[h]
                out.append(JobResult(op.job_id, True, len(op.slots)))
            elif isinstance(op, L3Put):
                src = self.hstate if op.states else self.host
                for hp, k in zip(op.host_pages, op.keys, strict=True):
                    self.l3[k] = src[hp]
                out.append(JobResult(op.job_id, True, len(op.keys)))
            elif isinstance(op, L3Get):
                dst: dict = self.hstate if op.states else self.host  # type: ignore[type-arg]
                n = 0
                for k, hp in zip(op.keys, op.host_pages, strict=True):
                    if k not in self.l3:
                        break
                    dst[hp] = self.l3[k]
                    n += 1
                out.append(JobResult(op.job_id, True, n))
            else:
                raise AssertionError(f"unknown op {op!r}")
        return out


def _info(hybrid: bool, host: bool, page: int, host_page: int, slots: int) -> WorkerInfo:
    return WorkerInfo(
        model="m", architecture="a", fingerprint="f", vocab_size=VOCAB, context_length=64, eos_token_ids=(0,),
        num_slots=slots, bytes_per_slot=1, page_size=page, num_rows=4, num_mamba_slots=14 if hybrid else 0,
        bytes_per_mamba_slot=1, dtype="float32", hybrid=hybrid, device="cpu", max_slots=slots,
        max_mamba_slots=14 if hybrid else 0, slot_granularity=page, mamba_slot_granularity=1, pool_page_bytes=1,
        elastic=False, host_pages=6 if host else 0, host_page_tokens=host_page if host else 0,
        kv_layout="kv" if host else "", l3=host, host_states=4 if host and hybrid else 0,
        state_layout="st" if host and hybrid else "",
    )


class MemoryMachine(RuleBasedStateMachine):
    hybrid = False
    host = False

    @initialize(
        page=st.sampled_from([1, 2]), pages_per_host_page=st.sampled_from([1, 2]), slots=st.sampled_from([24, 40]),
        eviction=st.sampled_from(["lru", "lfu"]), state_policy=st.sampled_from(["lru", "marconi"]),
        write=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        inflight=st.sampled_from([1, 64]), every=st.sampled_from([0, 4]), seed=st.integers(0, 2**16),
    )
    def setup(self, page: int, pages_per_host_page: int, slots: int, eviction: str, state_policy: str,
              write: str, inflight: int, every: int, seed: int) -> None:
        host_page = page * pages_per_host_page
        info = _info(self.hybrid, self.host, page, host_page, slots)
        cfg = MemoryConfig(eviction=eviction, state_policy=state_policy, checkpoint_every=every,
                           hicache=HiConfig(write_policy=write, max_inflight_jobs=inflight))  # type: ignore[arg-type]
        self.mem: Memory = build_memory(info, cfg)
        self.pools = Pools(host_page)
        self.rng = random.Random(seed)
        self.live: list[Req] = []
        self.ids = itertools.count()

    # -- the worker --------------------------------------------------------------------------------
    def _step(self, req: Req | None, n: int = 0) -> None:
        """One step: its ops are taken, then (for ``req``) its input is planned (a fork planned
        here is copied at the head of the next step), the ops run, the row and state are checked,
        the forward of its last ``n`` tokens runs, and the step is committed."""
        ops = self.mem.take_ops([])
        if req is not None:
            self.mem.planned(req, req.computed)
        results = self.pools.run(ops)
        if req is not None:
            start = req.computed - n
            seq = req.seq
            for i in range(start):
                assert self.pools.kv.get(req.mem.slots[i]) == tuple(seq[: i + 1]), f"KV of token {i} is wrong"
            if self.hybrid:
                assert req.mem.mamba_slot is not None
                assert self.pools.state.get(req.mem.mamba_slot) == tuple(seq[:start]), "working state is wrong"
            for i in range(start, start + n):
                self.pools.kv[req.mem.slots[i]] = tuple(seq[: i + 1])
            if self.hybrid:
                assert req.mem.mamba_slot is not None
                self.pools.state[req.mem.mamba_slot] = tuple(seq[: start + n])
        self.mem.on_results(results)
        if req is not None:
            self._commit(req, n)

    def _commit(self, req: Req, n: int) -> None:
        if req.computed - n < len(req.prompt):
            self.mem.commit_chunk(req)
        for fork in list(req.mem.forks):
            if fork.pos <= req.computed:
                self.mem.commit_fork(req, fork)


    # -- rules -----------------------------------------------------------------------------------
    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(2, 10),
          tail=st.lists(st.integers(1, VOCAB - 1), max_size=6), salt=st.sampled_from(["", "", "x"]))
    def arrive(self, base: int, cut: int, tail: list[int], salt: str) -> None:
        prompt = BASES[base][:cut] + tail
        req = Req(f"r{next(self.ids)}", prompt, Generation(GREEDY, 4, (), frozenset(), True, None, False, 0),
                  seed=0, cache_salt=salt)
        if self.mem.hold(req):
            return
        matched = self.mem.admit(req)
        if matched is None:
            return
        n = self.mem.chunk_limit(req, len(req.seq) - matched)
        if not self.mem.start(req, n, reserve=0):
            self.mem.abandon(req)
            return
        self.live.append(req)
        self._step(req, n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), k=st.integers(1, 6))
    def advance(self, i: int, k: int) -> None:
        req = self.live[i % len(self.live)]
        if req.computed == len(req.seq):
            if len(req.output) >= 4:
                self._release(req)
                return
            req.output.append(self.rng.randrange(1, VOCAB))
        n = self.mem.chunk_limit(req, min(k, len(req.seq) - req.computed))
        if not self.mem.extend(req, n):
            self._release(req)  # retracted: its computed pages go to the tree
            return
        self._step(req, n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def finish(self, i: int) -> None:
        self._release(self.live[i % len(self.live)])

    @rule(n=st.integers(1, 16))
    def pressure(self, n: int) -> None:
        self.mem.evict(n)

    @rule()
    def idle_step(self) -> None:
        self._step(None)

    @precondition(lambda self: not self.live)
    @rule()
    def drain_and_check(self) -> None:
        for _ in range(50):
            if not self.mem.pending:
                break
            self._step(None)
        assert not self.mem.pending, "jobs never drained"
        self.mem.check_idle()

    def _release(self, req: Req) -> None:
        self.mem.release(req)
        self.live.remove(req)

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def books_balance(self) -> None:
        if not hasattr(self, "mem"):
            return
        mem = self.mem
        u = mem.usage()
        ps = mem.page_size
        own = {s // ps for r in self.live for s in r.mem.slots[r.mem.cache_len :]}
        assert u.free + u.evictable + u.protected + len(own) * ps == u.size, (u, len(own))
        if mem.states is not None:
            pool = mem.states.pool
            held = sum((r.mem.mamba_slot is not None) + len(r.mem.forks) for r in self.live)
            stats = mem.stats()["state_slots"]
            assert pool.available + stats["cache"] + held == pool.size, (stats, held)


def _machine(hybrid: bool, host: bool) -> type[MemoryMachine]:
    return type(f"Machine_{'hybrid' if hybrid else 'dense'}_{'host' if host else 'device'}", (MemoryMachine,),
                {"hybrid": hybrid, "host": host})


_SETTINGS = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestDenseDevice = _machine(False, False).TestCase
TestDenseHost = _machine(False, True).TestCase
TestHybridDevice = _machine(True, False).TestCase
TestHybridHost = _machine(True, True).TestCase
TestDenseDevice.settings = TestDenseHost.settings = TestHybridDevice.settings = TestHybridHost.settings = _SETTINGS


def test_a_write_through_backup_and_its_put_go_in_one_step() -> None:
    """With L3, a prefix's backup and its put are one step's ops, the put right after the backup
    (it reads the host pages the backup writes): the prompt is in L3 once that step is
    acknowledged, which is what a prefill replica waits for before it hands a request over."""
    mem = build_memory(_info(False, True, 1, 2, 40), MemoryConfig(hicache=HiConfig(write_policy="write_through")))
    pools = Pools(2)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4]
    req = Req("r", prompt, Generation(GREEDY, 4, (), frozenset(), True, None, False, 0), seed=0)
    assert mem.admit(req) == 0 and mem.start(req, len(prompt), reserve=0)
    mem.planned(req, req.computed)
    pools.run(mem.take_ops([]))
    for i, s in enumerate(req.mem.slots[: len(prompt)]):
        pools.kv[s] = tuple(prompt[: i + 1])
    mem.release(req)  # its whole pages enter the tree: write-through backs them up with the next step
    assert not mem.handed_over(req)
    ops = mem.take_ops([])
    kinds = [type(op).__name__ for op in ops]
    assert kinds == ["HostBackup", "L3Put", "ReleaseRow"], kinds
    backup, put, _ = ops
    assert isinstance(backup, HostBackup) and isinstance(put, L3Put)
    assert put.host_pages == backup.host_pages and len(put.keys) == len(prompt) // 2
    mem.on_results(pools.run(ops))
    assert mem.handed_over(req) and not mem.pending
    assert sorted(pools.l3.values()) == sorted(pools.host[p] for p in backup.host_pages)
    assert mem.take_ops([]) == []  # nothing left to put
