"""``strata up``'s per-replica worker flags: each replica's CPUs (``--worker-cpus``), its forward
threads (``--worker-threads``) and the prefill workers' outbox (``--handoff-outbox-bytes``), and the
combinations it refuses before starting."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from services.cli import _replica_worker_args, _shared_cores_note, _up, build_parser


def _args(*argv: str, model: str = "m") -> argparse.Namespace:
    return build_parser().parse_args(["up", "--model", model, *argv])


def test_each_replica_gets_its_cpus_and_only_prefill_workers_an_outbox() -> None:
    a = _args("--prefill-replicas", "1", "--decode-replicas", "2", "--worker-cpus", "0;1;2-3",
              "--handoff-outbox-bytes", "1GiB")  # fmt: skip
    roles = ("prefill", "decode", "decode")
    assert _replica_worker_args(a, roles) == [
        ("--cpus", "0", "--outbox-bytes", "1GiB"), ("--cpus", "1"), ("--cpus", "2-3"),
    ]  # fmt: skip
    assert _replica_worker_args(_args("--replicas", "2"), ()) == [(), ()]


def test_each_replica_gets_its_thread_count() -> None:
    a = _args("--prefill-replicas", "1", "--decode-replicas", "1", "--worker-threads", "0;1",
              "--handoff-outbox-bytes", "1GiB")  # fmt: skip
    assert _replica_worker_args(a, ("prefill", "decode")) == [
        ("--threads", "0", "--outbox-bytes", "1GiB"), ("--threads", "1"),
    ]  # fmt: skip
    both = _args("--replicas", "2", "--worker-cpus", "0;1", "--worker-threads", "1;1")
    assert _replica_worker_args(both, ()) == [("--cpus", "0", "--threads", "1"), ("--cpus", "1", "--threads", "1")]


def test_prefill_and_decode_sharing_cpu_cores_get_a_hint() -> None:
    roles = ("prefill", "decode")
    pd = ("--prefill-replicas", "1", "--decode-replicas", "1")
    cores = len(os.sched_getaffinity(0))
    note = _shared_cores_note(_args(*pd), roles)
    assert f"share this host's {cores} cores" in note and f"--worker-threads '0;{max(1, cores // 2)}'" in note
    for given in (("--worker-threads", "0;1"), ("--worker-cpus", "0;0"), ("--device", "cuda:0")):
        assert _shared_cores_note(_args(*pd, *given), roles) == ""
    assert _shared_cores_note(_args("--replicas", "2"), ()) == ""


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--replicas", "2", "--worker-cpus", "0"), "--worker-cpus needs one CPU list per replica (2)"),
        (("--handoff-outbox-bytes", "1GiB"), "--handoff-outbox-bytes is for --prefill-replicas"),
        (("--replicas", "2", "--worker-threads", "1"), "--worker-threads needs one thread count"),
        (("--worker-threads", "two"), "--worker-threads needs one thread count"),
    ],
)
def test_refused_before_anything_starts(
    argv: tuple[str, ...], says: str, tiny_qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _up(_args(*argv, "--run-dir", str(tmp_path), model=str(tiny_qwen3))) == 2
    assert says in capsys.readouterr().err
