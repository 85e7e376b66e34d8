"""``strata bench``: run the side-by-side comparisons, write JSON + PNG, update docs/benchmarks.md.

    strata bench                      everything, default sizes (~11 min on 2 CPU cores)
    strata bench --quick              small sizes, one repeat (a smoke run, ~3 min)
    strata bench --only cache --only stack --repeats 5
    strata bench --only servers       Strata HTTP vs `transformers serve` and HTTP vs gRPC (~5 min; runs
                                      alone, writes <out-dir>/servers.json, not part of the default run)
    strata bench --only servers --peer vllm --vllm-python /path/to/vllm-venv/bin/python
                                      Strata HTTP vs vLLM's CPU build (its own venv; default python:
                                      $STRATA_VLLM_PYTHON; without one the vLLM part is skipped) on
                                      the bench model and, for the control plane, the null model
                                      (~30 min on 2 cores; --vllm-workloads picks some of them);
                                      writes <out-dir>/servers_vllm.json

The default model is ``models/qwen3-bench``; a missing ``models/<arch>-bench`` is generated first.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.bench.vllm_serve import VLLM_WORKLOADS
from services.bench.workloads import AgentSpec, MultiTurnSpec, RandomSpec, SharedPrefixSpec

if TYPE_CHECKING:
    from services.bench.servers import VllmPeer

DEFAULT_MODEL = "models/qwen3-bench"
SECTION_NAMES = ("cache", "multi_turn", "stack", "overlap", "hf", "long_prefix", "prefill", "decode_floor", "profile",
                 "servers")

# Workload sizes: default and --quick. Explicit size flags override either.
DEFAULT: dict[str, Any] = {
    "random": RandomSpec(count=64, input_len=256, output_len=32),
    "shared": SharedPrefixSpec(groups=4, prompts_per_group=16, system_len=512, question_len=32, output_len=32),
    "multi": MultiTurnSpec(clients=8, rounds=4, request_len=64, output_len=32, max_parallel=8),
    "long_shared": SharedPrefixSpec(groups=4, prompts_per_group=16, system_len=2048, question_len=32, output_len=32),
}
QUICK: dict[str, Any] = {
    "random": RandomSpec(count=16, input_len=128, output_len=16),
    "shared": SharedPrefixSpec(groups=2, prompts_per_group=8, system_len=256, question_len=16, output_len=16),
    "multi": MultiTurnSpec(clients=4, rounds=3, request_len=32, output_len=16, max_parallel=4),
    "long_shared": SharedPrefixSpec(groups=2, prompts_per_group=4, system_len=512, question_len=16, output_len=8),
}
# --only servers with --quick (its default sizes are ServersConfig's and VllmPeer's).
SERVERS_QUICK: dict[str, Any] = {
    "shared": SharedPrefixSpec(groups=2, prompts_per_group=4, system_len=256, question_len=16, output_len=16),
    "random": RandomSpec(count=8, input_len=128, output_len=16),
    "overhead": SharedPrefixSpec(groups=4, prompts_per_group=16, system_len=256, question_len=16, output_len=16),
}
VLLM_QUICK: dict[str, Any] = {
    "shared": SharedPrefixSpec(groups=2, prompts_per_group=4, system_len=256, question_len=16, output_len=16),
    "random": RandomSpec(count=8, input_len=128, output_len=16),
    "agent": AgentSpec(conversations=2, turns=3, context_len=512, turn_len=64, output_len=16),
    "single": RandomSpec(count=1, input_len=128, output_len=32),
    "control": RandomSpec(count=64, input_len=32, output_len=64),
}
PEERS = ("transformers", "vllm", "both")
VLLM_PYTHON_ENV = "STRATA_VLLM_PYTHON"
_SIZE_FLAGS = {  # flag suffix -> (spec key, field)
    "random-count": ("random", "count"),
    "random-input-len": ("random", "input_len"),
    "random-output-len": ("random", "output_len"),
    "shared-groups": ("shared", "groups"),
    "shared-prompts-per-group": ("shared", "prompts_per_group"),
    "shared-system-len": ("shared", "system_len"),
    "shared-question-len": ("shared", "question_len"),
    "shared-output-len": ("shared", "output_len"),
    "multi-clients": ("multi", "clients"),
    "multi-rounds": ("multi", "rounds"),
    "multi-request-len": ("multi", "request_len"),
    "multi-output-len": ("multi", "output_len"),
    "multi-max-parallel": ("multi", "max_parallel"),
    "long-system-len": ("long_shared", "system_len"),
}


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns it."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="benchmarks: cache on/off, gRPC vs in-process, Strata vs transformers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="Hugging Face model directory")
    p.add_argument("--quick", action="store_true", help="small workloads and one repeat")
    p.add_argument(
        "--only",
        action="append",
        choices=SECTION_NAMES,
        default=None,
        help="run only this section (repeatable); default: all but servers",
    )
    p.add_argument("--skip", action="append", choices=SECTION_NAMES, default=[], help="skip this section")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight per run")
    p.add_argument("--repeats", type=int, default=None, help="alternating repeats per ratio (default 3, quick 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-bytes", type=int, default=384 << 20, help="KV pool of every engine")
    p.add_argument("--max-rows", type=int, default=64, help="worker rows = scheduler max running")
    p.add_argument("--max-prefill-tokens", type=int, default=2048, help="prefill budget per step")
    p.add_argument("--hf-batch-sizes", default="16,64",
                   help="batch sizes of transformers generate (comma-separated); the better run counts")
    p.add_argument("--prefill-lens", default=None, help="cold prompt lengths for TTFT (default 1024,4096; quick 256)")
    p.add_argument("--no-hf-continuous", action="store_true", help="skip transformers continuous batching")
    p.add_argument("--multi-rate", type=float, default=None, help="multi-turn requests/s (default: unbounded)")
    for flag, (_, field) in _SIZE_FLAGS.items():
        p.add_argument(f"--{flag}", type=int, default=None, dest=flag.replace("-", "_"), help=f"workload {field}")
    p.add_argument("--out-dir", default="docs/bench", help="where results.json and the PNGs go")
    p.add_argument("--doc", default="docs/benchmarks.md", help="page whose generated block is updated")
    p.add_argument("--no-doc", action="store_true", help="do not touch --doc")
    p.add_argument("--run-timeout-s", type=float, default=600.0, help="cut off a run after this long")
    p.add_argument("--run-dir", default="", help="logs of the gRPC stack (default: a temporary folder)")
    p.add_argument("--peer-args", default="", help="extra flags of `transformers serve` (servers section)")
    p.add_argument("--peer", choices=PEERS, default="transformers",
                   help="servers section: which peer(s) Strata HTTP is measured against (default transformers)")
    p.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV, ""),
                   help=f"python of vLLM's own venv (default ${VLLM_PYTHON_ENV}; none: the vLLM part is skipped)")
    p.add_argument("--null-model", default="models/qwen3-null",
                   help="the vLLM part's control-plane model (`strata model tiny --size null`)")
    p.add_argument("--vllm-args", default="", help="extra flags of vLLM's OpenAI server")
    p.add_argument("--vllm-workloads", default=",".join(VLLM_WORKLOADS),
                   help=f"the vLLM part's workloads, comma-separated (default: all of {', '.join(VLLM_WORKLOADS)})")
    return p


def _specs(args: argparse.Namespace, base: dict[str, Any] | None = None) -> dict[str, Any]:
    specs = dict(base if base is not None else (QUICK if args.quick else DEFAULT))
    for flag, (key, field) in _SIZE_FLAGS.items():
        value = getattr(args, flag.replace("-", "_"))
        if value is not None and key in specs:
            specs[key] = dataclasses.replace(specs[key], **{field: value})
    if args.multi_rate is not None and "multi" in specs:
        specs["multi"] = dataclasses.replace(specs["multi"], request_rate=args.multi_rate)
    return specs


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise SystemExit(f"strata bench: {flag} takes positive integers separated by commas, got {text!r}")
    return values


def _ensure_model(model: Path) -> Path:
    if (model / "config.json").exists():
        return model
    arch = model.name.removesuffix("-bench")
    if model.name.endswith("-bench") and arch in ("qwen3", "qwen3-next"):
        from services.worker.tiny import write_tiny_checkpoint

        print(f"generating the bench-size {arch} checkpoint into {model}", flush=True)
        return write_tiny_checkpoint(arch, "bench", model)  # type: ignore[arg-type]
    raise FileNotFoundError(f"{model} has no config.json; run `strata model tiny --size bench --out {model}`")


def machine_info(model: Path) -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "gpu": "none (no GPU was lent to this run)" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "params_m": round(weights / 4 / 1e6, 1),  # fp32 checkpoints
    }


def run_bench(args: argparse.Namespace) -> int:
    """Run the selected sections; write ``<out-dir>/results.json`` and PNGs and update ``--doc``.
    Returns 0 when the run completed (missed goals are reported, not failures), 2 on bad input."""
    from services.bench import report
    from services.bench.suite import SECTIONS, BenchConfig, Suite

    try:
        model = _ensure_model(Path(args.model))
    except FileNotFoundError as e:
        print(f"strata bench: {e}", file=sys.stderr)
        return 2
    if args.only is not None and "servers" in args.only:
        if set(args.only) != {"servers"}:
            print("strata bench: --only servers runs alone (it starts its own servers and writes servers.json)",
                  file=sys.stderr)
            return 2
        return _run_servers(args, model)
    chosen = [s for s in SECTIONS if (args.only is None or s in args.only) and s not in args.skip]
    specs = _specs(args)
    cfg = BenchConfig(
        model=model,
        sections=tuple(chosen),
        seed=args.seed,
        concurrency=args.concurrency,
        repeats=args.repeats if args.repeats is not None else (1 if args.quick else 3),
        kv_cache_bytes=args.kv_cache_bytes,
        max_rows=args.max_rows,
        max_prefill_tokens=args.max_prefill_tokens,
        hf_batch_sizes=_ints("--hf-batch-sizes", args.hf_batch_sizes),
        prefill_lens=_ints("--prefill-lens", args.prefill_lens or ("256" if args.quick else "1024,4096")),
        long_shared=specs["long_shared"],
        hf_continuous=not args.no_hf_continuous,
        random=specs["random"],
        shared=specs["shared"],
        multi=specs["multi"],
        run_dir=Path(args.run_dir) if args.run_dir else None,
        run_timeout_s=args.run_timeout_s,
    )
    t0 = time.perf_counter()
    print(f"strata bench: {model}, sections {', '.join(chosen)}", flush=True)
    results = Suite(cfg, machine_info(model), say=lambda line: print(line, flush=True)).run()
    results.machine["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    out = Path(args.out_dir)
    written = [report.write_json(results, out / "results.json"), *report.write_plots(results, out)]
    if not args.no_doc:
        doc = Path(args.doc)
        rel = os.path.relpath(out, doc.parent)
        written.append(report.update_doc(doc, report.markdown(results, plot_dir=rel)))
    for path in written:
        print(f"wrote {path}")
    missed = [c for c in results.comparisons if c.met is False]
    for c in missed:
        print(f"goal missed: {c.name}: {c.value:.3f} < {c.goal}")
    print(f"strata bench: done in {(time.perf_counter() - t0) / 60:.1f} min")
    return 0


def _run_servers(args: argparse.Namespace, model: Path) -> int:
    """The servers section (services/bench/servers.py): prints its tables, writes ``<out-dir>/servers.json``
    (``servers_vllm.json`` with ``--peer vllm``)."""
    from services.bench import report
    from services.bench.hf_serve import PeerError
    from services.bench.servers import ServersBench, ServersConfig, markdown, sides_json

    if args.peer != "transformers" and args.vllm_python and not Path(args.vllm_python).is_file():
        print(f"strata bench: --vllm-python {args.vllm_python}: no such file", file=sys.stderr)
        return 2
    vllm = _vllm_peer(args)
    if vllm is None and args.peer == "vllm":
        return 0  # skipped, and said so
    d = ServersConfig(model)
    specs = _specs(args, SERVERS_QUICK if args.quick else {"shared": d.shared, "random": d.random,
                                                          "overhead": d.overhead})
    cfg = ServersConfig(
        model=model,
        repeats=args.repeats if args.repeats is not None else (1 if args.quick else 3),
        concurrency=args.concurrency,
        seed=args.seed,
        shared=specs["shared"],
        random=specs["random"],
        overhead=specs["overhead"],
        kv_cache_bytes=args.kv_cache_bytes,
        max_rows=args.max_rows,
        max_prefill_tokens=args.max_prefill_tokens,
        run_dir=Path(args.run_dir) if args.run_dir else None,
        run_timeout_s=args.run_timeout_s,
        peer_args=tuple(shlex.split(args.peer_args)),
        transformers=args.peer != "vllm",
        vllm=vllm,
    )
    t0 = time.perf_counter()
    print(f"strata bench: {model}, section servers, peer {args.peer}", flush=True)
    bench = ServersBench(cfg, machine_info(model), say=lambda line: print(line, flush=True))
    measured = _git_state()  # at the start: the services run the tree as it was then
    try:
        results = bench.run()
    except PeerError as e:
        print(f"strata bench: {e}", file=sys.stderr)
        return 1
    results.machine["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    results.notes.append(measured)
    path = Path(args.out_dir) / ("servers_vllm.json" if args.peer == "vllm" else "servers.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**report.results_json(results), "sides": sides_json(bench.sides)}, indent=2) + "\n")
    print(markdown(results, bench.sides))
    print(f"wrote {path}")
    print(f"strata bench: done in {(time.perf_counter() - t0) / 60:.1f} min")
    return 0


def _git_state() -> str:
    """Which Strata is measured: the commit and the files changed since (others may be editing)."""
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = git("status", "--porcelain", "--untracked-files=no").splitlines()
    files = ", ".join(line[3:] for line in dirty) or "none"
    return f"Strata at commit {git('rev-parse', '--short', 'HEAD') or '?'}; uncommitted changes in: {files}"


def _vllm_peer(args: argparse.Namespace) -> VllmPeer | None:
    """The vLLM part's config; None when it does not run: ``--peer transformers``, or no python
    given (then it says it skips the part)."""
    from services.bench.servers import VllmPeer

    if args.peer == "transformers":
        return None
    if not args.vllm_python:
        print(f"strata bench: vLLM part skipped: no vLLM python given (--vllm-python PATH or ${VLLM_PYTHON_ENV}; "
              "vLLM runs from its own venv, never Strata's)", flush=True)  # fmt: skip
        return None
    python = Path(args.vllm_python)
    d = VllmPeer(python)
    specs = _specs(args, VLLM_QUICK if args.quick else {"shared": d.shared, "random": d.random, "agent": d.agent,
                                                        "single": d.single, "control": d.control})
    workloads = tuple(w for w in args.vllm_workloads.split(",") if w)
    unknown = sorted(set(workloads) - set(VLLM_WORKLOADS))
    if unknown or not workloads:
        raise SystemExit(f"strata bench: --vllm-workloads: {', '.join(unknown) or 'none given'}; "
                         f"choose from {', '.join(VLLM_WORKLOADS)}")  # fmt: skip
    return VllmPeer(
        python=python, null_model=Path(args.null_model), shared=specs["shared"], random=specs["random"],
        agent=specs["agent"], single=specs["single"], control=specs["control"],
        args=tuple(shlex.split(args.vllm_args)), workloads=workloads,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m services.bench.cli``) until ``strata bench`` is wired."""
    parser = argparse.ArgumentParser(prog="strata")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    return run_bench(parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
