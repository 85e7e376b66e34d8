"""The worker: weights, pools, forward and sampling.

OpenMP threads (torch's intra-op pool and the native attention kernel) spin for a bounded while
after each parallel region, then sleep: ``GOMP_SPINCOUNT=20000`` unless the environment says
otherwise (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``). Measured on 2 cores (docs/benchmarks.md):

- libgomp's default (300,000 spins, milliseconds): between steps the spinning thread burnt the
  core the tokenizer and scheduler beside it needed. 256 streams on the near-null model: worker
  85-121 µs of CPU per output token, 6.8-7.7k tok/s; 20,000 spins: 58-61 µs, 10-11k tok/s.
- sleeping at once (``PASSIVE``, or 2,000 spins) is cheaper still there (36-42 µs) but wakes the
  threads for each of a step's hundreds of small parallel regions: the bench model's small-batch
  decodes were 10-25 % slower than with the default; with 20,000 spins they are on a par.

It must be set before torch loads libgomp, hence here.

oneDNN (the packed linear weights, ``kernels/linear.py``) keeps what it builds for each input
shape, JIT code and buffers, ~0.5-2 MiB a shape, in two caches of 1,024 entries each: its own
primitive cache and ideep's (torch's ``LRU_CACHE_CAPACITY``). Prefill chunks come in every row
count, so a worker with packed copies grew by ~0.5 MiB per new chunk length, and past 1,024 lengths
by more (a linear layer cycling 1,100 row counts twice: 4.1 GiB). Both are capped at
``ONEDNN_CACHE_ENTRIES`` unless the environment sets them: a step uses ~7 shapes, and building a
shape's primitive measured no slower than calling a cached one (2.3-2.4 against 2.5-2.6 ms at 300
rows of a 512 x 1536 weight).
"""

import os

ONEDNN_CACHE_ENTRIES = 16

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "20000"
for _cache in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_cache, str(ONEDNN_CACHE_ENTRIES))
