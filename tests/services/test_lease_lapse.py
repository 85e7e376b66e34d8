"""A scheduler frozen past its etcd lease (found by the chaos run, issue #29): SIGSTOPped for longer
than the lease's TTL, it leaves discovery and the tokenizer closes its session. Its streams must
go on elsewhere, as when it dies — they ended CANCELLED ("the tokenizer is stopping") instead."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc

from services.common.etcd_proc import free_port
from services.supervisor import start_stack
from strata.v1 import strata_pb2_grpc as pgrpc
from tests import streams

LEASE_TTL_S = 5.0  # services.common.discovery.Registration's default


def test_a_scheduler_frozen_past_its_lease_loses_no_stream(tiny_qwen3: Path, tmp_path: Path) -> None:
    s = start_stack(tiny_qwen3, free_port(), tmp_path, worker_args=("--host-cache-bytes", "0"),
                    tokenizer_args=("--router-policy", "round_robin"), replicas=2, say=lambda _: None,
                    grammar_preload=False)  # fmt: skip
    try:
        with grpc.insecure_channel(s.child("tokenizer").address) as ch:
            api = pgrpc.StrataStub(ch)
            reqs = streams.mixed(8, 80)
            want = [w.ids for w in streams.run(api, reqs)]
            proc = s.child("scheduler-1").proc
            assert proc is not None

            def freeze(running: list[streams.Stream]) -> None:
                # Freeze while both replicas' streams run: wait for the unconstrained ones only (a
                # constrained one may wait seconds for its grammar while its replica's others finish).
                streams.wait_streaming(running[:-2], 5)
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    time.sleep(LEASE_TTL_S + 2.5)  # the lease lapses; the tokenizer drops the scheduler
                finally:
                    os.kill(proc.pid, signal.SIGCONT)

            got = streams.run(api, reqs, freeze)
        assert [g.error for g in got] == [None] * 8
        assert [g.ids for g in got] == want
        log = s.child("tokenizer").log_path.read_text()
        assert "left discovery" in log, log[-3000:]  # the frozen replica's streams really moved
    finally:
        s.stop()
