"""Which event loop a service runs on: uvloop unless ``STRATA_EVENT_LOOP`` says ``asyncio``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import uvloop

from services.common.server import run_loop

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("env", "expected"), [(None, uvloop.Loop), ("uvloop", uvloop.Loop), ("asyncio", None)])
def test_run_loop_runs_on_the_chosen_loop(
    monkeypatch: pytest.MonkeyPatch, env: str | None, expected: type | None
) -> None:
    if env is None:
        monkeypatch.delenv("STRATA_EVENT_LOOP", raising=False)
    else:
        monkeypatch.setenv("STRATA_EVENT_LOOP", env)
    seen: list[asyncio.AbstractEventLoop] = []

    async def main() -> None:
        seen.append(asyncio.get_running_loop())

    run_loop(main)
    assert len(seen) == 1
    if expected is None:
        assert not isinstance(seen[0], uvloop.Loop)
        assert isinstance(seen[0], asyncio.BaseEventLoop)
    else:
        assert isinstance(seen[0], expected)


def test_an_unknown_loop_is_a_configuration_error() -> None:
    """A service refuses to start (status 2, the variable and its value named) before it binds or
    loads anything."""
    proc = subprocess.run(
        [sys.executable, "-m", "services.scheduler.server", "--port", "0"],
        cwd=ROOT, env={"PATH": "/usr/bin:/bin", "STRATA_EVENT_LOOP": "trio"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "STRATA_EVENT_LOOP: 'trio' is not one of uvloop, asyncio" in proc.stderr
