"""The engine on the test device against transformers, fp32 and bf16, Qwen3 and Qwen3-Next, on every
cache path (the device: ``STRATA_TEST_DEVICE``, tests/device.py, default the CPU; a lent GPU runs this
file on ``cuda`` through scripts/gpu_check.sh).

The truth is transformers in fp32 on the CPU, fed the same pieces as the engine (one forward per
prefill chunk or decode step through its own cache: the hybrid's gated delta rule rounds differently
in its chunked and recurrent forms). Tolerances:

- fp32, on the largest |Δ logit| of every step: below 1e-4 on Qwen3, the bar of
  test_engine_qwen3.py, and 2e-4 on Qwen3-Next. On this checkpoint two correct fp32 evaluations of
  the hybrid already differ by ~1.5e-4 (test_qwen3_next.py lowers the gain of its own copy to stay
  under 1e-4); here six rows decoding from one forked state measure 1.1e-4 on the CPU, every
  attention path alike, while every other path stays under 4e-5. On a GPU the attention kernels
  multiply in IEEE fp32 (``input_precision="ieee"``) and torch keeps TF32 off: the same bars hold.
- bf16, over a path: the median over its tokens of each token's largest |Δ logit| is at most
  ``BF16_RATIO`` (1.5) × the same median for transformers itself in bf16 (same device, same pieces),
  plus ``BF16_FLOOR`` (1 %) of the largest reference logit, and every logit is finite. bf16 keeps 8
  significant bits: transformers' own median is 0.2-0.35 on logits of ±21 (Qwen3) and ±11
  (Qwen3-Next), and the engine's 0.85-1.1x (Qwen3) and 0.7-1.35x (Qwen3-Next) of it on the CPU.
  The median, not the largest: the hybrid's experts are picked by a top-k over bf16 router scores,
  so now and then one token routes differently in one implementation than in the other and its
  logits jump by up to the logit scale, in transformers' own bf16 as in the engine's, at different
  tokens. A bf16 bug (a wrong cast, an accumulation in bf16) moves most tokens; a logic bug on one
  token fails the fp32 bar.

Paths: a cold prefill; a prefix hit (another request's KV slots, and on the hybrid a copy of its
Mamba state); a chunked prefill; decode steps; all of these mixed in one batch; a decode batch whose
rows share a prefix (the cascade decode, Triton's on a GPU); the host tier (KV pages, and on the
hybrid Mamba states, copied out to host memory and loaded into other slots, then attended to); an
elastic KV pool grown in place, used, and shrunk (CUDA VMM on a GPU; skipped where the device has no
elastic backing). Each with the ``cascade``, ``flat`` and ``reference`` attention.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from services.common.step import (
    CacheOp,
    HostBackup,
    HostLoad,
    MambaCopy,
    MambaReset,
    PoolResize,
    ReleaseRow,
    ReqInput,
    StateBackup,
    StateLoad,
    StepRequest,
    StepResult,
)
from services.worker.engine import Engine, EngineConfig
from tests.device import TEST_DEVICE

FP32_TOL = {"Qwen3ForCausalLM": 1e-4, "Qwen3NextForCausalLM": 2e-4}
BF16_RATIO = 1.5
BF16_FLOOR = 0.01
HOST_PAGE = 16  # tokens per host page


@functools.lru_cache(maxsize=8)
def _hf(path: str, dtype: str, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


@functools.lru_cache(maxsize=1024)
def reference(
    path: str, pieces: tuple[tuple[int, ...], ...], dtype: str = "float32", device: str = "cpu"
) -> torch.Tensor:
    """transformers' logits (as fp32, on the CPU) for every token of ``pieces``, one forward per piece."""
    from transformers import DynamicCache

    hf = _hf(path, dtype, device)
    cache = DynamicCache(config=hf.config)  # type: ignore[arg-type]
    outs = []
    with torch.no_grad():
        for piece in pieces:
            ids = torch.tensor([piece], device=device)
            outs.append(hf(ids, past_key_values=cache, use_cache=True).logits[0].float().cpu())
    return torch.cat(outs)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 700, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


@dataclass
class Seq:
    """One request as a scheduler tracks it: its row, Mamba slot, KV slots and what it was fed."""

    rid: str
    row: int
    mamba_slot: int | None
    slots: list[int] = field(default_factory=list)
    pieces: list[tuple[int, ...]] = field(default_factory=list)
    prefix_pending: bool = False  # the next step sends ``slots`` as prefix_slots


def _cut(pieces: list[tuple[int, ...]], n: int) -> list[tuple[int, ...]]:
    """The first ``n`` tokens of ``pieces``, in the same pieces (the last one cut if it must be)."""
    out: list[tuple[int, ...]] = []
    for piece in pieces:
        if n <= 0:
            break
        out.append(piece[:n])
        n -= len(piece)
    return out


