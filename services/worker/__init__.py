"""The worker: weights, pools, forward and sampling.

OpenMP threads (torch's intra-op pool and the native attention kernel) wait for work passively
unless told otherwise. libgomp's default is to spin for a while after every parallel region: a
decode step runs hundreds of small regions, and the spinning thread burnt a core that the
tokenizer and scheduler beside it needed (on 2 cores at 256 streams the worker spent 226 µs of CPU
per output token spinning, 44 µs passive, at equal step speed). It must be set before torch loads
libgomp, hence here; an explicit ``OMP_WAIT_POLICY`` in the environment wins.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
