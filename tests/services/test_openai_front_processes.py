"""A tokenizer with two front processes (``--front-processes 2``) behind the shared stack's
scheduler: both serve the gRPC port and the HTTP port, answer as one process does, abort each
other's requests, and a front process that dies takes the set down (so a supervisor restarts it).

Named beside the OpenAI API's modules, whose shared stack it uses: in a whole run that stack then
starts no earlier than it did."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import psutil
import pytest

from services.common.server import CHANNEL_OPTIONS
from services.supervisor import Child, Stack
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc
from tests.openai_stack import KEY, MODEL

PROMPT = "The front processes share one port"


def _start(stack: Stack, model: Path, run: Path) -> Child:
    argv = [sys.executable, "-m", "services.tokenizer", "--model", str(model), "--model-name", MODEL,
            "--etcd", stack.etcd_endpoint, "--port", "0", "--http-port", "-1", "--front-processes", "2"]  # fmt: skip
    child = Child("tokenizer", argv, run / "tokenizer.log")
    child.start(dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        child.wait_ready(90)
    except BaseException:
        child.stop()
        raise
    return child


@pytest.fixture(scope="module")
def fronts(openai_stack: Stack, tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    child = _start(openai_stack, tiny_qwen3, tmp_path_factory.mktemp("fronts"))
    try:
        yield child
    finally:
        child.stop()


def _procs(child: Child) -> list[psutil.Process]:
    assert child.proc is not None
    first = psutil.Process(child.proc.pid)
    return [first, *first.children()]


def _connect(address: str, procs: list[psutil.Process]) -> tuple[grpc.Channel, int]:
    """A channel on a connection of its own, and the pid of the front process that accepted it."""
    port = int(address.rsplit(":", 1)[1])
    me = psutil.Process()

    def ours() -> set[int]:
        return {c.laddr.port for c in me.net_connections("tcp") if c.raddr and c.raddr.port == port}

    before = ours()
    channel = grpc.insecure_channel(address, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
    pgrpc.StrataStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    (local,) = ours() - before
    for p in procs:
        if any(c.raddr and c.raddr.port == local for c in p.net_connections("tcp")):
            return channel, p.pid
    raise AssertionError(f"no front process holds the connection from port {local}")


def _greedy() -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=8))


def test_both_processes_serve_grpc_and_http_alike(fronts: Child, openai_stack: Stack) -> None:
    procs = _procs(fronts)
    assert len(procs) == 2, [p.cmdline() for p in procs]
    assert "--front-index" in procs[1].cmdline() and "1" in procs[1].cmdline()
    # The reference: the same greedy request through the stack's own (one-process) tokenizer.
    with grpc.insecure_channel(openai_stack.child("tokenizer").address) as ch:
        auth = (("authorization", f"Bearer {KEY}"),)
        ref = list(pgrpc.StrataStub(ch).Generate(_greedy(), metadata=auth))
    expected = [t for r in ref for t in r.token_ids]
    assert len(expected) == 8
    # 16 connections: the kernel spreads them over both processes (all on one: 2 ** -15).
    owners: dict[int, int] = {}
    for _ in range(16):
        channel, pid = _connect(fronts.address, procs)
        with channel:
            out = [t for r in pgrpc.StrataStub(channel).Generate(_greedy()) for t in r.token_ids]
        assert out == expected
        owners[pid] = owners.get(pid, 0) + 1
    assert set(owners) == {p.pid for p in procs}, owners
    # HTTP: both processes listen on the one inherited socket; concurrent streams answer alike.
    http_port = int(fronts.extra["http"].rsplit(":", 1)[1])
    for p in procs:
        assert any(c.status == psutil.CONN_LISTEN and c.laddr.port == http_port for c in p.net_connections("tcp"))
    client = openai.OpenAI(base_url=f"http://{fronts.extra['http']}/v1", api_key="none", max_retries=0, timeout=60)

    def complete(_: int) -> str:
        chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(complete, range(16)))
    assert len(set(texts)) == 1 and texts[0]


def test_abort_reaches_a_request_on_the_other_process(fronts: Child) -> None:
    procs = _procs(fronts)
    by_owner: dict[int, grpc.Channel] = {}
    for _ in range(64):
        channel, pid = _connect(fronts.address, procs)
        if pid in by_owner:
            channel.close()
        else:
            by_owner[pid] = channel
        if len(by_owner) == 2:
            break
    runs, other = (by_owner[p.pid] for p in procs)
    try:
        rid = "fronts-abort-1"
        long = pb.GenerateRequest(
            request_id=rid, text=PROMPT, stream=True,
            sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=1900, ignore_eos=True),
        )  # fmt: skip
        stream = pgrpc.StrataStub(runs).Generate(long, timeout=60)
        first = next(stream)
        assert first.token_ids
        # The other process does not run it: it passes the abort to the scheduler.
        assert pgrpc.StrataStub(other).Abort(pb.AbortRequest(request_id=rid), timeout=10).aborted
        rest = list(stream)
        assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
        assert sum(len(r.token_ids) for r in [first, *rest]) < 1900
        assert not pgrpc.StrataStub(other).Abort(pb.AbortRequest(request_id="no-such-request"), timeout=10).aborted
    finally:
        for c in by_owner.values():
            c.close()


def test_a_front_process_that_dies_stops_the_tokenizer(fronts: Child) -> None:
    _, second = _procs(fronts)
    second.send_signal(signal.SIGKILL)
    assert fronts.proc is not None
    assert fronts.proc.wait(30) != 0
    assert "front process 1" in fronts.log_path.read_text()


def test_the_others_end_when_the_first_is_killed(openai_stack: Stack, tiny_qwen3: Path, tmp_path: Path) -> None:
    child = _start(openai_stack, tiny_qwen3, tmp_path)
    try:
        first, second = _procs(child)
        first.send_signal(signal.SIGKILL)
        second.wait(15)  # SIGTERM from the kernel (parent death), then a clean stop; else TimeoutExpired
        assert not second.is_running()
    finally:
        child.stop()