class Rig:
    """An engine on the test device plus the bookkeeping a scheduler does (slots, rows, Mamba slots)."""

    def __init__(self, model: Path, dtype: str, attention: str, **cfg: int) -> None:
        settings: dict[str, int] = {"kv_cache_bytes": 4 << 20, "max_rows": 16, "max_context": 512} | cfg
        self.model, self.dtype = model, dtype
        self.engine = Engine(model, EngineConfig(device=TEST_DEVICE, dtype=dtype, attention=attention,  # type: ignore[arg-type]
                                                 host_page_tokens=HOST_PAGE, **settings))  # type: ignore[arg-type]
        self.hybrid = self.engine.mamba is not None
        self.next_slot = itertools.count(1)  # slot 0 never handed out: catches "all zero" bugs
        self._row, self._mamba, self._step = itertools.count(), itertools.count(), itertools.count()
        self.ops: list[CacheOp] = []  # sent with the next step
        self.bf16_errors: list[tuple[torch.Tensor, torch.Tensor, float]] = []  # (engine, transformers, scale)

    def take(self, n: int) -> list[int]:
        return [next(self.next_slot) for _ in range(n)]

    def bare(self) -> Seq:
        """A request with a fresh row and Mamba slot and no ops: the caller fills its state."""
        n = next(self._row)
        return Seq(f"r{n}", n, next(self._mamba) if self.hybrid else None)

    def new(self, prefix_of: Seq | None = None, prefix_len: int = 0, state: int | None = None) -> Seq:
        """A fresh request, or one reusing ``prefix_of``'s first ``prefix_len`` KV slots and starting
        from a copy of Mamba slot ``state`` (the hybrid's state at that point, see ``fork``)."""
        seq = self.bare()
        if prefix_of is not None:
            seq.slots, seq.pieces = prefix_of.slots[:prefix_len], _cut(prefix_of.pieces, prefix_len)
            seq.prefix_pending = True
        if seq.mamba_slot is not None:
            assert prefix_of is None or state is not None, "a hybrid prefix hit needs the state at its end"
            self.ops.append(MambaReset(seq.mamba_slot) if state is None else MambaCopy(state, seq.mamba_slot))
        return seq

    def fork(self, seq: Seq) -> int | None:
        """Checkpoint ``seq``'s Mamba state as it is now into a fresh slot (None on a dense model)."""
        if seq.mamba_slot is None:
            return None
        slot = next(self._mamba)
        self.ops.append(MambaCopy(seq.mamba_slot, slot))
        return slot

    def run(self, work: list[tuple[Seq, list[int]]]) -> list[torch.Tensor]:
        """One forward over ``(request, new ids)`` pairs; each request's logits (fp32, CPU)."""
        reqs = []
        for seq, new_ids in work:
            new = self.take(len(new_ids))
            prefix = seq.slots if seq.prefix_pending else []
            reqs.append(ReqInput(seq.rid, seq.row, new_ids, len(seq.slots), new, prefix_slots=prefix,
                                 mamba_slot=seq.mamba_slot))
            seq.slots, seq.pieces, seq.prefix_pending = seq.slots + new, [*seq.pieces, tuple(new_ids)], False
        step = StepRequest(next(self._step), ops=self.ops, reqs=reqs)
        self.ops = []
        logits = self.engine.forward_logits(step).float().cpu()
        return list(torch.split(logits, [len(new_ids) for _, new_ids in work]))

    def ops_step(self, *ops: CacheOp) -> StepResult:
        """A step of pending ops then ``ops``, no request; every host job must succeed."""
        result = self.engine.step(StepRequest(next(self._step), ops=[*self.ops, *ops]))
        self.ops = []
        assert all(job.ok for job in result.jobs), result.jobs
        return result

    def check(self, seq: Seq, got: torch.Tensor) -> None:
        """``got``: the engine's logits for the last ``len(got)`` tokens ``seq`` was fed. fp32 is
        checked here; bf16 is gathered for ``check_bf16`` at the end of the path."""
        pieces = tuple(seq.pieces)
        want = reference(str(self.model), pieces)[-len(got) :]
        assert got.shape == want.shape, (got.shape, want.shape)
        assert bool(got.isfinite().all()), f"{self.dtype} logits are not all finite"
        if self.dtype == "float32":
            err, tol = max_diff(got, want), FP32_TOL[self.engine.info.architecture]
            assert err < tol, f"fp32 logits differ from transformers by {err:.3g} (tolerance {tol:g})"
            return
        hf = reference(str(self.model), pieces, self.dtype, TEST_DEVICE)[-len(got) :]
        per_token = (got - want).abs().amax(-1), (hf - want).abs().amax(-1)
        self.bf16_errors.append((*per_token, float(want.abs().max())))

    def check_bf16(self) -> None:
        if not self.bf16_errors:
            return
        ours, theirs = (torch.cat([e[i] for e in self.bf16_errors]) for i in (0, 1))
        scale = max(e[2] for e in self.bf16_errors)
        bound = BF16_RATIO * float(theirs.median()) + BF16_FLOOR * scale
        assert float(ours.median()) <= bound, (
            f"{self.dtype}: median |Δ logit| {float(ours.median()):.3g} over {len(ours)} tokens, transformers' "
            f"own {float(theirs.median()):.3g}, bound {bound:.3g}")


# --- the paths ------------------------------------------------------------------------------------


