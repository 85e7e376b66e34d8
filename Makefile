# Strata — the two commands a person needs are `make run` and `make test`; both set everything up.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODELS := models
TINY := $(MODELS)/qwen3-tiny
TINY_NEXT := $(MODELS)/qwen3-next-tiny
BENCH_MODEL := $(MODELS)/qwen3-bench
BENCH_NEXT := $(MODELS)/qwen3-next-bench
NULL_MODEL := $(MODELS)/qwen3-null
PROTO_SRC := $(shell find protos -name '*.proto')
PROTO_STAMP := strata/.generated
PORT ?= 50051

.PHONY: chaos chaos-long-lived chaos-short fuzz native bench-attention gpu-check gpu-wheels run bytecode test test-unit test-engine test-services test-all soak bench bench-servers bench-vllm bench-hybrid bench-elastic bench-kvstore bench-hicache bench-hicache-hybrid bench-replicas bench-tp bench-overhead bench-spec bench-spec-draft bench-spec-mtp bench-pd bench-clients eval soak-hicache soak-text compose-certs lint protos install system-deps models clean

run: install models
	$(BIN)/strata up --model $(TINY) --port $(PORT)

# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them (module
# fixtures are shared within a file). Run alone, a test process keeps one core busy about half the time (its
# own torch uses one thread; the services it starts wait on each other); two keep both cores busy. Every
# torch in the run, the services' workers included, uses one thread (OMP_NUM_THREADS=1): two-thread workers
# of two tests at once would preempt each other's OpenMP threads mid-step. A `--threads` or `--cpus` flag
# in a test still wins. TEST_WORKERS=0: one process, as plain `pytest` runs.
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: install models bytecode
	$(PYTEST) --durations=25

# Our modules' bytecode, written once before a run: where PYTHONDONTWRITEBYTECODE is set (it is on these
# machines) nothing else writes it, and every service process the suite starts (hundreds) would compile
# services/ from source again (~0.3 s of CPU each).
bytecode: install
	@$(BIN)/python -m compileall -q -j 0 services kernels strata benchmarks tests > /dev/null

# One tier of the suite each: tests/unit (one piece alone, under a minute), tests/engine (the model, engine and
# scheduler loop in-process, against transformers), tests/services (real processes, servers, etcd).
# `make test` runs all three.
test-unit: install models bytecode
	$(PYTEST) tests/unit

test-engine: install models bytecode
	$(PYTEST) tests/engine

test-services: install models bytecode
	$(PYTEST) tests/services

# Everything, the slow soak and benchmark runs included.
test-all: install models
	$(BIN)/python -m pytest -q -m ''

soak: install models
	$(BIN)/python -m pytest -q -m slow

# The public-API fuzzer at length (make test runs 60 cases of each kind).
fuzz: install models
	STRATA_FUZZ_EXAMPLES=2000 $(BIN)/python -m pytest -q tests/services/test_fuzz_api.py

# Side-by-side benchmarks on the bench-size model (~10-15 min on 2 cores); writes docs/bench/ and docs/benchmarks.md.
bench: install models $(BENCH_MODEL)/config.json
	$(BIN)/strata bench --model $(BENCH_MODEL) --run-dir .runs/bench

# Strata's OpenAI HTTP front vs `transformers serve --continuous-batching` on the same checkpoint
# (shared-prefix and random workloads, 3 alternated repeats) and Strata HTTP vs gRPC at concurrency
# 64 (~5 min on 2 cores); installs the bench extra, writes docs/bench/servers.json, prints the tables.
bench-servers: install $(BENCH_MODEL)/config.json
	@$(BIN)/python -c 'import accelerate' 2>/dev/null || $(BIN)/pip install -q --disable-pip-version-check \
	  -c constraints.txt -e '.[bench]' --config-settings editable_mode=compat
	$(BIN)/strata bench --only servers --model $(BENCH_MODEL) --run-dir .runs/bench-servers

