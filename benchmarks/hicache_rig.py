"""What ``benchmarks.hicache`` stands on: the pool sizes a model needs and the kvstore server
(L3), in its own process or on the bench's event loop."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import NamedTuple

from services.kvstore.config import KVStoreConfig
from services.kvstore.server import build_server

_READY_TIMEOUT_S = 60.0


# -- the model -------------------------------------------------------------------------------------


class Sizes(NamedTuple):
    """Bytes the pools need per cached token and per Mamba state (fp32, the engine's default)."""

    kv_per_token: int  # K and V of every full-attention layer
    per_state: int  # one Mamba state (conv window + recurrent state of every linear layer); 0 = dense

    @property
    def hybrid(self) -> bool:
        return self.per_state > 0


def model_sizes(model: Path) -> Sizes:
    """Read from ``config.json``, as the models size their caches (checked against the engine)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    linear = (c.get("layer_types") or []).count("linear_attention")  # the rest hold KV
    kv = 2 * (c["num_hidden_layers"] - linear) * c["num_key_value_heads"] * head_dim * 4
    if not linear:
        return Sizes(kv, 0)
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    conv = (2 * nk * dk + nv * dv) * (c["linear_conv_kernel_dim"] - 1)
    return Sizes(kv, linear * (conv + nv * dk * dv) * 4)


def states_per_prompt(length: int, checkpoint_every: int) -> int:
    """Most states one prompt leaves in a tier: its chunk grid, its last page and a branch point."""
    return length // checkpoint_every + 2


class Pools(NamedTuple):
    """What a run's pools hold. The device and host pools: two of the longest prompts (the one
    being served and the last one's cache) with, on a hybrid model, their checkpoints' states
    (and on the device a running request's working state, fork and copy); the kvstore: every
    prompt of the run and the warm-up's, so that it never evicts."""

    kv_cache_bytes: int
    mamba_slots: int  # 0 on a dense model
    host_cache_bytes: int
    host_state_share: float
    states: int  # most states one prompt leaves (0 on a dense model)
    kvstore_bytes: int


def pools(sizes: Sizes, lengths: list[int], repeats: int, page: int, checkpoint_every: int) -> Pools:
    longest = max(lengths) + page
    kv = 2 * longest * sizes.kv_per_token
    if not sizes.hybrid:
        return Pools(kv, 0, kv, 0.25, 0, 2 * (sum(lengths) * repeats + longest) * sizes.kv_per_token)
    states = states_per_prompt(max(lengths), checkpoint_every)
    host_states = (2 * states + 1) * sizes.per_state  # one spare: the share is rounded down
    l3_states = sum(states_per_prompt(n, checkpoint_every) for n in lengths) * repeats + states
    l3 = 2 * ((sum(lengths) * repeats + longest) * sizes.kv_per_token + l3_states * sizes.per_state)
    return Pools(kv, 2 * states + 3, kv + host_states, host_states / (kv + host_states), states, l3)


# -- the kvstore -----------------------------------------------------------------------------------


@contextmanager
def kvstore_process(capacity_bytes: int) -> Iterator[str]:
    """A kvstore server process on loopback; yields its address once it prints READY."""
    cmd = [sys.executable, "-m", "services.kvstore.server", "--host", "127.0.0.1", "--port", "0",
           "--capacity-bytes", str(capacity_bytes), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    watchdog = threading.Timer(_READY_TIMEOUT_S, proc.kill)  # a server that never gets ready
    watchdog.start()
    try:
        address = ""
        for line in proc.stdout:
            if line.startswith("READY kvstore "):
                address = line.split()[-1]
                break
        watchdog.cancel()
        if not address:
            raise RuntimeError(f"the kvstore server exited with {proc.wait()} before it was ready")
        # Keep reading, so a chatty server never blocks on a full pipe.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield address
    finally:
        watchdog.cancel()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@asynccontextmanager
async def kvstore_inproc(capacity_bytes: int) -> AsyncIterator[str]:
    """A kvstore server on this event loop (quicker to start; shares the process with the loop)."""
    server, _ = build_server(KVStoreConfig(capacity_bytes=capacity_bytes))
    port = await server.start("127.0.0.1:0")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop()


@asynccontextmanager
async def kvstore(kind: str, capacity: int) -> AsyncIterator[str]:
    """``kind`` "inproc" or "process": see the two above."""
    if kind == "inproc":
        async with kvstore_inproc(capacity) as address:
            yield address
        return
    with kvstore_process(capacity) as address:
        yield address
