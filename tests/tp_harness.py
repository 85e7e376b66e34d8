"""Run one function on every rank of a real gloo tensor-parallel group (one process per rank).

``run_group(size, fn, *args)`` starts ``size`` processes (spawn), each joins the group
(``Tp.join``) and calls ``fn(tp, *args)``; it returns every rank's result, in rank order. ``fn``
must be importable (a module-level function) and its result picklable.

``paths_scenario`` is the scenario the TP tests run on each rank: one engine, every cache path
(cold, decode, chunked, prefix hit, host-reloaded, L3-reloaded, greedy decode with
``use_last_sample``; speculative verify passes), the logits of each path (rank 0's are what the
server would use) and the L3 keys the rank wrote.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.etcd_proc import free_port
from services.common.step import (
    GREEDY,
    HostBackup,
    HostLoad,
    L3Get,
    L3Put,
    MambaCopy,
    MambaReset,
    ReqInput,
    StateBackup,
    StateLoad,
    StepRequest,
)
from tests.engine.test_host_ops import FakePort

PAGE = 16  # host page tokens in the scenario


def _rank_main(rank: int, size: int, init: str, fn: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
    from services.worker.tp import Tp

    torch.set_num_threads(1)
    try:
        tp = Tp.join(init, rank, size, timeout_s=120)
        # Plain pickle: a queue would share tensors through file descriptors that die with this process.
        out.put((rank, "ok", pickle.dumps(fn(tp, *args))))
        tp.close()
    except BaseException:  # report, so the test fails with the rank's traceback instead of hanging
        out.put((rank, "error", traceback.format_exc()))


def run_group(size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 300) -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, size, init, fn, args, out)) for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(size):
            rank, status, value = out.get(timeout=timeout_s)
            if status != "ok":
                raise AssertionError(f"rank {rank} of {size} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(size)]


@dataclass
class _Req:
    rid: str
    row: int
    mamba: int
    slots: list[int] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)  # sent on the next step, then cleared


class _Driver:
    """The bookkeeping a scheduler does, for one engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.hybrid = engine.mamba is not None
        self._slot = itertools.count(1)
        self._row, self._mamba, self._step = itertools.count(), itertools.count(), itertools.count()
        self.ops: list[Any] = []

    def new(self, prefix_slots: list[int] | None = None, state_from: int | None = None) -> _Req:
        n = next(self._row)
        r = _Req(f"r{n}", n, next(self._mamba))
        if self.hybrid:
            self.ops.append(MambaReset(r.mamba) if state_from is None else MambaCopy(state_from, r.mamba))
        if prefix_slots:
            r.slots, r.prefix = list(prefix_slots), list(prefix_slots)
        return r

    def fresh_mamba(self) -> int:
        return next(self._mamba)

    def take(self, n: int) -> list[int]:
        return [next(self._slot) for _ in range(n)]

    def _input(self, r: _Req, ids: list[int], last: bool = False) -> ReqInput:
        new = self.take(1 if last else len(ids))
        inp = ReqInput(
            r.rid, r.row, [] if last else ids, len(r.slots), new, prefix_slots=r.prefix,
            mamba_slot=r.mamba if self.hybrid else None, sampling=GREEDY, use_last_sample=last,
        )  # fmt: skip
        r.slots, r.prefix = r.slots + new, []
        return inp

    def logits(self, work: list[tuple[_Req, list[int]]]) -> list[torch.Tensor]:
        step = StepRequest(next(self._step), ops=self.ops, reqs=[self._input(r, ids) for r, ids in work])
        self.ops = []
        out = self.engine.forward_logits(step)
        return list(torch.split(out, [len(ids) for _, ids in work]))

    def ops_only(self, ops: list[Any]) -> list[Any]:
        return self.engine.step(StepRequest(next(self._step), ops=self.ops + ops)).jobs

    def greedy(self, r: _Req, ids: list[int], n: int) -> list[int]:
        """Prefill ``ids`` and sample, then ``n - 1`` decodes fed by ``use_last_sample``."""
        step = StepRequest(next(self._step), ops=self.ops, reqs=[self._input(r, ids)])
        self.ops = []
        out = [self._sampled(step)]
        for _ in range(n - 1):
            out.append(self._sampled(StepRequest(next(self._step), reqs=[self._input(r, [], last=True)])))
        return out

    def _sampled(self, step: StepRequest) -> int:
        outputs = self.engine.step(step).outputs
        return outputs[0].token_id if outputs else -1  # only rank 0 reports what it sampled


