"""Speed against the machine: its matmul and copy rates, a batch decode step against its floor,
and the time of a cold prompt against one transformers forward.

The floor of a step is the larger of its FLOPs over the measured fp32 GEMM rate and its bytes read
(every linear weight once, plus the KV of the *distinct* slots the step attends to: a shared prefix
counts once) over the measured copy rate. Both rates are measured in the same process, right
before, so the ratio step / floor is comparable across machines and loads.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GEMM_N = 2048  # square fp32 GEMM for the matmul rate
COPY_BYTES = 256 << 20  # tensor copied for the copy rate (well past every cache)


def median_time(fn: Any, repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn``, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine_rates(repeats: int = 5) -> tuple[float, float]:
    """(fp32 GEMM GFLOP/s, copy GB/s — bytes copied per second, each read once and written once)."""
    a, b = torch.randn(GEMM_N, GEMM_N), torch.randn(GEMM_N, GEMM_N)
    gflops = 2 * GEMM_N**3 / median_time(lambda: a @ b, repeats) / 1e9
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    gbs = COPY_BYTES / median_time(lambda: dst.copy_(src), repeats) / 1e9
    return gflops, gbs


@dataclass(frozen=True, slots=True)
class DecodeFloor:
    attention: str
    batch: int
    step_s: float  # median decode step (Engine.step wall time)
    step_min_s: float
    step_max_s: float
    flops: float
    bytes_read: float
    distinct_slots: float  # KV slots the step reads (a shared prefix once), averaged over the steps
    rows_slots: float  # what every request's whole row adds up to (the read without sharing)
    gflops: float
    copy_gbs: float

    @property
    def floor_s(self) -> float:
        return max(self.flops / (self.gflops * 1e9), self.bytes_read / (self.copy_gbs * 1e9))

    @property
    def ratio(self) -> float:
        return self.step_s / self.floor_s

    def describe(self) -> str:
        return (f"{self.attention}: step {self.step_s * 1e3:.1f} ms (min {self.step_min_s * 1e3:.1f}, max "
                f"{self.step_max_s * 1e3:.1f}), floor {self.floor_s * 1e3:.1f} ms ({self.flops / 1e9:.2f} GFLOP at "
                f"{self.gflops:.0f} GFLOP/s, {self.bytes_read / 2**20:.0f} MiB at {self.copy_gbs:.1f} GB/s): "
                f"x{self.ratio:.2f}")


def _linear_weights(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters of every linear layer, their bytes): what one token's matmuls multiply by."""
    params = nbytes = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            params += m.weight.numel()
            nbytes += m.weight.numel() * m.weight.element_size()
    return params, nbytes


def decode_floor(
    model_dir: Path, attention: str, gflops: float, copy_gbs: float, *, groups: int = 4, per_group: int = 16,
    prefix: int = 512, question: int = 32, steps: int = 10, seed: int = 0,
) -> DecodeFloor:
    """Time decode steps of ``groups * per_group`` requests that share ``prefix`` tokens per group
    (the shape of the shared-prefix workload), on a fresh engine with ``attention``."""
    from services.common.step import ReqInput, StepRequest
    from services.worker.engine import Engine, EngineConfig

    batch = groups * per_group
    eng = Engine(model_dir, EngineConfig(kv_cache_bytes=512 << 20, max_rows=batch + groups,
                                         attention=attention))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    vocab = eng.info.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    slot = itertools.count(1)
    step = itertools.count()

    def take(n: int) -> list[int]:
        return [next(slot) for _ in range(n)]

    heads = []
    for g in range(groups):
        s = take(prefix)
        eng.step(StepRequest(next(step), reqs=[ReqInput(f"p{g}", batch + g, ids(prefix), 0, s, sample=False)]))
        heads.append(s)
    firsts = [ReqInput(f"r{b}", b, ids(question), prefix, take(question), prefix_slots=heads[b % groups])
              for b in range(batch)]
    for i in range(0, batch, per_group):
        eng.step(StepRequest(next(step), reqs=firsts[i : i + per_group]))
    lengths = [prefix + question] * batch
    times = []
    for _ in range(steps):
        reqs = [ReqInput(f"r{b}", b, [], lengths[b], take(1), use_last_sample=True) for b in range(batch)]
        t0 = time.perf_counter()
        eng.step(StepRequest(next(step), reqs=reqs))
        times.append(time.perf_counter() - t0)
        lengths = [n + 1 for n in lengths]
    times = times[2:]  # the first steps warm the allocator and the pool pages up
    mean_len = statistics.mean(lengths) - steps / 2
    model: Any = eng.model
    params, weight_bytes = _linear_weights(model)
    hq = getattr(getattr(model, "config", None), "num_heads", 0) or model.num_kv_heads
    flops = 2 * params * batch + 4 * batch * hq * model.head_dim * mean_len * model.num_kv_layers
    distinct = groups * prefix + batch * (mean_len - prefix)
    kv_bytes = distinct * eng.info.bytes_per_slot
    return DecodeFloor(attention, batch, statistics.median(times), min(times), max(times), flops,
                       weight_bytes + kv_bytes, distinct, batch * mean_len, gflops, copy_gbs)


def hf_forward_s(model: Any, ids: list[int]) -> float:
    """Wall time of one transformers forward over ``ids`` (the prefill a TTFT is compared with)."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(torch.tensor([ids]))
        return time.perf_counter() - t0
