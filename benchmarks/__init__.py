"""Standalone benchmark rigs, beside the product (``strata bench``, the load generator, is services/bench).

Each rig is run from the repository root as ``python -m benchmarks.<name>`` (or by its make target),
writes JSON to ``--out`` (a file under docs/bench/ by default) and prints the markdown table it
feeds to docs/benchmarks.md:

hicache.py        TTFT recomputed vs from the device, the host pool and L3 (make bench-hicache)
hicache_rig.py    what hicache.py stands on: pool sizes for a model, a kvstore server process
hicache_tiers.py  forcing and proving the tier a hicache.py request is served from
hicache_soak.py   the hierarchical-cache soak: RSS of every service under L3 load (make soak-hicache)
chaos.py          kills and freezes under load: lost / wrong requests, resume latency, RSS slopes
                  (make chaos-short, make chaos; with chaos_load.py, chaos_report.py, chaos_stats.py)
elastic.py        elastic KV + Mamba pools vs static splits of one budget (make bench-elastic)
hybrid.py         hybrid vs dense prefix reuse, Marconi vs LRU state eviction (make bench-hybrid)
replicas.py       KV-aware routing vs round-robin vs least-load over replicas (make bench-replicas)
kvstore_bw.py     kvstore put / get GB/s through real server processes (make bench-kvstore)
tp.py             step time at TP 1 vs TP 2, bytes all-reduced per token (make bench-tp)
gpu_check.py      the GPU check of a lent machine: tests on cuda, kernels, VMM, step, control (make gpu-check)
gpu_step.py       engine step times on a GPU and the attention kernels' bandwidth vs the copy rate

The older micro-benchmarks (attention_micro.py, host_cache_copy.py, radix_micro.py, overhead.py)
run as scripts: ``python benchmarks/<name>.py``.
"""
