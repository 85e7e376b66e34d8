"""Triton kernel tests run in a child process of their own test file, so that the interpreter
(``TRITON_INTERPRET=1``, read when Triton is imported) can be on for the numeric cases on the CPU
and off for the compile-only checks, and so that a GPU run (``STRATA_TEST_DEVICE=cuda``) compiles
the same cases. The test file calls ``run`` and ends with ``child_main``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run(test_file: str, arg: str, interpret: bool) -> dict[str, Any]:
    """Run ``test_file``'s child mode for ``arg`` (a family of cases, or ``compile``) and return the
    JSON object it prints last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(Path(test_file).resolve()), arg],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"{arg} child failed:\n{proc.stdout}\n{proc.stderr}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def child_main(families: dict[str, Callable[[], object]], compile_all: Callable[[], object]) -> None:
    """Child mode: ``compile`` without the interpreter; a family's numeric cases under it on the
    CPU, or compiled on the test device."""
    sys.path.insert(0, str(ROOT))
    import torch

    from tests.device import TEST_DEVICE

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if sys.argv[1] == "compile":
        if interpreted:
            sys.exit("run `compile` without TRITON_INTERPRET")
        print(json.dumps(compile_all()))
        return
    if interpreted == (TEST_DEVICE != "cpu"):
        sys.exit("run with TRITON_INTERPRET=1 on the CPU, without it on a GPU (STRATA_TEST_DEVICE)")
    if TEST_DEVICE != "cpu":
        torch.set_default_device(TEST_DEVICE)
    torch.manual_seed(0)
    print(json.dumps(families[sys.argv[1]]()))