def cold_prefill(r: Rig) -> None:
    s = r.new()
    (got,) = r.run([(s, ids(57, 1))])
    r.check(s, got)


def prefix_hit(r: Rig) -> None:
    first, second = ids(40, 2), ids(18, 3)
    donor = r.new()
    r.run([(donor, first[:25])])
    state = r.fork(donor)
    r.run([(donor, first[25:])])
    hit = r.new(prefix_of=donor, prefix_len=25, state=state)
    (got,) = r.run([(hit, second)])
    r.check(hit, got)


def chunked_prefill(r: Rig) -> None:
    x, s = ids(150, 4), r.new()
    for start in range(0, len(x), 37):
        (got,) = r.run([(s, x[start : start + 37])])
        r.check(s, got)


def decode(r: Rig) -> None:
    x, s = ids(30, 5), r.new()
    r.run([(s, x[:20])])
    for token in x[20:]:
        (got,) = r.run([(s, [token])])
        r.check(s, got)


def mixed_batch(r: Rig) -> None:
    base, chunked, decoding = ids(33, 6), ids(70, 7), ids(12, 8)
    donor, cont, dec = r.new(), r.new(), r.new()
    r.run([(donor, base[:16]), (cont, chunked[:30]), (dec, decoding[:11])])
    state = r.fork(donor)
    r.run([(donor, base[16:])])
    hit, cold = r.new(prefix_of=donor, prefix_len=16, state=state), r.new()
    work = [(cold, ids(21, 9)), (dec, decoding[11:]), (hit, ids(9, 10)), (cont, chunked[30:])]
    for (seq, _), got in zip(work, r.run(work), strict=True):
        r.check(seq, got)


def shared_prefix_decode(r: Rig) -> None:
    donor = r.new()
    r.run([(donor, ids(40, 11))])
    state = r.fork(donor)
    members = [r.new(prefix_of=donor, prefix_len=40, state=state) for _ in range(6)]
    work = [(m, ids(3, 12 + i)) for i, m in enumerate(members)]
    for step in range(5):  # the suffixes, then four decode steps of the whole group
        for (seq, _), got in zip(work, r.run(work), strict=True):
            r.check(seq, got)
        work = [(m, ids(1, 100 * step + i)) for i, m in enumerate(members)]


def host_tier(r: Rig) -> None:
    donor = r.new()
    r.run([(donor, ids(2 * HOST_PAGE, 20))])
    state = r.fork(donor)
    backups: list[CacheOp] = [HostBackup(1, tuple(donor.slots), (0, 1))]
    if state is not None:
        backups.append(StateBackup(2, (state,), (0,)))
    r.ops_step(*backups)
    loaded = r.bare()  # its KV and state come from the host copies only
    loaded.slots, loaded.pieces, loaded.prefix_pending = r.take(2 * HOST_PAGE), list(donor.pieces), True
    loads: list[CacheOp] = [HostLoad(3, (0, 1), tuple(loaded.slots))]
    if loaded.mamba_slot is not None:
        loads.append(StateLoad(4, (0,), (loaded.mamba_slot,)))
    r.ops_step(*loads)
    (got,) = r.run([(loaded, ids(9, 21))])
    r.check(loaded, got)


def elastic_pool(r: Rig) -> None:
    info = r.engine.info
    if info.max_slots <= info.num_slots:
        pytest.skip(f"the KV pool on {TEST_DEVICE} cannot grow (no elastic backing)")
    grown = r.ops_step(PoolResize(info.max_slots, info.num_mamba_slots))
    assert grown.num_slots == info.max_slots
    r.next_slot = itertools.count(info.num_slots)  # only slots the pool did not have at start
    s = r.new()
    x = ids(40, 30)
    (got,) = r.run([(s, x[:37])])
    r.check(s, got)
    for token in x[37:]:
        (got,) = r.run([(s, [token])])
        r.check(s, got)
    start = info.num_slots // info.slot_granularity * info.slot_granularity
    shrunk = r.ops_step(ReleaseRow(s.row), PoolResize(start, info.num_mamba_slots))
    assert shrunk.num_slots == start
    if info.elastic:
        assert shrunk.kv_committed_bytes < grown.kv_committed_bytes


PATHS: dict[str, tuple[Callable[[Rig], None], dict[str, int]]] = {
    "cold_prefill": (cold_prefill, {}),
    "prefix_hit": (prefix_hit, {}),
    "chunked_prefill": (chunked_prefill, {}),
    "decode": (decode, {}),
    "mixed_batch": (mixed_batch, {}),
    "shared_prefix_decode": (shared_prefix_decode, {}),
    "host_tier": (host_tier, {"host_cache_bytes": 4 << 20}),
    "elastic_pool": (elastic_pool, {"kv_max_bytes": 16 << 20}),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("attention", ["cascade", "flat", "reference"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_engine_matches_transformers(arch: str, dtype: str, attention: str, path: str,
                                     request: pytest.FixtureRequest) -> None:  # fmt: skip
    model: Path = request.getfixturevalue(f"tiny_{arch}")
    run, cfg = PATHS[path]
    rig = Rig(model, dtype, attention, **cfg)
    run(rig)
    rig.check_bf16()
