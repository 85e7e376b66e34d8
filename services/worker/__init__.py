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
"""

import os

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "20000"