# Strata HTTP vs vLLM's CPU build, token ids on both sides, 3 alternated repeats: shared prefix, random,
# a long agent context and one stream on the bench model, then the control plane (256 streams x 256
# tokens) on the null model (~10 min on 2 cores; VLLM_WORKLOADS=agent,single runs some of them). vLLM
# runs from its own venv, never this one: VLLM_PYTHON (default $STRATA_VLLM_PYTHON) is its python;
# without one the part is skipped. Writes docs/bench/servers_vllm.json and prints the tables.
VLLM_PYTHON ?= $(STRATA_VLLM_PYTHON)
VLLM_WORKLOADS ?= shared,random,agent,single,control
bench-vllm: install $(BENCH_MODEL)/config.json $(NULL_MODEL)/config.json
	$(BIN)/strata bench --only servers --peer vllm --vllm-python "$(VLLM_PYTHON)" --model $(BENCH_MODEL) \
	  --null-model $(NULL_MODEL) --vllm-workloads "$(VLLM_WORKLOADS)" --run-dir .runs/bench-vllm

# lm-evaluation-harness (issue #28): its `local-completions` model against a Strata stack vs its `hf` backend
# on the tiny checkpoint, a loglikelihood task over a committed jsonl (benchmarks/lm_eval/, nothing downloaded);
# fails unless every loglikelihood agrees within 1e-4 (~30 s; installs the eval extra). Writes docs/bench/lm_eval.json.
eval: install models
	@$(BIN)/python -c 'import lm_eval' 2>/dev/null || $(BIN)/pip install -q --disable-pip-version-check \
	  -c constraints.txt -e '.[eval]' --config-settings editable_mode=compat
	$(BIN)/python -m benchmarks.lm_eval_compare --model $(TINY) --out docs/bench/lm_eval.json

# An OpenAI-compatible load generator against Strata (issue #28): GuideLLM GUIDELLM_VERSION, from its own venv
# (GUIDELLM_VENV, made here with the same CPU torch wheel as .venv; never this one), on a Strata stack of the
# bench model (its worker on one torch thread: the client shares the cores): /v1/completions streamed, 256-token synthetic prompts -> 64 tokens at concurrency 1, 4 and 16,
# 45 s each (~3 min; not in `make test`). Writes GuideLLM's raw report docs/bench/guidellm.json and
# docs/bench/clients.json, prints the table of docs/benchmarks.md.
GUIDELLM_VERSION := 0.8.1
GUIDELLM_VENV ?= .venv-guidellm
bench-clients: install $(BENCH_MODEL)/config.json $(GUIDELLM_VENV)/.guidellm-$(GUIDELLM_VERSION)
	$(BIN)/python -m benchmarks.clients --model $(BENCH_MODEL) --guidellm $(GUIDELLM_VENV)/bin/guidellm \
	  --run-dir .runs/bench-clients

$(GUIDELLM_VENV)/.guidellm-$(GUIDELLM_VERSION):
	test -x $(GUIDELLM_VENV)/bin/python || $(PY) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0 guidellm==$(GUIDELLM_VERSION)
	touch $@

$(BENCH_MODEL)/config.json: | install
	$(BIN)/strata model tiny --arch qwen3 --size bench --out $(BENCH_MODEL)

# Hybrid (Qwen3-Next) vs dense prefix reuse on a multi-turn trace, and Marconi vs LRU state
# eviction (~5 min); writes docs/bench/hybrid.json and prints the table of docs/benchmarks.md.
bench-hybrid: install $(BENCH_MODEL)/config.json $(BENCH_NEXT)/config.json
	$(BIN)/python -m benchmarks.hybrid --dense $(BENCH_MODEL) --hybrid $(BENCH_NEXT)

# Elastic KV + Mamba pools vs static splits of one budget on a phase-changing load (~3 min);
# writes docs/bench/elastic.json and prints the table of docs/benchmarks.md.
bench-elastic: install $(BENCH_NEXT)/config.json
	$(BIN)/python -m benchmarks.elastic --model $(BENCH_NEXT) --repeats 7

