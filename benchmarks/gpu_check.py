"""The GPU path run for real on a lent machine, in one call (issue #32).

    bash scripts/gpu_check.sh                      # on the lent machine: see "GPU" in docs/benchmarks.md
    python -m benchmarks.gpu_check --dry-run       # here, on the CPU at toy sizes (make gpu-check, make test)

Phases, each in child processes with its own time limit inside one budget (``--budget-s``, 540 s by
default: with the wheels' install the whole call fits the device tool's 10-minute command):

1. ``env``      the device (name, memory, SMs, capability), library versions, CUDA VMM availability;
2. ``models``   the checkpoints (``strata model tiny``): tiny Qwen3 and Qwen3-Next (the tests), bench
                and 0.6b (the step benchmark), null (the control plane), generated side by side;
3. ``kernels``  tests/engine/test_kernels_triton.py and test_fused_triton.py: every Triton kernel
                compiled for the device against its torch reference (no interpreter), and compiled
                for sm_90; the layers' use of the elementwise kernels on the device;
4. ``elastic``  tests/unit/test_elastic.py (the CUDA VMM pool reserved once, grown and shrunk in place)
                and tests/engine/test_elastic_loop.py (elastic pools under the scheduler loop);
5. ``engine``   the engine against transformers on the device: test_engine_device.py (fp32 and bf16,
                every cache path, both architectures, every attention path), test_engine_qwen3.py,
                test_qwen3_next.py, the scheduler loop over it (test_scheduler_e2e.py,
                test_hybrid_cache.py), decode steps replayed from CUDA graphs
                (test_cuda_graphs.py), and speculation (test_speculative.py, test_speculative_mtp.py);
6. ``step``     benchmarks/gpu_step.py on the bench and 0.6b models in bf16: prefill 4k, decode at
                batch 1 / 64 / 256, the attention kernels' bandwidth against the copy rate;
7. ``control``  benchmarks/overhead.py: 256 streams × 256 tokens on the null model, the worker on the
                device, the gRPC and HTTP fronts, one repeat: the control plane's tokens/s; with
                ``--control 1x4,2x4``, one run per tokenizer front processes × client processes.

The test phases run pytest with ``STRATA_TEST_DEVICE`` set to the device (tests/device.py).
``--out`` (JSON: the device, every phase's status and time, tests passed / failed / skipped with the
names of the failures, the figures) is rewritten after every phase, so a run cut short still leaves
what it measured; ``--log`` gets every command and the tail of its output. Exit status 0 when every
phase ran and no test failed.

``--dry-run``: on the CPU with the tiny checkpoint: each test phase collects its whole selection (a
test file that no longer imports fails the dry run) and runs one cheap test of it, ``step`` runs at
toy sizes, ``control`` only checks that the rig starts (``--help``) and records its command.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Each test phase: the files it runs on the device, and (dry run) the one cheap test it runs on the CPU.
TEST_PHASES: dict[str, tuple[tuple[str, ...], str]] = {
    "kernels": (("tests/engine/test_kernels_triton.py", "tests/engine/test_fused_triton.py"), "bitmask"),
    "elastic": (("tests/unit/test_elastic.py", "tests/engine/test_elastic_loop.py"), "errors_are_precise"),
    "engine": (
        (
            "tests/engine/test_engine_device.py",
            "tests/engine/test_engine_qwen3.py",
            "tests/engine/test_qwen3_next.py",
            "tests/engine/test_scheduler_e2e.py",
            "tests/engine/test_hybrid_cache.py",
            "tests/engine/test_cuda_graphs.py",
            "tests/engine/test_speculative.py",
            "tests/engine/test_speculative_mtp.py",
        ),
        "qwen3-float32-cascade-cold_prefill",
    ),
}
VMM_TEST = "test_cuda_vmm_pool_grows_shrinks_in_place"
# (arch, size, directory under --models): what the phases after ``models`` need.
MODELS = (
    ("qwen3", "tiny", "qwen3-tiny"),
    ("qwen3-next", "tiny", "qwen3-next-tiny"),
    ("qwen3", "null", "qwen3-null"),
    ("qwen3", "bench", "qwen3-bench"),
    ("qwen3", "0.6b", "qwen3-0.6b"),
)
DRY_MODELS = ("qwen3-tiny", "qwen3-next-tiny")
STEP_MODELS = ("qwen3-bench", "qwen3-0.6b")
# The checkpoints each phase after ``models`` reads: ``models`` writes only those of the phases chosen.
PHASE_MODELS = {"kernels": DRY_MODELS, "elastic": DRY_MODELS, "engine": DRY_MODELS, "step": STEP_MODELS,
                "control": ("qwen3-null",)}  # fmt: skip
# Test processes on a device (pytest-xdist, where installed): the tests are small and each waits on
# its CPU reference (transformers in fp32) as much as on the device.
TEST_WORKERS = 6
DRY_STEP_ARGS = ("--dtype", "bfloat16", "--batches", "1,2", "--context", "16", "--prefill", "32", "--steps", "2",
                 "--warmup", "1", "--repeats", "1", "--attn-batches", "2", "--attn-context", "32",
                 "--cascade-batch", "16", "--copy-mib", "8")  # fmt: skip
CONTROL_ARGS = ("--streams", "256", "--tokens", "256", "--repeats", "1")
LOG_TAIL = 64 << 10  # characters of each command's output kept in --log
RESERVE_S = 5.0  # kept back from each phase's limit for writing the results
GRACE_S = 15.0  # between the interrupt at a command's time limit and its kill


@dataclass(frozen=True, slots=True)
class Config:
    device: str
    dry_run: bool
    out: Path
    log: Path
    work: Path  # scratch: junit files, intermediate JSON, the services' logs
    models: Path
    budget_s: float
    only: tuple[str, ...]
    rev: str
    # the control phase: one overhead.py run per (front processes, client processes), in turn
    control: tuple[tuple[int, int], ...] = ((1, 1),)


@dataclass(slots=True)
class Outcome:
    rc: int | None  # None: killed at its time limit
    output: str
    seconds: float


@dataclass(slots=True)
class Run:
    """The results so far, the budget, and the log."""

    cfg: Config
    started: float = field(default_factory=time.monotonic)
    result: dict[str, Any] = field(default_factory=dict)

    def remaining(self) -> float:
        return self.cfg.budget_s - (time.monotonic() - self.started)

    def log(self, text: str) -> None:
        with self.cfg.log.open("a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def command(self, cmd: list[str], limit: float, env: dict[str, str] | None = None) -> Outcome:
        """Run ``cmd`` from the repository root; its whole process group is interrupted ``GRACE_S``
        before ``limit`` seconds and killed at ``limit``."""
        self.log(f"$ {' '.join(cmd)}   (limit {limit:.0f}s)")
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=max(limit - GRACE_S, 1.0))
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            # SIGINT first: pytest then ends the session and still writes its junit file for the
            # tests that ran; whatever is left after the grace period is killed.
            os.killpg(proc.pid, signal.SIGINT)
            try:
                output, _ = proc.communicate(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
            rc = None
        seconds = time.monotonic() - t0
        self.log(output[-LOG_TAIL:])
        self.log(f"-> {'killed at its time limit' if rc is None else f'exit {rc}'} after {seconds:.1f}s\n")
        return Outcome(rc, output, seconds)

    def write(self) -> None:
        self.result["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.cfg.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cfg.out.with_name(self.cfg.out.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1) + "\n")
        tmp.replace(self.cfg.out)


def _python() -> list[str]:
    return [sys.executable]


def _test_env(cfg: Config) -> dict[str, str]:
    env = {**os.environ, "STRATA_TEST_DEVICE": cfg.device, "PYTHONUNBUFFERED": "1"}
    if not cfg.dry_run:  # TEST_WORKERS processes share the host's cores for their CPU references
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // TEST_WORKERS)))
    return env


# --- phases ---------------------------------------------------------------------------------------


def probe_env(device: str) -> dict[str, Any]:
    """What the machine is (run in a child: ``--probe-env``)."""
    import importlib.metadata as md
    import platform

    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(), "device": device}
    versions: dict[str, str | None] = {}
    for dist in ("torch", "triton", "transformers", "tokenizers", "safetensors", "grpcio", "protobuf", "xgrammar",
                 "numpy", "cuda-bindings", "cuda-python", "pytest"):  # fmt: skip
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    out["versions"] = versions
    if device.startswith("cuda"):
        from services.worker import cuda_vmm

        p = torch.cuda.get_device_properties(torch.device(device))
        out |= {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count,
                "capability": f"{p.major}.{p.minor}", "cuda": torch.version.cuda,
                "cuda_vmm": cuda_vmm.available().reason}  # fmt: skip
    else:
        out |= {"name": "cpu", "threads": torch.get_num_threads()}
    return out


def phase_env(run: Run) -> dict[str, Any]:
    o = run.command([*_python(), "-m", "benchmarks.gpu_check", "--probe-env", "--device", run.cfg.device],
                    min(60.0, run.remaining()))  # fmt: skip
    if o.rc != 0:
        return {"status": "timeout" if o.rc is None else "failed", "seconds": round(o.seconds, 1)}
    # The probe prints one JSON line; a library may have warned on the same stream.
    run.result["device"] = json.loads(next(ln for ln in reversed(o.output.splitlines()) if ln.startswith("{")))
    return {"status": "ok", "seconds": round(o.seconds, 1)}


def phase_models(run: Run, limit: float) -> dict[str, Any]:
    """Write the missing checkpoints, all at once (each is a few seconds to ~20 s of one core)."""
    needed = {m for name, models in PHASE_MODELS.items() if not run.cfg.only or name in run.cfg.only for m in models}
    wanted = [m for m in MODELS if m[2] in (DRY_MODELS if run.cfg.dry_run else needed)]
    missing = [m for m in wanted if not (run.cfg.models / m[2] / "config.json").exists()]
    t0 = time.monotonic()
    procs = []
    for arch, size, name in missing:
        cmd = [*_python(), "-m", "services.cli", "model", "tiny", "--arch", arch, "--size", size,
               "--out", str(run.cfg.models / name)]  # fmt: skip
        run.log(f"$ {' '.join(cmd)}")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))  # fmt: skip
    failed = []
    for (_, _, name), proc in zip(missing, procs, strict=True):
        try:
            output, _ = proc.communicate(timeout=max(1.0, limit - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        run.log(output[-LOG_TAIL:])
        if proc.returncode != 0:
            failed.append(name)
    return {"status": "failed" if failed else "ok", "seconds": round(time.monotonic() - t0, 1),
            "generated": [m[2] for m in missing], "failed": failed}  # fmt: skip


def junit_counts(path: Path) -> dict[str, Any]:
    """Passed / failed / errors / skipped from a pytest junit file, with the failures' and skips' names."""
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
            continue
        message = (outcome.get("message") or "").strip().splitlines()
        entry = {"test": name, "message": message[0][:300] if message else ""}
        kind = {"failure": "failed", "error": "errors", "skipped": "skipped"}[outcome.tag]
        counts[kind] += 1
        counts["skips" if kind == "skipped" else "failures"].append(entry)
    return counts


def case_outcome(path: Path, test: str) -> str:
    """How test function ``test`` ended in a junit file: passed, skipped / failed with the message, or absent."""
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.get("name") == test:
            outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            if outcome is None:
                return "passed"
            return f"{'skipped' if outcome.tag == 'skipped' else 'failed'}: {outcome.get('message', '')[:300]}"
    return "absent"


def phase_tests(run: Run, name: str, limit: float) -> dict[str, Any]:
    files, dry_k = TEST_PHASES[name]
    junit = run.cfg.work / f"{name}.xml"
    junit.unlink(missing_ok=True)
    # No phase's files use hypothesis; its pytest plugin alone costs each phase ~3 s of start-up.
    cmd = [*_python(), "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
           f"--junitxml={junit}", *files]  # fmt: skip
    if run.cfg.dry_run:
        cmd += ["-k", dry_k]
    elif importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(TEST_WORKERS)]
    o = run.command(cmd, limit, _test_env(run.cfg))
    info: dict[str, Any] = {"seconds": round(o.seconds, 1), "files": list(files)}
    if not junit.exists():
        return info | {"status": "timeout" if o.rc is None else "failed", "rc": o.rc}
    info["tests"] = junit_counts(junit)
    deselected = re.search(r"(\d+) deselected", o.output)
    if deselected:  # the dry run: the rest of the selection was collected, then left out
        info["deselected"] = int(deselected.group(1))
    # pytest: 0 all passed, 1 some failed; anything else (usage, collection, internal error) is the phase's.
    status = "ok" if o.rc in (0, 1) else "timeout" if o.rc is None else "failed"
    if name == "elastic" and not run.cfg.dry_run:  # skipped would mean no VMM: say so, not just "ok"
        info["cuda_vmm_test"] = case_outcome(junit, VMM_TEST)
    return info | {"status": status, "rc": o.rc}


def phase_step(run: Run, limit: float) -> dict[str, Any]:
    out = run.cfg.work / "step.json"
    out.unlink(missing_ok=True)
    models = ("qwen3-tiny",) if run.cfg.dry_run else STEP_MODELS
    cmd = [*_python(), "-m", "benchmarks.gpu_step", "--device", run.cfg.device, "--out", str(out)]
    for m in models:
        cmd += ["--model", str(run.cfg.models / m)]
    if run.cfg.dry_run:
        cmd += list(DRY_STEP_ARGS)
    o = run.command(cmd, limit)
    if o.rc != 0 or not out.exists():
        return {"status": "timeout" if o.rc is None else "failed", "seconds": round(o.seconds, 1), "rc": o.rc}
    step = json.loads(out.read_text())
    run.result["figures"]["step"] = step
    goal = step["flat_decode_goal"]
    flat = {name: {str(k["batch"]): round(k["fraction_of_copy"], 3) for k in m["attention"] if k["kernel"] == "decode"}
            for name, m in step["models"].items()}  # fmt: skip
    run.result["figures"]["flat_decode_fraction_of_copy"] = flat
    met = all(f >= goal for m in flat.values() for f in m.values())
    return {"status": "ok", "seconds": round(o.seconds, 1), "flat_decode_goal_met": met}


def control_command(cfg: Config, fronts: int = 1, clients: int = 1) -> list[str]:
    return [*_python(), "benchmarks/overhead.py", "--model", str(cfg.models / "qwen3-null"), *CONTROL_ARGS,
            "--out", str(cfg.work / "overhead.json"), "--run-dir", str(cfg.work / "overhead-run"),
            "--worker-arg=--device", f"--worker-arg={cfg.device}",
            "--front-processes", str(fronts), "--client-processes", str(clients)]  # fmt: skip


def phase_control(run: Run, limit: float) -> dict[str, Any]:
    """One overhead.py run per ``cfg.control`` entry; the figures under ``entries`` (each entry's,
    in turn: an entry may repeat)."""
    if run.cfg.dry_run:  # a whole stack is too slow for make test: check the rig starts, record the command
        o = run.command([*_python(), "benchmarks/overhead.py", "--help"], limit)
        return {"status": "skipped" if o.rc == 0 else "failed", "reason": "dry run",
                "command": control_command(run.cfg, *run.cfg.control[0]), "seconds": round(o.seconds, 1)}  # fmt: skip
    keys = ("tokens_per_s", "step_ms", "ttft_p50_ms", "itl_p50_ms", "output_tokens", "failed", "cpu_us_per_token",
            "tokenizer_each")  # fmt: skip
    figures: dict[str, Any] = {"streams": int(CONTROL_ARGS[1]), "tokens": int(CONTROL_ARGS[3]), "entries": []}
    run.result["figures"]["control"] = figures
    t0 = time.monotonic()
    for fronts, clients in run.cfg.control:
        out = run.cfg.work / "overhead.json"
        out.unlink(missing_ok=True)
        o = run.command(control_command(run.cfg, fronts, clients), limit - (time.monotonic() - t0))
        if o.rc != 0 or not out.exists():
            for log in sorted((run.cfg.work / "overhead-run").glob("*.log")):
                run.log(f"--- {log.name}\n{log.read_text(errors='replace')[-8192:]}")
            return {"status": "timeout" if o.rc is None else "failed", "seconds": round(time.monotonic() - t0, 1),
                    "rc": o.rc}  # fmt: skip
        by_front = {r["front"]: {k: r.get(k) for k in keys} for r in json.loads(out.read_text())["runs"]}
        figures["entries"].append({"front_processes": fronts, "client_processes": clients, "fronts": by_front})
    return {"status": "ok", "seconds": round(time.monotonic() - t0, 1)}


# (name, time limit in seconds, phase)
PHASES: tuple[tuple[str, float, Callable[[Run, float], dict[str, Any]]], ...] = (
    ("models", 150.0, phase_models),
    ("kernels", 120.0, lambda run, limit: phase_tests(run, "kernels", limit)),
    ("elastic", 60.0, lambda run, limit: phase_tests(run, "elastic", limit)),
    ("engine", 240.0, lambda run, limit: phase_tests(run, "engine", limit)),
    ("step", 180.0, phase_step),
    ("control", 420.0, phase_control),  # ~60-100 s per --control entry, the budget permitting
)


def totals(phases: dict[str, Any]) -> dict[str, Any]:
    total: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": []}
    for p in phases.values():
        for k, v in p.get("tests", {}).items():
            total[k] += v
    return total


def check(cfg: Config) -> int:
    cfg.work.mkdir(parents=True, exist_ok=True)
    cfg.log.parent.mkdir(parents=True, exist_ok=True)
    cfg.log.write_text("")
    run = Run(cfg)
    run.result = {
        "issue": 32, "generated": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "rev": cfg.rev,
        "dry_run": cfg.dry_run, "budget_s": cfg.budget_s, "device": {"device": cfg.device},
        "tests": totals({}), "phases": {}, "figures": {},
    }  # fmt: skip
    phases = run.result["phases"]
    try:
        phases["env"] = phase_env(run)
    except Exception as exc:  # the phases after it may still run
        phases["env"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:1000]}
    run.write()
    for name, limit, fn in PHASES:
        if cfg.only and name not in cfg.only:
            continue
        left = run.remaining() - RESERVE_S
        if left < 10:
            phases[name] = {"status": "skipped", "reason": "out of time"}
            continue
        print(f"[gpu_check] {name} (up to {min(limit, left):.0f}s)", flush=True)
        try:
            phases[name] = fn(run, min(limit, left))
        except Exception as exc:  # a broken phase must not cost the others their turn
            phases[name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:1000]}
            run.log(f"phase {name} raised {type(exc).__name__}: {exc}")
        run.result["tests"] = totals(phases)
        print(f"[gpu_check] {name}: {phases[name]['status']}", flush=True)
        run.write()
    t = run.result["tests"]
    bad = [n for n, p in phases.items() if p["status"] not in ("ok", "skipped")]
    print(f"[gpu_check] tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} "
          f"skipped; phases not ok: {bad or 'none'}; wrote {cfg.out}", flush=True)  # fmt: skip
    return 0 if not bad and not t["failed"] and not t["errors"] else 1


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --dry-run")
    p.add_argument("--dry-run", action="store_true", help="the CPU at toy sizes (see above)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "gpu.json")
    p.add_argument("--log", type=Path, default=None, help="default: gpu_check.log beside --out")
    p.add_argument("--work", type=Path, default=ROOT / ".runs" / "gpu-check", help="scratch folder")
    p.add_argument("--models", type=Path, default=ROOT / "models", help="where the checkpoints are (or go)")
    p.add_argument("--budget-s", type=float, default=540.0, help="the whole run's time, every phase included")
    p.add_argument("--only", default="", help="comma-separated phases to run (env always runs): "
                   + ", ".join(n for n, _, _ in PHASES))  # fmt: skip
    p.add_argument("--rev", default=None, help="the commit under test (default: git's HEAD, where there is one)")
    p.add_argument("--control", default="1x1", help="the control phase's runs, in turn: comma-separated "
                   "FxC (the tokenizer's --front-processes F, C client processes)")
    p.add_argument("--probe-env", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    device = a.device or ("cpu" if a.dry_run else "cuda")
    if a.probe_env:
        print(json.dumps(probe_env(device)))
        return 0
    only = tuple(x for x in a.only.split(",") if x)
    unknown = [x for x in only if x not in {n for n, _, _ in PHASES}]
    if unknown:
        p.error(f"unknown phases {unknown}")
    if device != "cpu" and a.dry_run:
        p.error("--dry-run runs on the CPU")
    try:
        control = tuple((int(f), int(c)) for f, c in (x.split("x") for x in a.control.split(",")))
    except ValueError:
        p.error(f"--control: expected FxC[,FxC...], got {a.control!r}")
    if not control or min(min(x) for x in control) < 1:
        p.error(f"--control: counts must be >= 1, got {a.control!r}")
    cfg = Config(device, a.dry_run, a.out, a.log or a.out.with_name("gpu_check.log"), a.work, a.models, a.budget_s,
                 only, a.rev if a.rev is not None else _git_rev(), control)  # fmt: skip
    return check(cfg)


if __name__ == "__main__":
    sys.exit(main())
