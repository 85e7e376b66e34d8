"""Prefix reuse on a hybrid model (tiny Qwen3-Next) through the scheduler and the real engine:
the Mamba radix cache, copy-on-write of matched states, checkpoint forks, tombstones and a tiny
state pool, with every output checked against transformers."""

from __future__ import annotations

import asyncio
import itertools
import random
from pathlib import Path

import pytest

from services.scheduler.loop import LoopConfig, SchedulerLoop
from services.scheduler.memory import Memory
from services.scheduler.memory.states import StateCounters
from services.scheduler.memory.tree import PrefixTree, TreeNode
from tests import sched_harness as h
from tests.reference import hf_greedy

OUT = 6

def _sc(mem: Memory) -> StateCounters:
    assert mem.states is not None
    return mem.states.counters


def _tree(mem: Memory) -> PrefixTree:
    assert isinstance(mem.tree, PrefixTree)
    return mem.tree


def _mem(loop: SchedulerLoop) -> Memory:
    assert loop.batcher is not None and loop.batcher.mem.states is not None
    return loop.batcher.mem


def _tombstones(cache: PrefixTree) -> int:
    n, stack = 0, list(cache.books.roots.values())
    while stack:
        node: TreeNode = stack.pop()
        n += node.parent is not None and node.state is None and bool(node.children)
        stack.extend(node.children.values())
    return n


def _conversations(vocab: int, n: int, turns: int, system: int, seed: int):  # type: ignore[no-untyped-def]
    """``n`` clients, each ``turns`` turns with a growing history behind a shared system prompt."""
    rng = random.Random(seed)
    sys_prompt = [rng.randrange(3, vocab) for _ in range(system)]

    async def convo(loop: SchedulerLoop, i: int) -> list[tuple[list[int], h.Outcome]]:
        r = random.Random(seed * 1000 + i)
        hist = sys_prompt + [r.randrange(3, vocab) for _ in range(r.randrange(3, 20))]
        res = []
        for t in range(turns):
            o = await h.one(loop, f"c{i}-t{t}", h.Spec(list(hist), OUT))
            res.append((list(hist), o))
            hist = hist + o.ids + [r.randrange(3, vocab) for _ in range(r.randrange(3, 12))]
        return res

    async def body(loop: SchedulerLoop) -> list[list[tuple[list[int], h.Outcome]]]:
        return list(await asyncio.gather(*(convo(loop, i) for i in range(n))))

    return body


@pytest.mark.parametrize(("chunk", "overlap"), [(1024, True), (7, True), (1024, False)])
def test_multi_turn_hybrid_reuses_prefixes_and_equals_transformers(
    tiny_qwen3_next: Path, chunk: int, overlap: bool
) -> None:
    """4 clients × 3 turns: every output equals transformers; from the second turn on, each turn
    reuses the whole previous turn (the finished request donated its state), and the shared
    system prompt is reused across clients (a branch-point checkpoint)."""
    eng = h.engine(tiny_qwen3_next, kv_cache_bytes=1 << 22, max_rows=8)
    cfg = LoopConfig(max_prefill_tokens=chunk, overlap=overlap, checkpoint_every=16)
    convos, loop = h.serve(eng, cfg, _conversations(eng.info.vocab_size, 4, 3, system=30, seed=1))
    for turns in convos:
        for prompt, o in turns:
            assert o.ids == hf_greedy(tiny_qwen3_next, prompt, OUT, stop_at_eos=False)
        for (prev, o_prev), (_, o) in itertools.pairwise(turns):
            # The last output token of a turn has no KV: everything before it is reused.
            assert o.cached_tokens == len(prev) + len(o_prev.ids) - 1
    first_turns = sorted(t[0][1].cached_tokens for t in convos)
    assert first_turns[-1] >= 16, first_turns  # later clients reuse (part of) the system prompt
    mem = _mem(loop)
    assert _sc(mem).cow_copy >= 8 and _sc(mem).fork_inserted > 0 and _sc(mem).donated > 0
    mem.check_idle()


def test_tombstones_fall_back_to_the_last_state_and_an_exact_insert_revives(tiny_qwen3_next: Path) -> None:
    """Evicting inner states leaves tombstones: a match walks through them to a deeper state or
    falls back to a shallower one, a new request checkpoints at a tombstone (revives it), and
    every output still equals transformers."""
    eng = h.engine(tiny_qwen3_next, kv_cache_bytes=1 << 22, max_rows=4)
    vocab = eng.info.vocab_size
    rng = random.Random(7)
    p = [rng.randrange(3, vocab) for _ in range(40)]
    tail = [rng.randrange(3, vocab) for _ in range(5)]
    cfg = LoopConfig(max_prefill_tokens=1024, checkpoint_every=16, mamba_policy="lru")

    async def body(loop: SchedulerLoop) -> list[tuple[list[int], h.Outcome]]:
        mem = _mem(loop)
        done = []
        a = await h.one(loop, "a", h.Spec(p, OUT))  # states at 16, 32 (chunk grid), 45 (donated)
        done.append((p, a))
        assert _tree(mem).evict_states(1) == 1  # the least recently used: 16
        assert _tombstones(_tree(mem)) == 1
        b_prompt = p + a.ids[:5] + tail  # through the tombstone to the donated state at 45
        b = await h.one(loop, "b", h.Spec(b_prompt, OUT))
        assert b.cached_tokens == 45
        done.append((b_prompt, b))
        b2_prompt = p + a.ids[:3] + tail  # leaves the edge 32..45 at 43: falls back to 32
        b2 = await h.one(loop, "b2", h.Spec(b2_prompt, OUT))
        assert b2.cached_tokens == 32
        done.append((b2_prompt, b2))
        c_prompt = p[:16] + tail  # leaves the tree right after tombstone 16: no state on the way
        before = _tombstones(_tree(mem))
        c = await h.one(loop, "c", h.Spec(c_prompt, OUT))
        assert c.cached_tokens == 0
        done.append((c_prompt, c))
        assert _tombstones(_tree(mem)) == before - 1  # c checkpointed where it left the tree: 16
        d_prompt = p[:16] + tail[::-1]
        d = await h.one(loop, "d", h.Spec(d_prompt, OUT))
        assert d.cached_tokens == 16
        done.append((d_prompt, d))
        return done

    done, loop = h.serve(eng, cfg, body)
    for prompt, o in done:
        assert o.ids == hf_greedy(tiny_qwen3_next, prompt, OUT, stop_at_eos=False)
    _mem(loop).check_idle()


def test_tiny_state_pool_completes_every_request(tiny_qwen3_next: Path) -> None:
    """One state per row (the least a worker may have): nothing can be cached while every row
    runs, forks are skipped or evict cached states, and still every request completes with
    transformers' output."""
    rows = 4
    eng = h.engine(tiny_qwen3_next, kv_cache_bytes=1 << 22, max_rows=rows, mamba_slots=rows + 1)
    cfg = LoopConfig(max_prefill_tokens=8, checkpoint_every=8)
    convos, loop = h.serve(eng, cfg, _conversations(eng.info.vocab_size, 8, 2, system=20, seed=3))
    for turns in convos:
        for prompt, o in turns:
            assert o.finish == "length"
            assert o.ids == hf_greedy(tiny_qwen3_next, prompt, OUT, stop_at_eos=False)
    mem = _mem(loop)
    assert _sc(mem).evicted > 0 and _sc(mem).fork_skipped + _sc(mem).fork_inserted > 0
    mem.check_idle()
