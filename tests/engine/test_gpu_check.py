"""benchmarks/gpu_check.py, the lent GPU's one prepared call (issue #32), run as its CPU dry run, so that
it still imports, parses its arguments, finds its tests and writes its report between the sessions
that have a GPU; and its reading of pytest's junit files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu_check import PHASES, VMM_TEST, case_outcome, junit_counts, totals

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_runs_every_phase_and_writes_the_report(tmp_path: Path, tiny_qwen3: Path,
                                                        tiny_qwen3_next: Path) -> None:  # fmt: skip
    models = tmp_path / "models"
    models.mkdir()
    (models / "qwen3-tiny").symlink_to(tiny_qwen3)
    (models / "qwen3-next-tiny").symlink_to(tiny_qwen3_next)
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out), "--work", str(tmp_path / "w"),
         "--models", str(models), "--rev", "test"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log[-6000:]
    r = json.loads(out.read_text())
    assert r["dry_run"] and r["rev"] == "test" and r["issue"] == 32
    assert r["device"]["name"] == "cpu" and r["device"]["versions"]["torch"]
    statuses = {name: p["status"] for name, p in r["phases"].items()}
    assert statuses == {"env": "ok", "models": "ok", "kernels": "ok", "elastic": "ok", "engine": "ok", "step": "ok",
                        "control": "skipped"}  # fmt: skip
    assert r["phases"]["models"]["generated"] == []  # both tiny checkpoints were there
    for name in ("kernels", "elastic", "engine"):
        phase = r["phases"][name]
        assert phase["tests"]["passed"] == 1 and phase["tests"]["failed"] == phase["tests"]["errors"] == 0, name
        assert phase["deselected"] > 0, name  # the rest of the GPU selection was collected
    assert r["phases"]["engine"]["deselected"] >= 95  # test_engine_device.py alone has 96 cases
    assert r["tests"]["passed"] == 3 and r["tests"]["failed"] == 0
    step = r["figures"]["step"]
    assert step["copy_gbs"] > 0
    tiny = step["models"]["qwen3-tiny"]
    assert [(s["kind"], s["batch"]) for s in tiny["steps"]] == [("prefill", 1), ("decode", 1), ("decode", 2)]
    assert all(s["tokens_per_s"] > 0 and s["min_ms"] <= s["step_ms"] <= s["max_ms"] for s in tiny["steps"])
    assert [k["kernel"] for k in tiny["attention"]] == ["decode", "cascade_decode", "extend"]
    assert all(k["us"] > 0 for k in tiny["attention"])
    assert tiny["attention"][0]["fraction_of_copy"] > 0
    assert list(r["figures"]["flat_decode_fraction_of_copy"]["qwen3-tiny"]) == ["2"]
    assert r["phases"]["step"]["flat_decode_goal_met"] is False  # the torch reference on 2 CPU cores
    command = r["phases"]["control"]["command"]
    assert "--worker-arg=--device" in command and "--worker-arg=cpu" in command and "256" in command


def test_only_runs_the_phases_named(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out), "--work", str(tmp_path / "w"),
         "--only", "control"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(json.loads(out.read_text())["phases"]) == ["env", "control"]
    bad = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--only", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "unknown phases ['tests']" in bad.stderr
    assert {n for n, _, _ in PHASES} == {"models", "kernels", "elastic", "engine", "step", "control"}


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5">
<testcase classname="tests.unit.test_elastic" name="test_a" time="0.1"/>
<testcase classname="tests.unit.test_elastic" name="test_b" time="0.1"/>
<testcase classname="tests.unit.test_elastic" name="test_cuda_vmm_pool_grows_shrinks_in_place" time="0.0">
<skipped type="pytest.skip" message="needs CUDA VMM (cuda-python bindings and a GPU)">skip</skipped></testcase>
<testcase classname="tests.engine.test_x" name="test_c[float32]" time="0.2">
<failure message="AssertionError: fp32 logits differ&#10;second line">trace</failure></testcase>
<testcase classname="tests.engine.test_x" name="test_d" time="0.0"><error message="fixture broke">e</error></testcase>
</testsuite></testsuites>
"""


def test_junit_counts_and_totals(tmp_path: Path) -> None:
    path = tmp_path / "j.xml"
    path.write_text(JUNIT)
    c = junit_counts(path)
    assert (c["passed"], c["failed"], c["errors"], c["skipped"]) == (2, 1, 1, 1)
    assert c["failures"] == [
        {"test": "tests.engine.test_x::test_c[float32]", "message": "AssertionError: fp32 logits differ"},
        {"test": "tests.engine.test_x::test_d", "message": "fixture broke"},
    ]
    assert c["skips"][0]["message"].startswith("needs CUDA VMM")
    both = totals({"a": {"tests": c}, "b": {"tests": c}, "c": {"status": "ok"}})
    assert (both["passed"], both["failed"], len(both["failures"])) == (4, 2, 4)
    # The VMM test skipped means no CUDA VMM: the report says so rather than "ok".
    assert case_outcome(path, VMM_TEST) == "skipped: needs CUDA VMM (cuda-python bindings and a GPU)"
    assert case_outcome(path, "test_a") == "passed"
    assert case_outcome(path, "test_c[float32]").startswith("failed: AssertionError")
    assert case_outcome(path, "test_gone") == "absent"