$(BENCH_NEXT)/config.json: | install
	$(BIN)/strata model tiny --arch qwen3-next --size bench --out $(BENCH_NEXT)

# kvstore put / get GB/s through real server processes (memory and file backends, 1 and 2 shards)
# against a memcpy of the same bytes (~20 s); writes docs/bench/kvstore.json and prints the table.
bench-kvstore: install
	$(BIN)/python -m benchmarks.kvstore_bw

# The hierarchical-cache soak at full size for an hour, dense and hybrid at once (24 clients x 12
# rounds x 2,048-token requests, L3 on, one worker thread each): RSS of every service, the worker's
# memory by owner, slopes over the last half; writes docs/bench/hicache_soak{,_hybrid}.{json,png}.
soak-hicache: install models
	$(BIN)/python -m benchmarks.hicache_soak --model $(TINY) --minutes 60 --worker-threads 1 \
	  --run-dir .runs/soak-dense --out docs/bench/hicache_soak.json --plot docs/bench/hicache_soak.png & \
	$(BIN)/python -m benchmarks.hicache_soak --model $(TINY_NEXT) --minutes 60 --worker-threads 1 \
	  --run-dir .runs/soak-hybrid --out docs/bench/hicache_soak_hybrid.json --plot docs/bench/hicache_soak_hybrid.png; \
	  s=$$?; wait $$!; d=$$?; exit $$((s | d))

# TTFT of a long prompt recomputed vs from the device, the host pool and L3 (a kvstore process) at
# 1k/2k/4k tokens (~1 min on 2 cores); writes docs/bench/hicache.json and prints the table of docs/benchmarks.md.
bench-hicache: install $(BENCH_MODEL)/config.json
	$(BIN)/python -m benchmarks.hicache --model $(BENCH_MODEL)

# Prefill/decode disaggregation (issue #31): decode ITL under long prompts, PD (1 + 1) through the
# kvstore and directly (outbox) vs two co-located replicas, alternated (~12 min on 2 cores); writes
# docs/bench/pd.json. PD_PIN="0;1" gives each replica's worker a core of its own (docs/bench/pd_pinned.json);
# PD_THREADS="0;1" the decode replica's worker one forward thread, unpinned (docs/bench/pd_threads.json).
PD_PIN ?=
PD_THREADS ?=
bench-pd: install $(BENCH_MODEL)/config.json
	$(BIN)/python -m benchmarks.pd --model $(BENCH_MODEL) $(if $(PD_PIN),--pin "$(PD_PIN)" --out docs/bench/pd_pinned.json,$(if $(PD_THREADS),--threads "$(PD_THREADS)" --out docs/bench/pd_threads.json,--out docs/bench/pd.json))

# Attention paths (reference, flat, cascade; gathered or native) on the bench model's shapes against
# the floor measured in the same run (~1 min); prints a table.
bench-attention: install
	$(BIN)/python benchmarks/attention_micro.py

bench-hicache-hybrid: install $(BENCH_NEXT)/config.json
	$(BIN)/python -m benchmarks.hicache --model $(BENCH_NEXT)

# 4 replicas: kv vs round_robin vs least_load routing (and round_robin + shared L3) on multi-turn and shared-prefix traces, plus router cost (~8 min on 2 cores); writes docs/bench/replicas.json.
bench-replicas: install $(BENCH_MODEL)/config.json
	$(BIN)/python -m benchmarks.replicas --model $(BENCH_MODEL) --run-dir .runs/bench-replicas

# The tokenizer's text path for an hour (issue #18): the L3 soak's load as chat messages of words,
# 16 detokenized tokens per answer; writes docs/bench/text_soak.{json,png}.
soak-text: install models
	$(BIN)/python -m benchmarks.hicache_soak --model $(TINY) --minutes 60 --worker-threads 1 --text \
	  --max-new-tokens 16 --request-tokens 1024 --run-dir .runs/soak-text --out docs/bench/text_soak.json \
	  --plot docs/bench/text_soak.png

