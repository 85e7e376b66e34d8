"""The pieces of ``--front-processes`` that need no processes: the port check before binding with
``SO_REUSEPORT``, each other process's configuration, the flags' validation, and an ``Abort``
passed to every scheduler (against in-process gRPC schedulers)."""

from __future__ import annotations

import argparse
import asyncio
import socket
import time

import grpc
import pytest

from services.common.config import ConfigError, add_arguments, from_args, to_args
from services.common.etcd_proc import free_port
from services.tokenizer import server as tokenizer_server
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.fronts import check_port_free, child_config
from services.tokenizer.router import Router
from services.tokenizer.server import StrataServicer
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc
from strata.v1 import strata_pb2 as pb
from tests.unit.test_stream_resume import CARD, Words


def _listener(reuse_port: bool) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_port_in_use_is_an_error_naming_it(reuse_port: bool) -> None:
    # A listener with SO_REUSEPORT (as every gRPC server by default) would share the port silently.
    with _listener(reuse_port) as s:
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # closed: free again


def test_child_config() -> None:
    cfg = TokenizerConfig(model="m", etcd="e:1", front_processes=3, metrics_port=9100, port=0)
    c = child_config(cfg, 2, grpc_port=50123, http_fd=7)
    assert (c.front_index, c.port, c.http_fd, c.metrics_port) == (2, 50123, 7, 9102)
    assert c.instance_id == "tokenizer-50123-2"
    assert child_config(TokenizerConfig(model="m", etcd="e:1", metrics_port=0), 1, 1, -1).metrics_port == 0
    assert child_config(TokenizerConfig(model="m", etcd="e:1", instance_id="t"), 1, 1, -1).instance_id == "t-1"
    # The flags a front process is started with rebuild its configuration.
    parser = argparse.ArgumentParser()
    add_arguments(parser, TokenizerConfig)
    assert from_args(TokenizerConfig, parser.parse_args(to_args(c))) == c


@pytest.mark.parametrize(("values", "field"), [({"front_processes": 0}, "front_processes"),
                                               ({"front_processes": 2, "front_index": 2}, "front_index"),
                                               ({"front_index": -1}, "front_index")])  # fmt: skip
def test_bad_front_flags_name_the_field(values: dict[str, int], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        TokenizerConfig(model="m", etcd="e:1", **values).validate()  # type: ignore[arg-type]


class _Scheduler(sgrpc.SchedulerServicer):
    """A scheduler that answers ``Abort`` with ``aborted`` after ``delay_s`` (a frozen one: long)."""

    def __init__(self, aborted: bool, delay_s: float = 0.0) -> None:
        self.aborted, self.delay_s, self.asked = aborted, delay_s, 0

    async def Abort(self, request: spb.AbortRequest, context: grpc.aio.ServicerContext) -> spb.AbortResponse:
        self.asked += 1
        await asyncio.sleep(self.delay_s)
        return spb.AbortResponse(aborted=self.aborted)


class _Schedulers(Router):
    def __init__(self, addresses: list[str]) -> None:
        super().__init__(fixed="-", policy="round_robin", wait_s=0.2)
        self.every = addresses

    def _addresses(self, role: str = "") -> list[str]:
        return list(self.every)


def test_an_abort_passed_to_every_scheduler_is_stopped_by_no_dead_or_frozen_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An id unknown to this front process may run on any scheduler: each is asked at once, a dead
    one (nothing listens) or a frozen one (no answer within the bound) is skipped, and the answer
    is an error only when none answered."""
    monkeypatch.setattr(tokenizer_server, "ABORT_TIMEOUT_S", 0.5)
    frozen, live = _Scheduler(False, delay_s=30.0), _Scheduler(True)

    async def run() -> tuple[pb.AbortResponse, float, grpc.StatusCode]:
        servers, addresses = [], []
        for s in (frozen, live):
            server = grpc.aio.server()
            sgrpc.add_SchedulerServicer_to_server(s, server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
        dead = f"127.0.0.1:{free_port()}"
        try:
            every = StrataServicer(Words(), CARD, _Schedulers([dead, *addresses]), shared_ids=True)
            t0 = time.monotonic()
            answer = await every.Abort(pb.AbortRequest(request_id="elsewhere"), None)  # type: ignore[arg-type]
            took = time.monotonic() - t0
            none = StrataServicer(Words(), CARD, _Schedulers([dead, addresses[0]]), shared_ids=True)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await none.Abort(pb.AbortRequest(request_id="elsewhere"), None)  # type: ignore[arg-type]
            return answer, took, e.value.code()
        finally:
            for server in servers:
                await server.stop(0)

    answer, took, code = asyncio.run(run())
    assert answer.aborted and live.asked == 1 and frozen.asked == 2
    assert took < 2.0, took  # bounded by the frozen one's timeout, not its 30 s
    assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
