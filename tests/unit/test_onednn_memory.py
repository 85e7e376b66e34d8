"""oneDNN's per-shape caches are bounded in a worker: packed linear weights at many row counts
(prefill chunks of every length) leave its memory where it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# Multiplies a oneDNN-packed 512 x 1536 weight (the bench model's MLP) at 300 row counts and
# prints the RSS growth in MiB. Importing services.worker first is what a worker does.
PROBE = """
import services.worker, psutil, torch
torch.set_num_threads(1)
w = torch.randn(1536, 512)
packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
run = lambda m: torch.ops.mkldnn._linear_pointwise(torch.randn(m, 512), packed, None, "none", [], "")
for m in range(1, 9):
    run(m)
before = psutil.Process().memory_info().rss
for m in range(64, 364):
    run(m)
print((psutil.Process().memory_info().rss - before) / 2**20)
"""


def _growth_mib(**env: str) -> float:
    base = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**base, **env}, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_packed_weights_at_many_row_counts_hold_no_memory() -> None:
    bounded = _growth_mib()
    # The same with oneDNN's and ideep's default capacities (1,024 shapes each): the probe is
    # able to see the growth the bound prevents.
    unbounded = _growth_mib(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    assert unbounded > 100, unbounded
    assert bounded < 32, bounded
