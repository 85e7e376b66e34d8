"""Prefix-shared (cascade) attention is exact: the same logits as transformers, with it on and off.

Engine level: requests whose rows share leading slots (several groups in one batch, a member that
leaves its group part-way, prefill chunks and decodes mixed, then pure decode steps) on tiny Qwen3
and tiny Qwen3-Next, page size 1 and 16, for every attention path; every logit is compared with
transformers on the request's whole sequence. Scheduler level: greedy outputs through the real
loop (overlap on, chunked prefill, retraction) equal transformers with the cascade on and off.
A spy on ``find_prefix_groups`` proves the groups were really formed: a test where the shared path
silently fell back to the flat one would still pass the equality checks, so it must fail here.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

import services.worker.attention as attention_mod
from kernels import native
from kernels.attention.prefix_groups import PrefixGroups
from services.common.step import CacheOp, MambaCopy, MambaReset, ReqInput, StepRequest
from services.scheduler.loop import LoopConfig
from services.worker.attention import CpuAttention, ReferenceAttention, TritonAttention, attention_backend
from services.worker.engine import Engine, EngineConfig
from services.worker.pools import KVPool, ReqToTokenTable
from tests import sched_harness as h
from tests.reference import hf_greedy, hf_model

TOL = 1e-4
PATHS = ("cascade", "flat", "reference")


@pytest.fixture
def group_spy(monkeypatch: pytest.MonkeyPatch) -> list[PrefixGroups]:
    """Every non-empty grouping the worker found while the test ran."""
    found: list[PrefixGroups] = []
    real = attention_mod.find_prefix_groups

    def spy(*args: Any, **kw: Any) -> PrefixGroups | None:
        g = real(*args, **kw)
        if g is not None:
            found.append(g)
        return g

    monkeypatch.setattr(attention_mod, "find_prefix_groups", spy)
    return found


@dataclass
class Req:
    row: int
    mamba_slot: int
    tokens: list[int] = field(default_factory=list)  # every token whose KV is in `slots`
    slots: list[int] = field(default_factory=list)
    pending_prefix: bool = False


class Driver:
    """An engine plus the slot / row / state handout a scheduler would do. Slots come in pages of
    ``page_size`` owned by one request, as the paged radix cache hands them out."""

    def __init__(self, model: Path, attention: str, page_size: int, hybrid: bool) -> None:
        self.engine = Engine(model, EngineConfig(
            kv_cache_bytes=4 << 20, max_rows=16, max_context=512, page_size=page_size, attention=attention,  # type: ignore[arg-type]
            mamba_slots=64 if hybrid else 0))
        self.page = page_size
        self.hybrid = hybrid
        self._pages = itertools.count(1)  # page 0 never handed out: catches "all zero" bugs
        self._rows, self._states, self._steps = itertools.count(), itertools.count(), itertools.count()
        self._ops: list[CacheOp] = []
        self._open: dict[int, list[int]] = {}  # row -> free slots left in its last page

    def new(self, parent: Req | None = None, shared: int = 0, state: int | None = None) -> Req:
        """A request, fresh or starting from ``parent``'s first ``shared`` slots (and, on a hybrid
        model, from a copy of Mamba slot ``state``, the state after exactly those tokens)."""
        r = Req(next(self._rows), next(self._states))
        if parent is None:
            if self.hybrid:
                self._ops.append(MambaReset(r.mamba_slot))
            return r
        assert shared % self.page == 0, "a paged cache shares whole pages only"
        r.tokens, r.slots, r.pending_prefix = parent.tokens[:shared], parent.slots[:shared], True
        if self.hybrid:
            assert state is not None
            self._ops.append(MambaCopy(state, r.mamba_slot))
        return r

    def fork(self, r: Req) -> int:
        """Snapshot ``r``'s state into a fresh Mamba slot (hybrid) — what a checkpoint does."""
        slot = next(self._states)
        if not self.hybrid:
            return slot
        self.engine.forward_logits(StepRequest(next(self._steps), ops=[MambaCopy(r.mamba_slot, slot)]))
        return slot

    def _slots(self, r: Req, n: int) -> list[int]:
        out: list[int] = []
        free = self._open.setdefault(r.row, [])
        while len(out) < n:
            if not free:
                base = next(self._pages) * self.page
                free.extend(range(base, base + self.page))
            out.append(free.pop(0))
        return out

    def run(self, work: list[tuple[Req, list[int]]]) -> list[torch.Tensor]:
        reqs = []
        for r, ids in work:
            new = self._slots(r, len(ids))
            reqs.append(ReqInput(
                f"r{r.row}", r.row, ids, len(r.slots), new, prefix_slots=r.slots if r.pending_prefix else [],
                mamba_slot=r.mamba_slot if self.hybrid else None))
            r.tokens, r.slots, r.pending_prefix = r.tokens + ids, r.slots + new, False
        step = StepRequest(next(self._steps), ops=self._ops, reqs=reqs)
        self._ops = []
        return list(torch.split(self.engine.forward_logits(step), [len(ids) for _, ids in work]))


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 700) for _ in range(n)]