# The chaos run of issue #29: `strata up --replicas 2 --restart on-failure` (L3 on) under steady greedy load on
# both fronts (gRPC and the OpenAI HTTP API) while every 30 s one of worker, scheduler, tokenizer, kvstore, etcd
# is SIGKILLed or SIGSTOPped for 10 s; counts lost, duplicated and wrong requests against transformers, resume
# latency, every service's RSS slope. `chaos` is the hour, `chaos-short` 5 minutes (~7 min in all); neither is in
# `make test`. Writes docs/bench/chaos{,_short}.{json,png} and prints the tables of docs/reliability.md.
chaos: install models
	$(BIN)/python -m benchmarks.chaos --model $(TINY) --minutes 60 --warmup-s 60 --run-dir .runs/chaos \
	  --out docs/bench/chaos.json --plot docs/bench/chaos.png

# The hour again, with only replica 0's worker and scheduler ever killed: replica 1, the tokenizer,
# the kvstore and etcd are SIGSTOPped where they would be killed, so they live the hour and their
# RSS slopes span it (issue #29).
chaos-long-lived: install models
	$(BIN)/python -m benchmarks.chaos --model $(TINY) --minutes 60 --warmup-s 60 --run-dir .runs/chaos-long-lived \
	  --spare worker-1,scheduler-1,tokenizer,kvstore,etcd \
	  --out docs/bench/chaos_long_lived.json --plot docs/bench/chaos_long_lived.png

chaos-short: install models
	$(BIN)/python -m benchmarks.chaos --model $(TINY) --minutes 5 --run-dir .runs/chaos-short \
	  --out docs/bench/chaos_short.json --plot docs/bench/chaos_short.png

# Tensor parallelism: step time TP 1 vs TP 2 (gloo, 2 cores) and bytes all-reduced per decode
# token (~2 min); writes docs/bench/tp.json and prints the table of docs/benchmarks.md.
bench-tp: install $(BENCH_MODEL)/config.json
	$(BIN)/python -m benchmarks.tp --model $(BENCH_MODEL) --repeats 5

# The control plane's CPU per output token (issue #26): 256 greedy streams x 256 tokens on a one-layer
# near-null model through the gRPC and HTTP fronts, alternated, 3 repeats, plus one py-spy profile
# per front (~3 min); writes docs/bench/overhead.json and prints the table of docs/benchmarks.md.
# Speculative decoding (issue #27): off / on / forced stacks of the bench model, alternated, at batch
# 1, 8 and 64 on a repetitive (edit-style) and a random workload, 3 repeats (~10 min); TPOT, tok/s,
# acceptance and CPU per token; writes docs/bench/spec.json and prints the table of docs/benchmarks.md.
bench-spec: install $(BENCH_MODEL)/config.json
	$(BIN)/python -m benchmarks.spec --model $(BENCH_MODEL) --repeats 3 --out docs/bench/spec.json

# Draft-model speculation on a constructed pair (benchmarks/draft_pair.py: a 16-layer target whose
# 1-layer draft agrees on ~0.84 of its greedy tokens at DRAFT_SCALE 0.015, ~0.71 at 0.025): off
# against draft at batch 1, 8 and 64.
DRAFT_SCALE ?= 0.015
bench-spec-draft: install $(BENCH_MODEL)/config.json
	$(BIN)/python -m benchmarks.draft_pair --source $(BENCH_MODEL) --target models/qwen3-bench-target --draft models/qwen3-bench-draft --scale $(DRAFT_SCALE)
	$(BIN)/python -m benchmarks.spec --model models/qwen3-bench-target --draft-model models/qwen3-bench-draft --sides off,draft --workloads random --repeats 3 --out docs/bench/spec_draft_$(DRAFT_SCALE).json

