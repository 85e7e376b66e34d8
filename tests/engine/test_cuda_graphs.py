"""Decode steps replayed from CUDA graphs (services/worker/cuda_graphs.py) against transformers.

On the CPU the engine records no graph; these tests give it ``DecodeGraphs`` with ``eager_capture``
(a replay runs the forward again over the same static buffers) and the reference attention, so the
buckets, the padding rows, their dropped KV slots and the static views are all checked here. With
``STRATA_TEST_DEVICE=cuda`` (the GPU check, benchmarks/gpu_check.py) the engine's own graphs run:
real CUDA graphs over the Triton kernels.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from services.scheduler.loop import LoopConfig
from services.worker.cuda_graphs import DecodeGraphs, buckets, eager_capture
from services.worker.engine import Engine, EngineConfig
from tests import sched_harness as h
from tests.device import TEST_DEVICE
from tests.reference import hf_greedy


def test_buckets_cover_every_batch_size() -> None:
    for top in (1, 5, 8, 17, 64, 100, 256, 1000):
        sizes = buckets(top)
        assert sizes == tuple(sorted(set(sizes))) and sizes[-1] == top
        for n in range(1, top + 1):
            b = next(s for s in sizes if s >= n)
            assert b - n <= max(3, b // 3), (top, n, b)  # 3 rows or a third of a bucket at most
    assert buckets(256)[:7] == (1, 2, 4, 8, 12, 16, 24) and len(buckets(256)) == 20
    with pytest.raises(ValueError, match="max_batch"):
        DecodeGraphs(None, None, torch.device("cpu"), 0, eager_capture)  # type: ignore[arg-type]


def _engine(model: Path, max_graph_batch: int) -> Engine:
    """An engine whose decode steps of up to ``max_graph_batch`` requests replay graphs."""
    if TEST_DEVICE != "cpu":  # the engine's own CUDA graphs, over the Triton kernels
        eng = Engine(model, EngineConfig(device=TEST_DEVICE, kv_cache_bytes=1 << 22, max_rows=32,
                                         cuda_graph_max_batch=max_graph_batch))  # fmt: skip
        assert eng.graphs is not None, "a dense model on CUDA decodes through graphs"
        return eng
    eng = Engine(model, EngineConfig(kv_cache_bytes=1 << 22, max_rows=32, attention="reference"))
    assert eng.graphs is None, "no graphs on the CPU"
    eng.graphs = DecodeGraphs(eng.model, eng._ctx, eng.device, max_graph_batch, eager_capture)
    return eng


@pytest.mark.parametrize("overlap", [False, True])
def test_graphed_decode_equals_transformers(tiny_qwen3: Path, overlap: bool) -> None:
    """Eleven requests of different lengths finish at different steps, so the decode batch shrinks
    through sizes that pad (to buckets 8, 4, 2) and some above the graphs' largest (eager); greedy
    output equals transformers for each, with and without overlap (decodes whose input is the
    last sample, resolved on the worker)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randrange(3, 40))] for _ in range(11)]
    lengths = [4 + 2 * i for i in range(11)]
    eng = _engine(tiny_qwen3, max_graph_batch=8)
    specs = [h.Spec(p, n) for p, n in zip(prompts, lengths, strict=True)]
    outs, loop = h.run(eng, specs, LoopConfig(cache="radix", overlap=overlap))
    for p, n, o in zip(prompts, lengths, outs, strict=True):
        assert o.ids == hf_greedy(tiny_qwen3, p, n, stop_at_eos=False)
    assert eng.graphs is not None and eng.graphs.replays > 0
    assert set(eng.graphs._replays) <= set(eng.graphs.buckets) and len(eng.graphs._replays) >= 3
    loop.batcher.mem.check_idle()


def test_graphed_logits_match_the_eager_forward(tiny_qwen3: Path) -> None:
    """One decode step's logits through the graph of a padded bucket against the same step run
    eagerly on a twin engine: equal up to fp32 rounding, and the padding wrote no KV slot."""
    from services.common.step import ReqInput, StepRequest

    graphed, eager = _engine(tiny_qwen3, max_graph_batch=8), Engine(
        tiny_qwen3, EngineConfig(device=TEST_DEVICE, kv_cache_bytes=1 << 22, max_rows=32, cuda_graph_max_batch=0)
    )
    assert eager.graphs is None
    prompts = [[7, 8, 9, 10], [11, 12], [13, 14, 15]]
    slot = 0
    prefill, decode = [], []
    for row, p in enumerate(prompts):
        prefill.append(ReqInput(f"r{row}", row, p, 0, list(range(slot, slot + len(p))), sample=False))
        decode.append(ReqInput(f"r{row}", row, [p[-1] + 1], len(p), [slot + len(p)]))
        slot += len(p) + 1
    for eng in (graphed, eager):
        eng.forward_logits(StepRequest(1, reqs=prefill))
    k_before = graphed.kv.layer(0)[0][slot:].clone()  # slots no request owns
    # forward_logits runs eagerly (logits of every token): call the step's forward path itself.
    with torch.inference_mode():
        got = graphed._run(graphed._batch_input(decode), all_logits=False).float().cpu()
        want = eager._run(eager._batch_input(decode), all_logits=False).float().cpu()
    assert graphed.graphs is not None and graphed.graphs.replays == 1  # 3 requests: bucket 4, one pad row
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert torch.equal(graphed.kv.layer(0)[0][slot:], k_before)
