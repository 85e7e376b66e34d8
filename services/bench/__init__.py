"""``strata bench``: seeded workloads, drivers (gRPC stack, in-process, transformers), reports.

workloads.py   deterministic request generators (random, shared_prefix, multi_turn)
metrics.py     per-request records -> throughput, latency percentiles, cache reuse
runner.py      drivers that replay a workload against one backend and record every request
hf.py          the transformers reference (batched generate, continuous batching)
suite.py       the side-by-side comparisons of one ``strata bench`` run
report.py      JSON, PNG plots and the markdown tables of docs/benchmarks.md
cli.py         ``add_bench_parser`` / ``run_bench``

The standalone rigs (hicache, elastic, hybrid, replicas, kvstore bandwidth, tp, the soak) build on
these and live in benchmarks/ at the top of the repository.
"""
