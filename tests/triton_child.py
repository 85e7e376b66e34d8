"""Triton kernel tests run in a child process of their own test file, so that the interpreter
(``TRITON_INTERPRET=1``, read when Triton is imported) can be on for the numeric cases on the CPU
and off for the compile-only checks, and so that a GPU run (``STRATA_TEST_DEVICE=cuda``) compiles
the same cases. The test file calls ``run`` (or ``family``) and ends with ``child_main``.

Each child imports torch and Triton (~3 s of CPU), so the numeric families of a file run in one
child (``<name>,<name>``: the families the session selected), whose results ``family`` hands out
to each family's test; every family starts from the same seed as it would alone."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

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


@functools.cache
def _all(test_file: str, names: tuple[str, ...], interpret: bool) -> dict[str, Any]:
    return run(test_file, ",".join(names), interpret)


def family(request: pytest.FixtureRequest, name: str, interpret: bool) -> dict[str, Any]:
    """One family's results, from one child per test file that runs every family whose test
    (parametrized by ``family``) the session selected; the first of them starts it."""
    test = request.node.originalname
    names = tuple(sorted({
        str(item.callspec.params["family"]) for item in request.session.items
        if isinstance(item, pytest.Function) and item.originalname == test and item.path == request.node.path
    }))  # fmt: skip
    results: dict[str, Any] = _all(str(request.node.path), names, interpret)[name]
    return results


def child_main(families: dict[str, Callable[[], object]], compile_all: Callable[[], object]) -> None:
    """Child mode: ``compile`` without the interpreter; the numeric cases of the families named
    (``<name>,<name>``, one result object per family) under it on the CPU, or compiled on the
    test device."""
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
    out = {}
    for name in sys.argv[1].split(","):
        torch.manual_seed(0)
        out[name] = families[name]()
    print(json.dumps(out))
