"""Step time at tensor-parallel size 1 vs 2 on the bench model, and the bytes all-reduced.

Each run starts its ranks (one process each, gloo over loopback), builds the engine, then times
a prefill step (``--batch`` prompts of ``--prompt`` tokens) and ``--decode`` decode steps of the
whole batch; runs alternate TP 1 / TP 2 ``--repeats`` times and the medians and ranges are
reported side by side. TP 1 uses both cores (2 torch threads); each TP 2 rank uses one.

On this 2-core CPU machine TP 2 is expected to be slower: the two ranks share the same cores a
TP 1 engine uses, and every block adds an all-reduce over loopback TCP. The figure that carries to
GPUs is the traffic: bytes all-reduced per decode step per token (per rank), which with the
sharding of ``services.worker.tp`` is ``2 x layers x hidden x dtype bytes`` (one all-reduce after
attention, one after the MLP).

    python -m benchmarks.tp --model models/qwen3-bench [--repeats 5] [--out docs/bench/tp.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from services.common.etcd_proc import free_port
from services.common.step import GREEDY, ReqInput, StepRequest


def _rank(rank: int, size: int, init: str, args: dict[str, Any], out: Any) -> None:
    from services.worker.engine import Engine, EngineConfig
    from services.worker.tp import SINGLE, Tp

    try:
        threads = 2 if size == 1 else 1
        tp = SINGLE if size == 1 else Tp.join(init, rank, size, timeout_s=300)
        cfg = EngineConfig(kv_cache_bytes=64 << 20, max_rows=args["batch"] + 1, max_context=2048, threads=threads)
        engine = Engine(args["model"], cfg, tp=tp)
        b, n, d = args["batch"], args["prompt"], args["decode"]
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, engine.info.vocab_size, (n,), generator=g).tolist() for _ in range(b)]
        slots = iter(range(1, engine.info.num_slots))
        reqs = [
            ReqInput(f"r{i}", i, p, 0, [next(slots) for _ in p], sampling=GREEDY) for i, p in enumerate(prompts)
        ]
        t0 = time.perf_counter()
        engine.step(StepRequest(0, reqs=reqs))
        prefill_s = time.perf_counter() - t0
        before, waited = tp.reduced_bytes, tp.reduce_s
        times = []
        for s in range(d):
            step = [
                ReqInput(f"r{i}", i, [], n + s, [next(slots)], sampling=GREEDY, use_last_sample=True) for i in range(b)
            ]
            t0 = time.perf_counter()
            engine.step(StepRequest(1 + s, reqs=step))
            times.append(time.perf_counter() - t0)
        per_token = (tp.reduced_bytes - before) / (b * d)
        if rank == 0:
            out.put(("ok", {"prefill_s": prefill_s, "decode_step_s": statistics.median(times),
                            "allreduce_s_per_decode_step": (tp.reduce_s - waited) / d,
                            "reduced_bytes_per_token": per_token}))  # fmt: skip
        tp.close()
    except BaseException as e:
        out.put(("error", f"rank {rank}: {e!r}"))


def run_once(size: int, args: dict[str, Any]) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, size, init, args, out)) for r in range(size)]
    for p in procs:
        p.start()
    status, value = out.get(timeout=900)
    for p in procs:
        p.join(60)
    if status != "ok":
        raise RuntimeError(value)
    return value  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="docs/bench/tp.json")
    a = ap.parse_args(argv)
    args = {"model": a.model, "batch": a.batch, "prompt": a.prompt, "decode": a.decode}
    hf = json.loads((Path(a.model) / "config.json").read_text())
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for i in range(a.repeats):
        for size in (1, 2) if i % 2 == 0 else (2, 1):  # alternate: the machine is shared and noisy
            r = run_once(size, args)
            runs[size].append(r)
            print(f"[tp] repeat {i + 1}/{a.repeats} tp={size}: prefill {r['prefill_s'] * 1e3:.0f} ms, "
                  f"decode step {r['decode_step_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)  # fmt: skip

    def summary(key: str, size: int) -> dict[str, float]:
        xs = [r[key] for r in runs[size]]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    report = {
        "model": Path(a.model).name,
        "shape": {k: hf[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")},
        "batch": a.batch, "prompt_tokens": a.prompt, "decode_steps": a.decode, "repeats": a.repeats,
        "tp1": {k: summary(k, 1) for k in ("prefill_s", "decode_step_s")},
        "tp2": {k: summary(k, 2) for k in ("prefill_s", "decode_step_s", "allreduce_s_per_decode_step")},
        "reduced_bytes_per_decode_token": runs[2][0]["reduced_bytes_per_token"],
        "expected_bytes_per_decode_token": 2 * hf["num_hidden_layers"] * hf["hidden_size"] * 4,
    }  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    t1, t2 = report["tp1"], report["tp2"]
    print("| | TP 1 (2 threads) | TP 2 (1 thread per rank) | TP 2 / TP 1 |")
    print("|---|---|---|---|")
    for key, label in (("prefill_s", "prefill step"), ("decode_step_s", "decode step")):
        x, y = t1[key], t2[key]  # type: ignore[index]
        print(f"| {label} ({a.batch} x {a.prompt if key == 'prefill_s' else 1} tokens) | "
              f"{x['median'] * 1e3:.1f} ms ({x['min'] * 1e3:.1f}–{x['max'] * 1e3:.1f}) | "
              f"{y['median'] * 1e3:.1f} ms ({y['min'] * 1e3:.1f}–{y['max'] * 1e3:.1f}) | "
              f"{y['median'] / x['median']:.2f}× |")  # fmt: skip
    ar = report["tp2"]["allreduce_s_per_decode_step"]  # type: ignore[index]
    print(f"\nTP 2 decode step: {ar['median'] * 1e3:.1f} ms of it in all-reduces "
          f"({2 * hf['num_hidden_layers']} per step)")  # fmt: skip
    print(f"all-reduced per decode token, per rank: {report['reduced_bytes_per_decode_token']:.0f} bytes "
          f"(2 x {hf['num_hidden_layers']} layers x {hf['hidden_size']} x 4 bytes = "
          f"{report['expected_bytes_per_decode_token']} expected)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
