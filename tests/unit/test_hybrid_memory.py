"""The hybrid scheduler's state bookkeeping against a symbolic worker, no model.

The worker below keeps, for every Mamba slot, the exact tokens its state has absorbed, and for
every KV slot the token written there; it runs ops and inputs in step order like the real one.
Each input then checks that the working state it starts from is exactly the state of the tokens
the request's row points at. Copy-on-write from the wrong slot, a fork copied at the wrong time,
a slot reused while still needed, or a donated state that does not match its key all fail it.
Random workloads with shared prefixes, a tiny KV pool (retraction), a tiny state pool, aborts,
EOS stops with a sample in flight, and overlap (plan N+1 before committing N) drive it.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from services.common.step import GREEDY, MambaCopy, MambaReset, ReleaseRow, StepRequest
from services.common.validation import Generation
from services.scheduler.batcher import Batcher, BatchLimits, Plan
from services.scheduler.memory import Memory, MemoryConfig, device_memory
from services.scheduler.memory.states import StateCounters
from services.scheduler.memory.tree import PrefixTree
from services.scheduler.request import Finish, Req

VOCAB = 12
EOS = 0

def _sc(mem: Memory) -> StateCounters:
    assert mem.states is not None
    return mem.states.counters


def _tree(mem: Memory) -> PrefixTree:
    assert isinstance(mem.tree, PrefixTree)
    return mem.tree


class SymbolicWorker:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.state: dict[int, tuple[int, ...]] = {}
        self.kv: dict[int, int] = {}
        self.rows: dict[int, dict[int, int]] = {}  # row -> position -> KV slot
        self.last: dict[int, int] = {}
        self.ops_seen = 0

    def run(self, step: StepRequest, mem: Memory) -> list[tuple[int, object]]:
        for op in step.ops:
            self.ops_seen += 1
            if isinstance(op, MambaCopy):
                assert op.src in self.state, f"copy from a state never written: {op}"
                self.state[op.dst] = self.state[op.src]
            elif isinstance(op, MambaReset):
                self.state[op.slot] = ()
            elif isinstance(op, ReleaseRow):
                self.rows.pop(op.row, None)
                self.last.pop(op.row, None)
        out: list[tuple[int, object]] = []
        for ri in step.reqs:
            assert ri.mamba_slot is not None and 0 <= ri.mamba_slot < mem.states.pool.size
            row = self.rows.setdefault(ri.row, {})
            for i, s in enumerate(ri.prefix_slots):
                row[i] = s
            ids = [self.last[ri.row]] if ri.use_last_sample else list(ri.input_ids)
            have = tuple(self.kv[row[i]] for i in range(ri.start_pos))
            assert self.state[ri.mamba_slot] == have, (
                f"{ri.request_id}: state {self.state[ri.mamba_slot]} but the row's KV holds {have}"
            )
            for i, (tok, s) in enumerate(zip(ids, ri.new_slots, strict=False)):
                row[ri.start_pos + i] = s
                self.kv[s] = tok
            self.state[ri.mamba_slot] = have + tuple(ids)
            if ri.sample:
                tok = self.rng.randrange(VOCAB)
                self.last[ri.row] = tok
                out.append((tok, None))
        return out


def _req(rid: str, prompt: list[int], max_new: int, ignore_eos: bool) -> Req:
    gen = Generation(GREEDY, max_new, (), frozenset(), ignore_eos, None, False, 0)
    return Req(rid, prompt, gen, seed=0)


def _workload(rng: random.Random, n: int) -> list[Req]:
    stems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    reqs = []
    for i in range(n):
        stem = rng.choice(stems)
        cut = rng.randrange(len(stem) + 1)
        prompt = stem[:cut] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
        reqs.append(_req(f"r{i}", prompt, rng.randrange(1, 10), ignore_eos=rng.random() < 0.5))
    return reqs


def _drive(seed: int, overlap: bool, num_slots: int, num_states: int, rows: int, page: int,
           cache: str = "radix") -> Memory:
    rng = random.Random(seed)
    cfg = MemoryConfig(cache=cache, state_policy=rng.choice(["lru", "marconi"]), checkpoint_every=rng.choice([4, 8]))
    mem = device_memory(num_slots, rows, page, cfg, num_states=num_states)
    batcher = Batcher(mem, BatchLimits(max_prefill_tokens=rng.choice([3, 8, 64]), max_running=rows),
                      frozenset({EOS}), context_length=256)
    worker = SymbolicWorker(rng)
    pending = _workload(rng, 40)
    inflight: deque[tuple[Plan, list[tuple[int, object]]]] = deque()
    depth = 2 if overlap else 1
    for _ in range(5000):
        while pending and rng.random() < 0.3:  # arrivals over time, so later ones hit the cache
            batcher.waiting.append(pending.pop())
        if rng.random() < 0.02:
            live = [r for r in [*batcher.running, *batcher.waiting] if not r.aborted]
            if live:
                rng.choice(live).aborted = True
        plan = batcher.plan() if len(inflight) < depth else None
        if plan is not None:
            inflight.append((plan, worker.run(plan.step, mem)))
            if len(inflight) < depth:
                continue
        if not inflight:
            if not pending and batcher.idle:
                break
            continue
        done, sampled = inflight.popleft()
        batcher.commit(done, sampled)
    assert batcher.idle and not pending and not inflight
    mem.check_idle()
    return mem


@pytest.mark.parametrize("seed", range(24))
def test_states_follow_their_tokens_under_random_load(seed: int) -> None:
    overlap = seed % 2 == 0
    page = 1 if seed % 3 else 2
    _drive(seed, overlap, num_slots=96, num_states=4 + seed % 6, rows=4, page=page)


@pytest.mark.parametrize("seed", range(4))
def test_states_follow_their_tokens_with_the_cache_off(seed: int) -> None:
    """Cache off (a tree that keeps nothing): every request starts from a zeroed state, no fork,
    no copy, nothing cached, and the books balance."""
    mem = _drive(seed, seed % 2 == 0, num_slots=96, num_states=4, rows=4, page=1 + seed % 2, cache="none")
    c = _sc(mem)
    assert (c.cow_copy, c.fork, c.donated, c.evicted) == (0, 0, 0, 0)
    assert mem.tree.total_size() == 0 and mem.states is not None and mem.states.owners()["cache"] == 0


def test_random_load_exercises_every_path() -> None:
    """Across seeds, the workload really copies, forks, donates, evicts states and retracts."""
    totals = {"cow_copy": 0, "fork_inserted": 0, "fork_skipped": 0, "donated": 0, "evicted": 0}
    for seed in range(8):
        mem = _drive(seed, seed % 2 == 0, num_slots=40, num_states=6, rows=4, page=1)
        for k in totals:
            totals[k] += getattr(_sc(mem), k)
    assert all(totals.values()), totals


def test_one_state_per_row_never_deadlocks() -> None:
    """The least a worker may have: the cache gets states only while rows are idle, forks are
    skipped when none is free; every request still finishes."""
    for seed in range(6):
        mem = _drive(seed, overlap=True, num_slots=96, num_states=3, rows=3, page=1)
        assert _sc(mem).fork_skipped > 0 or _sc(mem).evicted > 0


def test_forks_run_first_in_the_next_step_and_cow_reads_them_later() -> None:
    mem = device_memory(64, 2, 1, MemoryConfig(checkpoint_every=4), num_states=6)
    b = Batcher(mem, BatchLimits(max_prefill_tokens=64, max_running=2), frozenset({EOS}), 256)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2, ignore_eos=True)
    b.waiting.append(a)
    p1 = b.plan()
    assert p1 is not None and p1.step.ops == [MambaReset(a.mem.mamba_slot)]  # type: ignore[arg-type]
    assert [ri.input_ids for ri in p1.step.reqs] == [[1, 2, 3, 4]]  # cut at the first checkpoint
    fork = p1.forks[0][1]
    p2 = b.plan()  # overlap: planned before p1 is committed
    assert p2 is not None and p2.step.ops[0] == MambaCopy(a.mem.mamba_slot, fork.slot)  # type: ignore[arg-type]
    b.commit(p1, [])
    assert a.mem.cache_len == 4 and fork not in a.mem.forks
    c = _req("c", [1, 2, 3, 4, 11], 1, ignore_eos=True)
    b.waiting.append(c)
    b.commit(p2, [])
    p3 = b.plan()
    assert p3 is not None and c.mem.cache_len == 4 and c.mem.mamba_slot is not None
    assert MambaCopy(fork.slot, c.mem.mamba_slot) in p3.step.ops  # copy-on-write of the checkpoint
    assert fork.slot != c.mem.mamba_slot


def test_admission_waits_for_a_state_slot_instead_of_failing() -> None:
    mem = device_memory(64, 2, 1, MemoryConfig(checkpoint_every=0), num_states=2)
    b = Batcher(mem, BatchLimits(max_prefill_tokens=64, max_running=2), frozenset({EOS}), 256)
    # x leaves its working state in the cache, donated at 6 (its last token has no KV). y locks
    # it and takes the free slot; then no slot is free or evictable and z must wait.
    x = _req("x", [5, 6, 7, 8], 3, ignore_eos=True)
    b.waiting.append(x)
    while x.finished is None:
        p = b.plan()
        assert p is not None
        b.commit(p, [(3, None)] * len(p.sampled))
    assert mem.states.pool.available == 1 and _tree(mem).state_evictable == 1
    y = _req("y", [5, 6, 7, 8, 3, 3, 9], 4, ignore_eos=True)
    z = _req("z", [9, 9, 9], 1, ignore_eos=True)
    b.waiting.extend([y, z])
    p = b.plan()
    assert p is not None and p.reqs == [y] and list(b.waiting) == [z]  # z waits, nothing raised
    assert y.mem.cache_len == 6 and _sc(mem).evicted == 0 and _tree(mem).state_protected == 1
    b.commit(p, [(3, None)])
    while not b.idle:
        p = b.plan()
        assert p is not None
        b.commit(p, [(3, None)] * len(p.sampled))
    assert y.finished is Finish.LENGTH and z.finished is Finish.LENGTH
    mem.check_idle()


def test_flush_drops_every_cached_page_and_state_and_the_books_balance() -> None:
    """``Memory.flush`` (an operator's cache flush; the tier rigs force a tier with it): after a
    random load has cached pages and states, nothing stays cached, every pool is wholly free, and
    a prompt seen before matches nothing."""
    cached_states = 0
    for seed in range(4):
        mem = _drive(seed, seed % 2 == 0, num_slots=96, num_states=6, rows=4, page=1)
        assert mem.tree.total_size() > 0 and mem.usage().evictable > 0  # something to flush
        assert mem.states is not None
        cached_states += mem.states.owners()["cache"]
        assert mem.flush()
        u = mem.usage()
        assert (u.free, u.evictable, u.protected) == (u.size, 0, 0) and mem.tree.total_size() == 0
        assert mem.states.pool.available == mem.states.pool.size and mem.states.owners()["cache"] == 0
        mem.check_idle()
        req = _req("again", [1, 2, 3, 4, 5], 1, ignore_eos=True)
        assert mem.prefix_len(req) == 0
    assert cached_states > 0  # states were cached, and went
