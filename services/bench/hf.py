"""The transformers reference on the same checkpoint: batched ``generate`` and continuous batching.

Both take single-turn workloads only (every prompt known up front) and treat all requests as
submitted at the start of the run, like the other drivers at unbounded request rate.

* ``hf_batched``: ``model.generate`` on batches of ``batch_size`` prompts, left-padded, greedy,
  ``min_new_tokens = max_new_tokens`` with no eos, so every row produces exactly its tokens. No
  streaming: only end-to-end latency (the end of a request's batch) is known.
* ``hf_continuous``: ``model.generate_batch`` (transformers' ``ContinuousBatchingManager``, paged
  KV with block sharing for prefixes). Per-token timestamps give TTFT and ITL. The manager's start
  (warm-up) and stop are *not* counted: the run lasts from the first request's creation to the
  last token, which favours transformers.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from services.bench.metrics import RequestRecord
from services.bench.runner import Say
from services.bench.workloads import Workload

_PAD_ID = 0


def _single_turn(workload: Workload) -> list[tuple[list[int], int, int]]:
    """(prompt, max_new_tokens, ideal reuse) of each request; only single-turn workloads."""
    if any(len(c) != 1 for c in workload.conversations):
        raise ValueError(f"transformers drivers take single-turn workloads only, not {workload.kind}")
    return [(c[0].prompt_for([]), c[0].max_new_tokens, c[0].ideal_reuse([])) for c in workload.conversations]


def load_hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_batched(
    model: Any, workload: Workload, batch_size: int, say: Say | None = None
) -> tuple[list[RequestRecord], float]:
    """``generate`` batch by batch; returns records and wall time."""
    items = _single_turn(workload)
    start = time.perf_counter()
    records: list[RequestRecord] = []
    with torch.inference_mode():
        for b in range(0, len(items), batch_size):
            batch = items[b : b + batch_size]
            new = max(n for _, n, _ in batch)
            width = max(len(p) for p, _, _ in batch)
            ids = torch.full((len(batch), width), _PAD_ID, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, (p, _, _) in enumerate(batch):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=_PAD_ID,
            )
            end = time.perf_counter()
            produced = out.shape[1] - width
            for p, n, ideal in batch:
                rec = RequestRecord(len(p), n, ideal, start, finished=end, output_tokens=min(n, produced))
                records.append(rec)
            if say is not None:
                say(f"    transformers generate: {len(records)}/{len(items)} requests, {end - start:.1f}s")
    return records, time.perf_counter() - start


def hf_continuous(model: Any, workload: Workload, say: Say | None = None) -> tuple[list[RequestRecord], float]:
    """``generate_batch`` (continuous batching); returns records and the active time."""
    from transformers import GenerationConfig

    items = _single_turn(workload)
    new = max(n for _, n, _ in items)
    cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=_PAD_ID)
    if say is not None:
        say(f"    transformers continuous batching: {len(items)} requests (warm-up + run)")
    outputs = model.generate_batch(
        [p for p, _, _ in items], generation_config=cfg, max_new_tokens=new, record_timestamps=True
    )
    records: list[RequestRecord] = []
    for (p, n, ideal), out in zip(items, outputs.values(), strict=True):
        rec = RequestRecord(len(p), n, ideal, out.created_time)
        if out.error is not None:
            rec.error = str(out.error)
        stamps = list(out.timestamps or [])
        if stamps:
            rec.first_token = stamps[0]
            rec.finished = stamps[-1]
            rec.chunks = [(t, 1) for t in stamps]
        rec.output_tokens = len(out.generated_tokens)
        records.append(rec)
    first = min(r.submitted for r in records)
    last = max((r.finished for r in records if r.finished is not None), default=first)
    return records, last - first
