"""Tensor parallelism on the CPU (gloo): every rank of a real process group runs the same steps.

Rank 0's logits must match transformers within 1e-4 on every cache path (cold, decode, chunked,
prefix hit, host-reloaded, L3-reloaded) and its greedy output must equal ``generate``, also when
decoding by verifying drafts (TP 2: every rank rolls back to what rank 0 kept); each rank
holds only its shard (fewer KV heads, its own L3 keys); a wrong TP size is refused naming the
config key.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from services.common.etcd_proc import free_port
from services.common.page_hash import rank_key
from services.worker.tp import Tp
from tests.reference import hf_greedy, hf_model
from tests.tp_harness import DEC, PAGE, S1, S2, S3, P, Q, paths_scenario, run_group

TOL = 1e-4


def reference(model_dir: Path, *pieces: list[int]) -> torch.Tensor:
    """transformers' logits of the last piece, given the ones before it."""
    ids = [t for p in pieces for t in p]
    with torch.no_grad():
        logits = hf_model(str(model_dir))(torch.tensor([ids])).logits[0].float()
    return logits[len(ids) - len(pieces[-1]) :]


def run_paths(model_dir: Path, size: int) -> list[dict[str, Any]]:
    """``paths_scenario`` on every rank of a group; at TP 2 with speculative verify passes too."""
    truth = hf_greedy(model_dir, P, 12, stop_at_eos=False) if size == 2 else None
    ranks = run_group(size, paths_scenario, str(model_dir), truth)
    if truth is not None:
        check_drafts(truth, ranks)
    return ranks


def check_drafts(truth: list[int], ranks: list[dict[str, Any]]) -> None:
    """Verify passes (scheduler-side drafts): rank 0 samples every position and keeps part of the
    drafts; the followers learn what it kept, so their rows and recurrent states end where rank
    0's do (else the next step's all-reduced forward differs) and the answer equals transformers."""
    got = ranks[0]["drafts"]
    assert got["tokens"] == truth
    assert any(k < 4 for k in got["kept"]) and any(k > 1 for k in got["kept"]), got["kept"]
    assert all(r["drafts"] == got for r in ranks)


def check_paths(model_dir: Path, out: dict[str, torch.Tensor]) -> None:
    expected = {
        "cold": reference(model_dir, P),
        "decode": reference(model_dir, P, DEC),
        "chunked": reference(model_dir, Q),
        "prefix_hit": reference(model_dir, P[:PAGE], S1),
        "host_reloaded": reference(model_dir, P[:PAGE], S2),
        "l3_reloaded": reference(model_dir, P[:PAGE], S3),
    }
    for path, ref in expected.items():
        diff = float((out[path] - ref).abs().max())
        assert diff < TOL, f"{path}: max |logit diff| {diff:.2e} vs transformers"
    assert out["greedy"] == hf_greedy(model_dir, P, 12, stop_at_eos=False)


@pytest.mark.parametrize("size", [2, 4])
def test_dense_every_path_matches_transformers(tiny_qwen3: Path, size: int) -> None:
    ranks = run_paths(tiny_qwen3, size)
    check_paths(tiny_qwen3, ranks[0])
    one = hf_model(str(tiny_qwen3)).config
    for r, out in enumerate(ranks):
        info = out["info"]
        assert info.tp_size == size and info.kv_layout.endswith(f"/tp0of{size}")
        # 2 KV heads: split over 2 ranks, replicated (1 each) over 4
        assert f"/H{max(one.num_key_value_heads // size, 1)}/" in info.kv_layout
        assert out["get_jobs"] == [(True, 1)], f"rank {r} did not read its page back"
    # ranks write their shards under their own keys, never another rank's
    keys = [set(out["l3_keys"]) for out in ranks]
    assert keys[0] == {bytes(range(32))}
    assert keys[1] == {rank_key(bytes(range(32)), 1, size)}
    assert all(not (keys[i] & keys[j]) for i in range(size) for j in range(i + 1, size))
    # one all-reduce per attention block and one per MLP block, of a hidden vector per token
    assert ranks[0]["reduced_bytes"] > 0


@pytest.mark.parametrize("size", [2, 4])
def test_hybrid_every_path_matches_transformers(tiny_qwen3_next: Path, size: int) -> None:
    """TP 2 splits the 2 linear key heads; TP 4 replicates each on 2 ranks and splits its value heads."""
    ranks = run_paths(tiny_qwen3_next, size)
    check_paths(tiny_qwen3_next, ranks[0])
    for out in ranks:
        assert out["info"].state_layout.endswith(f"/tp0of{size}")
        assert out["get_jobs"] == [(True, 1), (True, 1)]  # the page and the state


def test_shards_must_divide() -> None:
    tp = Tp(1, 3)
    with pytest.raises(ValueError, match="num_attention_heads"):
        tp.kv_heads(2, 4)
    with pytest.raises(ValueError, match="does not divide"):
        tp.split(128, "intermediate_size")
    assert Tp(3, 4).kv_heads(2, 4) == (1, 1)  # replicated: ranks 2 and 3 hold KV head 1
    assert Tp(1, 2).kv_heads(4, 8) == (2, 2)
    from services.worker.models.linear_attn import _heads

    assert _heads(2, 4, Tp(3, 4)) == (1, 1, 1, 1)  # key head 1 (on ranks 2, 3), its 2nd value head
    assert _heads(4, 8, Tp(1, 2)) == (2, 2, 0, 2)  # whole groups: key heads 2 and 3
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        _heads(2, 4, Tp(0, 3))
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        _heads(2, 2, Tp(0, 4))


def test_each_rank_gets_its_own_gpu() -> None:
    from services.worker.tp_group import rank_device

    assert [rank_device("cuda:2", r) for r in range(3)] == ["cuda:2", "cuda:3", "cuda:4"]
    assert rank_device("cuda", 1) == "cuda:1"
    assert rank_device("cpu", 3) == "cpu"


def _late_rank(rank: int, init: str, out: Any) -> None:
    """Rank 1 joins 1.5 s after rank 0, then is 2 s late to its first collective (timeout 0.5 s)."""
    try:
        time.sleep(1.5 * rank)
        tp = Tp.join(init, rank, 2, timeout_s=0.5)
        t0 = time.monotonic()
        try:
            time.sleep(2.0 * rank)
            dist.all_reduce(torch.ones(1))
            out.put((rank, "reduced", time.monotonic() - t0))
        except RuntimeError as e:
            out.put((rank, type(e).__name__, time.monotonic() - t0))
        tp.close()
    except BaseException as e:  # report, so the test fails with the error instead of hanging
        out.put((rank, f"join: {e!r}", 0.0))


def test_joining_waits_for_a_slow_rank_but_a_collective_does_not() -> None:
    """``timeout_s`` bounds collectives; a rank still starting (importing torch on a loaded host)
    gets ``JOIN_MIN_S`` to join (with ``--tp-timeout-s 3`` a full run's ranks once missed each other)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_late_rank, args=(r, init, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {r: (what, s) for r, what, s in (out.get(timeout=60) for _ in range(2))}
    finally:
        for p in procs:
            p.join(10)
            p.kill()
    assert not got[0][0].startswith("join") and not got[1][0].startswith("join"), got
    assert got[0][0] != "reduced" and got[0][1] < 1.8, got  # rank 0 gave up on rank 1 after ~0.5 s