def _reference(model: Path, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(str(model))(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3-next"])
def test_groups_in_a_mixed_batch_then_decodes_equal_transformers(
    arch: str, page_size: int, attention: str, tiny_qwen3: Path, tiny_qwen3_next: Path,
    group_spy: list[PrefixGroups],
) -> None:
    model = tiny_qwen3 if arch == "qwen3" else tiny_qwen3_next
    d = Driver(model, attention, page_size, hybrid=arch == "qwen3-next")
    rng = random.Random(page_size)
    # Two cached prefixes, each prefilled in chunks that end where requests will branch off, with
    # the state after each chunk kept (the checkpoints a hybrid model's cache keeps).
    short = 16 if page_size > 1 else 20  # where one member leaves its group (mid-page at page size 1)
    a, b = d.new(), d.new()
    d.run([(a, _ids(rng, short)), (b, _ids(rng, 32))])
    a_short = d.fork(a)
    b_full = d.fork(b)
    d.run([(a, _ids(rng, 48 - short))])
    a_full = d.fork(a)
    # One batch: four requests on all of a's 48 tokens, two that leave a after `short` tokens, three
    # on b, a cold prompt — new chunks of 1 (a decode-shaped chunk) to 9 tokens.
    reqs = [d.new(a, 48, a_full) for _ in range(4)] + [d.new(a, short, a_short) for _ in range(2)]
    reqs += [d.new(b, 32, b_full) for _ in range(3)] + [d.new()]
    work = [(r, _ids(rng, n)) for r, n in zip(reqs, [3, 1, 9, 5, 4, 7, 2, 6, 1, 12], strict=True)]
    got = [list(x) for x in d.run(work)]
    for _ in range(3):  # pure decode steps over the same groups
        for i, x in enumerate(d.run([(r, _ids(rng, 1)) for r in reqs])):
            got[i].append(x[0])
    for r, logits in zip(reqs, got, strict=True):
        n = len(logits)
        want = _reference(model, r.tokens)[-n:]
        assert float((torch.stack(logits) - want).abs().max()) < TOL
    if attention == "cascade":
        # The mixed step and each decode step formed the three groups (a's 48, a's `short`, b's 32).
        shapes = [sorted(zip(g.shared_lens, (len(g.group(i)) for i in range(g.num_groups)), strict=True))
                  for g in group_spy]
        assert len(shapes) == 4 and all(s == sorted([(48, 4), (short, 2), (32, 3)]) for s in shapes), shapes
    else:
        assert group_spy == []


def _shared_specs(vocab: int, seed: int, groups: int, per_group: int, prefix: int, new: int) -> list[h.Spec]:
    rng = random.Random(seed)
    heads = [[rng.randrange(3, vocab) for _ in range(prefix)] for _ in range(groups)]
    specs = [h.Spec(p + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 9))], new)
             for p in heads for _ in range(per_group)]
    specs += [h.Spec([rng.randrange(3, vocab) for _ in range(rng.randrange(5, 30))], new) for _ in range(2)]
    rng.shuffle(specs)
    return specs


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3-next"])
def test_greedy_through_the_loop_equals_transformers_with_and_without_sharing(
    arch: str, page_size: int, tiny_qwen3: Path, tiny_qwen3_next: Path, group_spy: list[PrefixGroups]
) -> None:
    """Many requests on three prefixes plus unrelated ones, chunked prefill mixing with decodes,
    overlap on; cascade and flat both equal transformers' greedy output."""
    model = tiny_qwen3 if arch == "qwen3" else tiny_qwen3_next
    specs = _shared_specs(700, seed=page_size, groups=3, per_group=5, prefix=40, new=6)
    want = [hf_greedy(model, s.prompt, s.max_new_tokens, stop_at_eos=False) for s in specs]
    for attention in ("cascade", "flat"):
        eng = Engine(model, EngineConfig(kv_cache_bytes=1 << 22, max_rows=32, page_size=page_size,
                                         attention=attention))  # type: ignore[arg-type]
        outs, loop = h.run(eng, specs, LoopConfig(cache="radix", max_prefill_tokens=48, overlap=True))
        assert [o.ids for o in outs] == want, attention
        assert loop.batcher is not None
        loop.batcher.mem.check_idle()
    assert group_spy and max(max(g.shared_lens) for g in group_spy) >= 32