# MTP speculation on a constructed Qwen3-Next (benchmarks/draft_pair.py --mtp: 16 layers whose own MTP head
# keeps ~0.57 of its drafts served at MTP_SCALE 0.002, ~0.75 at 0.001): off against mtp at batch 1, 8 and 64.
MTP_SCALE ?= 0.001
bench-spec-mtp: install $(BENCH_NEXT)/config.json
	$(BIN)/python -m benchmarks.draft_pair --mtp --source $(BENCH_NEXT) --target models/qwen3-next-bench-mtp --scale $(MTP_SCALE)
	$(BIN)/python -m benchmarks.spec --model models/qwen3-next-bench-mtp --sides off,mtp --workloads random --repeats 3 --out docs/bench/spec_mtp_$(MTP_SCALE).json

bench-overhead: install $(NULL_MODEL)/config.json
	@test -x $(BIN)/py-spy || $(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[bench]' --config-settings editable_mode=compat
	$(BIN)/python benchmarks/overhead.py --model $(NULL_MODEL) --repeats 3 --out docs/bench/overhead.json --profile .runs/overhead-profile
	$(BIN)/python benchmarks/front_floor.py --repeats 3

$(NULL_MODEL)/config.json: | install
	$(BIN)/strata model tiny --arch qwen3 --size null --out $(NULL_MODEL)

# The GPU check of issue #32 (scripts/gpu_check.sh -> benchmarks/gpu_check.py): the engine against
# transformers on cuda, the Triton kernels compiled, the CUDA VMM pool, step times and the control
# plane on a lent GPU, in one device-tool call after `make gpu-wheels` (see "GPU" in docs/benchmarks.md).
# Here, without a GPU, it is the same driver's CPU dry run (~20 s; make test runs it too).
gpu-check: install models
	bash scripts/gpu_check.sh

# The wheels (and the etcd binary) a lent GPU machine lacks, into .whl/ for the device tool to carry (~37 MiB).
gpu-wheels: install system-deps
	PY=$(BIN)/python bash scripts/gpu_wheels.sh

# Development certificates for compose.tls.yaml (a CA and one certificate for every service name).
COMPOSE_HOSTS := etcd kvstore worker worker-1 scheduler scheduler-1 tokenizer localhost 127.0.0.1
compose-certs: install
	$(BIN)/strata cert --out tls $(foreach h,$(COMPOSE_HOSTS),--host $(h))

lint: install
	$(BIN)/ruff check services kernels benchmarks tests
	$(BIN)/mypy

install: system-deps $(STAMP) $(PROTO_STAMP) native

# The native CPU kernels (kernels/csrc, built with cc into kernels/_build; the torch path is used where this fails).
native: $(STAMP)
	@$(BIN)/python -m kernels.native

# Debian packages: a real etcd server, and docker-compose to validate compose.yaml offline.
system-deps:
	@if ! command -v etcd >/dev/null || ! command -v docker-compose >/dev/null; then \
	  echo ">> installing Debian packages etcd-server docker-compose"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq etcd-server docker-compose >/dev/null; \
	fi

$(STAMP): pyproject.toml constraints.txt
	@echo ">> creating $(VENV) and installing pinned packages"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]' --config-settings editable_mode=compat
	touch $@

protos: $(PROTO_STAMP)

$(PROTO_STAMP): $(PROTO_SRC) $(STAMP)
	@echo ">> generating protobuf code into strata/"
	rm -rf strata && mkdir -p strata
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)
	touch $@

models: $(TINY)/config.json $(TINY_NEXT)/config.json

$(TINY)/config.json: | install
	$(BIN)/strata model tiny --arch qwen3 --size tiny --out $(TINY)

$(TINY_NEXT)/config.json: | install
	$(BIN)/strata model tiny --arch qwen3-next --size tiny --out $(TINY_NEXT)

clean:
	rm -rf strata .mypy_cache .ruff_cache .pytest_cache
