"""The worker over real gRPC: bad steps are refused with INVALID_ARGUMENT before any pool is
touched, and the worker keeps serving new streams."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from services.common import step_codec
from services.common.server import Server
from services.common.step import ReqInput, StepRequest
from services.worker.engine import Engine, EngineConfig
from services.worker.server import WorkerServicer
from strata.worker.v1 import worker_pb2 as wpb
from strata.worker.v1 import worker_pb2_grpc as wgrpc


@pytest.fixture(scope="module")
def engine(tiny_qwen3: Path) -> Engine:
    return Engine(tiny_qwen3, EngineConfig(kv_cache_bytes=1 << 20, max_rows=4))


def _bad_steps(e: Engine) -> dict[str, StepRequest]:
    n, v = e.info.num_slots, e.info.vocab_size
    ok = dict(request_id="r", row=0, input_ids=[5, 6], start_pos=0, new_slots=[0, 1])
    return {
        "slot out of range": StepRequest(1, reqs=[ReqInput(**{**ok, "new_slots": [0, n]})]),
        "row out of range": StepRequest(1, reqs=[ReqInput(**{**ok, "row": 99})]),
        "token beyond vocab": StepRequest(1, reqs=[ReqInput(**{**ok, "input_ids": [5, v]})]),
        "slots/ids length mismatch": StepRequest(1, reqs=[ReqInput(**{**ok, "new_slots": [0]})]),
        "bitmask wrong size": StepRequest(1, reqs=[ReqInput(**{**ok, "token_bitmask": b"\x01\x00"})]),
        "prefix length mismatch": StepRequest(1, reqs=[ReqInput(**{**ok, "start_pos": 2, "prefix_slots": [3]})]),
        "next prompt token beyond vocab": StepRequest(
            1, reqs=[ReqInput(**ok, sample=False, prompt_logprobs=True, next_prompt_id=v)]
        ),
        "scoring a decode": StepRequest(
            1, reqs=[ReqInput(**{**ok, "input_ids": [], "new_slots": [0]}, use_last_sample=True, prompt_logprobs=True)]
        ),
    }


def _malformed_messages() -> dict[str, wpb.StepRequest]:
    """Steps whose columns do not describe one batch, keyed by the field the error must name."""
    msgs = {}
    for field in ("batch.start_pos", "batch.new_slots", "batch.sampling_index"):
        msg = step_codec.step_to_pb(StepRequest(1, reqs=[ReqInput("r", 0, [5, 6], 0, [0, 1])]))
        column = getattr(msg.batch, field.split(".")[1])
        column.append(column[-1])
        msgs[field] = msg
    chunk = ReqInput("r", 0, [5, 6], 0, [0, 1], sample=False, prompt_logprobs=True, next_prompt_id=7)
    scoring = step_codec.step_to_pb(StepRequest(1, reqs=[chunk]))
    scoring.batch.flags[0] = wpb.REQ_FLAG_NONE  # a next prompt token for a chunk that does not score
    msgs["batch.extras[0].next_prompt_id"] = scoring
    return msgs


def test_bad_steps_are_invalid_argument_and_pools_survive(engine: Engine) -> None:
    async def main() -> None:
        server = Server()
        server.add(wgrpc.add_WorkerServicer_to_server, WorkerServicer(engine), "strata.worker.v1.Worker")
        port = await server.start("127.0.0.1:0")
        k0 = engine.kv.k[0].clone()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = wgrpc.WorkerStub(ch)
                for name, step in _bad_steps(engine).items():
                    call = stub.Step()
                    await call.write(step_codec.step_to_pb(step))
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call.read()
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                    assert err.value.details(), name
                for name, msg in _malformed_messages().items():
                    call = stub.Step()
                    await call.write(msg)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call.read()
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                    assert name in err.value.details(), (name, err.value.details())
                assert bool((engine.kv.k[0] == k0).all())  # nothing was written
                # A good step on a fresh stream still works.
                call = stub.Step()
                good = StepRequest(2, reqs=[ReqInput("r", 0, [5, 6], 0, [0, 1])])
                await call.write(step_codec.step_to_pb(good))
                res = await call.read()
                assert isinstance(res, wpb.StepResult) and len(res.token_ids) == 1
                # A chunk that scores its prompt: its positions' scores come back in the result.
                chunk = ReqInput("s", 1, [5, 6, 7], 0, [2, 3, 4], top_logprobs=2, prompt_logprobs=True)
                await call.write(step_codec.step_to_pb(StepRequest(3, reqs=[chunk])))
                got = step_codec.result_from_pb(await call.read()).prompt[0]
                assert [lp.token_id for lp in got.logprobs] == [6, 7] and len(res.token_ids) == 1
                assert all(len(lp.top) == 2 for lp in got.logprobs) and min(got.ranks) >= 1
                await call.done_writing()
        finally:
            await server.stop(0)

    asyncio.run(main())
