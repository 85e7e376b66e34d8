"""``PoolResize`` over the wire: the codec round-trips the op, the acknowledgement and the new
``WorkerInfo`` fields, and over real gRPC a bad resize is ``INVALID_ARGUMENT`` with pools intact.
The codec also round-trips the hierarchical-cache ops (KV and Mamba-state ones), their job
acknowledgements and the host-pool fields of ``WorkerInfo``."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import pytest

from services.common import step_codec
from services.common.server import Server
from services.common.step import (
    CacheOp,
    HostBackup,
    HostLoad,
    JobResult,
    L3Get,
    L3Put,
    MambaCopy,
    PoolResize,
    ReleaseRow,
    ReqInput,
    StateBackup,
    StateLoad,
    StepRequest,
    StepResult,
    WorkerInfo,
)
from services.worker.engine import Engine, EngineConfig
from services.worker.server import WorkerServicer
from strata.worker.v1 import worker_pb2 as wpb
from strata.worker.v1 import worker_pb2_grpc as wgrpc


@pytest.fixture(scope="module")
def engine(tiny_qwen3: Path) -> Engine:
    return Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=64 << 10, kv_max_bytes=256 << 10, max_rows=4))


def test_codec_round_trips_resize_ack_and_info(engine: Engine) -> None:
    step = StepRequest(7, [PoolResize(1 << 33, 12), MambaCopy(1, 2), PoolResize(0, 0), ReleaseRow(3)])
    assert step_codec.step_from_pb(step_codec.step_to_pb(step)) == step
    result = StepResult(7, ops_done=4, forward_s=0.5, num_slots=1 << 33, num_mamba_slots=12,
                        kv_committed_bytes=3 << 40, mamba_committed_bytes=4096)
    assert step_codec.result_from_pb(step_codec.result_to_pb(result)) == result
    info = dataclasses.replace(engine.info, max_mamba_slots=48, mamba_slot_granularity=8, elastic=False)
    assert step_codec.info_from_pb(step_codec.info_to_pb(info)) == info


def test_codec_round_trips_host_and_state_ops_and_info() -> None:
    key = bytes(range(32))
    ops: list[CacheOp] = [
        HostBackup(1, (0, 1, 2, 3), (5,)),
        HostLoad(2, (5,), (8, 9, 10, 11)),
        StateBackup(3, (7, 0), (2, 1 << 20)),
        StateLoad(4, (1 << 20,), (3,)),
        StateBackup(5, (), ()),
        L3Put(6, (5,), (key,)),
        L3Put(7, (2,), (key,), states=True),
        L3Get(8, (key,), (4,)),
        L3Get(9, (key, key[::-1]), (1, 0), states=True),
    ]
    step = StepRequest(8, ops)
    assert step_codec.step_from_pb(step_codec.step_to_pb(step)) == step
    assert step_codec.step_to_pb(step).ops[6].l3_put.states  # a states put stays one on the wire
    result = StepResult(8, ops_done=len(ops), jobs=[JobResult(j, j % 2 == 0, j) for j in range(1, 10)])
    assert step_codec.result_from_pb(step_codec.result_to_pb(result)) == result
    info = WorkerInfo(
        "m", "Qwen3NextForCausalLM", "ab", 768, 2048, (2,), 100, 64, 1, 4, 12, 11264, "float32", True, "cpu",
        100, 12, 1, 4, 4096, False, host_pages=9, host_page_tokens=64, kv_layout="page-first/x/tp0of1", l3=True,
        host_states=23, state_layout="state-first/L2/conv128x3:float32/ssm4x16x16:float32/tp0of1",
    )
    assert step_codec.info_from_pb(step_codec.info_to_pb(info)) == info
    dense = dataclasses.replace(info, host_states=0, state_layout="")
    assert step_codec.info_from_pb(step_codec.info_to_pb(dense)) == dense


def test_resize_over_grpc_acknowledged_and_bad_ones_refused(engine: Engine) -> None:
    async def main() -> None:
        server = Server()
        server.add(wgrpc.add_WorkerServicer_to_server, WorkerServicer(engine), "strata.worker.v1.Worker")
        port = await server.start("127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = wgrpc.WorkerStub(ch)
                info = step_codec.info_from_pb(await stub.GetInfo(wpb.GetInfoRequest()))
                assert (info.num_slots, info.max_slots, info.slot_granularity, info.elastic) == (64, 256, 32, True)

                call = stub.Step()
                grow = StepRequest(1, [PoolResize(256, 0)], [ReqInput("r", 0, [5, 6], 0, [254, 255])])
                await call.write(step_codec.step_to_pb(grow))
                res = step_codec.result_from_pb(await call.read())
                assert (res.num_slots, res.kv_committed_bytes, len(res.outputs)) == (
                    256, engine.kv.committed_bytes, 1)
                await call.write(step_codec.step_to_pb(StepRequest(2, [PoolResize(128, 0)])))
                res = step_codec.result_from_pb(await call.read())
                assert res.num_slots == 128 and res.kv_committed_bytes == engine.kv.committed_bytes
                await call.done_writing()

                k0 = engine.kv.k[0][:128].clone()
                committed = engine.kv.committed_bytes
                for bad, detail in ((PoolResize(288, 0), "KV capacity 288 outside [0, 256] (max_slots)"),
                                    (PoolResize(100, 0), "not a multiple of the slot granularity 32"),
                                    (PoolResize(64, 2), "the model has no Mamba state")):
                    call = stub.Step()
                    await call.write(step_codec.step_to_pb(StepRequest(3, [bad])))
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call.read()
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert detail in (err.value.details() or "")
                assert engine.kv.num_slots == 128 and engine.kv.committed_bytes == committed
                assert bool((engine.kv.k[0][:128] == k0).all())
        finally:
            await server.stop(0)

    asyncio.run(main())
