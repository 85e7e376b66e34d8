"""The device of the device-aware engine tests: ``STRATA_TEST_DEVICE`` (default ``cpu``).

Everywhere the suite runs on the CPU. A lent GPU machine runs a chosen subset with
``STRATA_TEST_DEVICE=cuda`` (``scripts/gpu_check.sh``): the engines those tests build
(``tests/sched_harness.py: engine``, the fixtures of ``test_engine_qwen3.py``, ``test_qwen3_next.py``
and ``test_engine_device.py``) then live on that device, and the Triton kernel tests run compiled
instead of under the interpreter. Tests that build their engines otherwise stay on the CPU.

Read once, here; ``tests/conftest.py`` refuses a device this machine does not have, so a GPU run can
never pass by quietly running on the CPU. Production code never reads it: the engine takes its
device from ``EngineConfig.device``.
"""

from __future__ import annotations

import os

TEST_DEVICE: str = os.environ.get("STRATA_TEST_DEVICE", "cpu")


def check_test_device() -> str | None:
    """Why ``TEST_DEVICE`` cannot be used here, or None when it can."""
    if TEST_DEVICE == "cpu":
        return None
    kind, _, index = TEST_DEVICE.partition(":")
    if kind != "cuda" or not (index == "" or index.isdigit()):
        return f"STRATA_TEST_DEVICE must be 'cpu', 'cuda' or 'cuda:N', got {TEST_DEVICE!r}"
    import torch

    if not torch.cuda.is_available():
        return f"STRATA_TEST_DEVICE={TEST_DEVICE} but torch sees no CUDA device"
    if index and int(index) >= torch.cuda.device_count():
        return f"STRATA_TEST_DEVICE={TEST_DEVICE} but only {torch.cuda.device_count()} CUDA devices are visible"
    return None
