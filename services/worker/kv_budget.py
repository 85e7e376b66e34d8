"""Sizing the KV pool from the memory the device has left once the weights are loaded.

``kv_cache_bytes = 0`` (the default) asks for ``fraction`` of the free memory (CUDA: what
``torch.cuda.mem_get_info`` reports free; CPU: what the kernel reports available), like the
``--mem-fraction-static`` / ``--gpu-memory-utilization`` knobs of other servers, but never more
than every row at full context could use: a bigger pool would only hold memory no one can reach.
"""

from __future__ import annotations

import logging

import psutil
import torch

log = logging.getLogger(__name__)

DEFAULT_FRACTION = {"cpu": 0.1, "cuda": 0.8}


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def auto_kv_bytes(device: torch.device, fraction: float, slot_bytes: int, max_tokens: int) -> int:
    """``fraction`` (0 = the device's default) of free memory, capped at ``max_tokens`` slots."""
    fraction = fraction or DEFAULT_FRACTION.get(device.type, 0.1)
    free = free_bytes(device)
    budget = min(int(free * fraction), slot_bytes * max_tokens)
    log.info(
        "KV pool sized from free memory: %.1f MiB (%.2f of %.1f MiB free, at most %d tokens of %d bytes)",
        budget / 2**20, fraction, free / 2**20, max_tokens, slot_bytes,
    )  # fmt: skip
    return budget