def test_retraction_with_sharing_stays_exact(tiny_qwen3: Path, group_spy: list[PrefixGroups]) -> None:
    """A pool that holds about two requests: decodes retract, resume from the tree, and share again."""
    specs = _shared_specs(700, seed=5, groups=2, per_group=4, prefix=40, new=10)
    want = [hf_greedy(tiny_qwen3, s.prompt, s.max_new_tokens, stop_at_eos=False) for s in specs]
    probe = h.engine(tiny_qwen3, kv_cache_bytes=1 << 16, max_rows=8)
    eng = Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=150 * probe.info.bytes_per_slot, max_rows=8))
    outs, loop = h.run(eng, specs, LoopConfig(cache="radix", max_prefill_tokens=64))
    assert [o.ids for o in outs] == want
    assert loop.batcher is not None and loop.batcher.retractions > 0
    assert group_spy


def test_the_backend_is_chosen_once_from_the_path_and_the_device() -> None:
    """CPU pools: ``cascade`` and ``flat`` on the CPU backend (groups only with ``cascade``, the
    native decode for fp32 pools where it is built); CUDA pools: Triton; ``reference``, or a device
    with neither: the torch references."""
    table = ReqToTokenTable(1, 1)

    def backend(
        path: str, device: str, dtype: torch.dtype = torch.float32, head_dim: int = 64
    ) -> attention_mod.AttentionBackend:
        kv = cast(KVPool, SimpleNamespace(device=torch.device(device), dtype=dtype, head_dim=head_dim))  # what it reads
        return attention_backend(path, kv, table)  # type: ignore[arg-type]

    for path, cascade in (("cascade", True), ("flat", False)):
        cpu = backend(path, "cpu")
        assert isinstance(cpu, CpuAttention) and cpu.cascade == cascade
        assert cpu.native_decode == cpu.native_extend == (native.load() is not None)
        odd = backend(path, "cpu", head_dim=24)  # the kernel's several-row path takes multiples of 16
        assert isinstance(odd, CpuAttention) and odd.native_decode == (native.load() is not None)
        assert not odd.native_extend
        half = backend(path, "cpu", torch.bfloat16)
        assert isinstance(half, CpuAttention) and not half.native_decode and not half.native_extend
        gpu = backend(path, "cuda")
        assert isinstance(gpu, TritonAttention) and gpu.cascade == cascade
        assert isinstance(backend(path, "meta"), ReferenceAttention)
    assert isinstance(backend("reference", "cpu"), ReferenceAttention)
    assert isinstance(backend("reference", "cuda"), ReferenceAttention)