def prompt(n: int, seed: int, vocab: int = 768) -> list[int]:
    return torch.randint(3, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


P, Q, S1, S2, S3, DEC = prompt(32, 1), prompt(30, 2), prompt(10, 3), prompt(9, 4), prompt(11, 5), prompt(4, 6)


def paths_scenario(tp: Any, model_dir: str, draft_truth: list[int] | None = None) -> dict[str, Any]:
    """Every cache path on this rank's engine; see the module docstring. With ``draft_truth``
    (greedy's answer after ``P``), also verify drafts against it (``_verify_drafts``)."""
    from services.worker.engine import Engine, EngineConfig

    l3 = FakePort()  # this rank's own dict; the real kvstore is in test_tp_services
    cfg = EngineConfig(
        kv_cache_bytes=2 << 20, max_rows=16, max_context=256, mamba_slots=32,
        host_cache_bytes=1 << 20, host_page_tokens=PAGE, threads=1,
    )  # fmt: skip
    engine = Engine(model_dir, cfg, l3=l3, tp=tp)
    d = _Driver(engine)
    out: dict[str, Any] = {}
    # cold prefill in two chunks (the state after the first page is checkpointed), then decodes
    a = d.new()
    first = d.logits([(a, P[:PAGE])])[0]
    ckpt = d.fresh_mamba()
    if d.hybrid:
        d.ops.append(MambaCopy(a.mamba, ckpt))
    out["cold"] = torch.cat([first, d.logits([(a, P[PAGE:])])[0]])
    out["decode"] = torch.cat([d.logits([(a, [t])])[0] for t in DEC])
    c = d.new()
    out["chunked"] = torch.cat([d.logits([(c, Q[i : i + 7])])[0] for i in range(0, len(Q), 7)])
    b = d.new(prefix_slots=a.slots[:PAGE], state_from=ckpt if d.hybrid else None)
    out["prefix_hit"] = d.logits([(b, S1)])[0]
    # host: back the first page (and its state) up, load it into fresh slots, extend from there
    host_ops: list[Any] = [HostBackup(1, tuple(a.slots[:PAGE]), (0,))]
    if d.hybrid:
        host_ops.append(StateBackup(2, (ckpt,), (0,)))
    d.ops_only(host_ops)
    slots, state = d.take(PAGE), d.fresh_mamba()
    load: list[Any] = [HostLoad(3, (0,), tuple(slots))] + ([StateLoad(4, (0,), (state,))] if d.hybrid else [])
    d.ops_only(load)
    h = d.new(prefix_slots=slots, state_from=state if d.hybrid else None)
    out["host_reloaded"] = d.logits([(h, S2)])[0]
    # L3: put the page (and state), get them into other host slots, load, extend
    key, skey = bytes(range(32)), bytes(range(1, 33))
    puts: list[Any] = [L3Put(5, (0,), (key,))] + ([L3Put(6, (0,), (skey,), states=True)] if d.hybrid else [])
    out["put_jobs"] = [(j.ok, j.pages) for j in d.ops_only(puts)]
    gets: list[Any] = [L3Get(7, (key,), (1,))] + ([L3Get(8, (skey,), (1,), states=True)] if d.hybrid else [])
    out["get_jobs"] = [(j.ok, j.pages) for j in d.ops_only(gets)]
    slots, state = d.take(PAGE), d.fresh_mamba()
    d.ops_only([HostLoad(9, (1,), tuple(slots))] + ([StateLoad(10, (1,), (state,))] if d.hybrid else []))
    e = d.new(prefix_slots=slots, state_from=state if d.hybrid else None)
    out["l3_reloaded"] = d.logits([(e, S3)])[0]
    out["l3_keys"] = sorted(l3.pages)
    out["greedy"] = d.greedy(d.new(), P, 12)
    if draft_truth is not None:
        out["drafts"] = _verify_drafts(tp, d, draft_truth)
    out["info"] = engine.info
    out["reduced_bytes"] = tp.reduced_bytes
    return out


def _verify_drafts(tp: Any, d: _Driver, truth: list[int], n: int = 12, k: int = 3) -> dict[str, Any]:
    """Speculative verify passes on every rank: prefill ``P`` on a new row, then decode by
    verifying ``k`` drafts a step, taken from ``truth`` (greedy's answer) with every third output
    position wrong, so steps keep some drafts and reject the rest. Rank 0 samples; every rank must
    end each step with the same row length and (hybrid) recurrent state, or the next step's
    forward differs. Returns the tokens kept and how many each step kept."""
    r = d.new()
    step = StepRequest(next(d._step), ops=d.ops, reqs=[d._input(r, P)])
    d.ops = []
    out = [_shared(tp, d.engine.step(step).outputs, 1)[0]]
    per_step = []
    while len(out) < n:
        at = len(out)
        drafts = [t if (at + j) % 3 else (t + 1) % 768 for j, t in enumerate(truth[at : min(at + k, n - 1)])]
        inp = ReqInput(
            r.rid, r.row, [out[-1], *drafts], len(P) + at - 1, d.take(1 + len(drafts)),
            mamba_slot=r.mamba if d.hybrid else None, sampling=GREEDY, output_index=at, num_draft=len(drafts),
        )  # fmt: skip
        kept = _shared(tp, d.engine.step(StepRequest(next(d._step), reqs=[inp])).outputs, 1 + len(drafts))
        out += kept
        per_step.append(len(kept))
    return {"tokens": out[:n], "kept": per_step}

def _shared(tp: Any, outputs: list[Any], most: int) -> list[int]:
    """Rank 0's sampled ids (up to ``most``), on every rank (the harness's own bookkeeping)."""
    ids = [o.token_id for o in outputs] if tp.rank == 0 else []
    got = tp.share_ints([len(ids)] + ids + [0] * (most - len(ids)), most + 1)
    assert got is not None
    return got[1 : 1 + got[0]]
