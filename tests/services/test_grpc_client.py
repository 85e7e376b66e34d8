"""`strata grpc list|describe|call` against a real tokenizer process (API keys on) whose scheduler is
an in-test fake that echoes the prompt ids back one per response (so Generate really streams)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection

from services.grpc_client import run_reflection_command
from strata.kvstore.v1 import kvstore_pb2_grpc
from strata.scheduler.v1 import scheduler_pb2 as spb
from strata.scheduler.v1 import scheduler_pb2_grpc as sgrpc
from strata.v1 import strata_pb2 as pb
from tests.conftest import REPO

KEY = "grpc-client-test-key"
AUTH = [("authorization", f"Bearer {KEY}")]
DEAD = "127.0.0.1:1"  # nothing listens on port 1


class EchoScheduler(sgrpc.SchedulerServicer):
    def Generate(self, request: spb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[spb.GenerateResponse]:
        ids = list(request.input_ids)
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            yield spb.GenerateResponse(
                request_id=request.request_id,
                token_ids=[t],
                finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                usage=pb.Usage(prompt_tokens=len(ids), completion_tokens=len(ids)) if last else None,
            )

    def Session(
        self, request_iterator: Iterator[spb.SessionRequest], context: grpc.ServicerContext
    ) -> Iterator[spb.SessionEvents]:
        """What the tokenizer calls: Generate's echo per submission, one message per id, paced so
        that each reaches the client as a response of its own."""
        for m in request_iterator:
            if m.WhichOneof("kind") != "submit":
                continue
            ids, h = list(m.submit.request.input_ids), m.submit.handle
            usage = pb.Usage(prompt_tokens=len(ids), completion_tokens=len(ids))
            for i, t in enumerate(ids):
                time.sleep(0.05)
                msg = spb.SessionEvents(handles=[h], counts=[1], token_ids=[t])
                if i == len(ids) - 1:
                    msg.ends.append(spb.RequestEnd(handle=h, finish_reason=pb.FINISH_REASON_LENGTH, usage=usage))
                yield msg


@pytest.fixture(scope="module")
def scheduler() -> Iterator[str]:
    """The fake scheduler; it also serves an unimplemented KVStore (a client-streaming method) and
    reflection, for the commands that need a service the tokenizer lacks."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sgrpc.add_SchedulerServicer_to_server(EchoScheduler(), server)
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(kvstore_pb2_grpc.KVStoreServicer(), server)
    names = ["strata.scheduler.v1.Scheduler", "strata.kvstore.v1.KVStore", reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path, scheduler: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("grpc-client") / "tokenizer.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.tokenizer", "--model", str(tiny_qwen3), "--scheduler", scheduler,
             "--port", "0", "--http-port", "0", "--api-key", KEY, "--model-name", "tiny"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while not (ready := [ln for ln in log.read_text().splitlines() if ln.startswith("READY tokenizer ")]):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield ready[0].split()[2]
    finally:
        proc.terminate()
        proc.wait(10)


def run(capsys: pytest.CaptureFixture[str], address: str, action: str, target: str = "", body: str = "{}",
        **kw: object) -> tuple[int, list[str], str]:
    code = run_reflection_command(address, action, target, body, **kw)  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_list_and_describe(tokenizer: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, tokenizer, "list")
    assert code == 0
    assert set(out) == {"strata.v1.Strata", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}

    code, out, _ = run(capsys, tokenizer, "describe", "strata.v1.Strata")
    assert code == 0
    assert "rpc Generate(strata.v1.GenerateRequest) returns (stream strata.v1.GenerateResponse)" in out
    assert "rpc GetModelInfo(strata.v1.GetModelInfoRequest) returns (strata.v1.ModelInfo)" in out
    assert len(out) == 5

    code, out, _ = run(capsys, tokenizer, "describe", "strata.v1.Strata/Tokenize")
    assert (code, out) == (0, ["rpc Tokenize(strata.v1.TokenizeRequest) returns (strata.v1.TokenizeResponse)"])


def test_unary_calls_with_api_key(tokenizer: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, tokenizer, "call", "strata.v1.Strata/GetModelInfo", metadata=AUTH)
    assert code == 0 and len(out) == 1
    assert json.loads(out[0])["name"] == "tiny"

    code, out, _ = run(capsys, tokenizer, "call", "strata.v1.Strata/Tokenize", '{"text": "hello world"}', metadata=AUTH)
    ids = json.loads(out[0])["ids"]
    code, out, _ = run(capsys, tokenizer, "call", "strata.v1.Strata/Detokenize", json.dumps({"ids": ids}),
                       metadata=AUTH)
    assert code == 0 and json.loads(out[0]) == {"text": "hello world"}


def test_server_streaming_generate(tokenizer: str, capsys: pytest.CaptureFixture[str]) -> None:
    body = json.dumps({"inputIds": {"ids": [5, 6, 7]}, "stream": True, "sampling": {"maxNewTokens": 3}})
    code, out, err = run(capsys, tokenizer, "call", "strata.v1.Strata/Generate", body, metadata=AUTH)
    assert code == 0, err
    responses = [json.loads(line) for line in out]
    assert [r["tokenIds"] for r in responses] == [[5], [6], [7]]  # one JSON line per streamed response
    assert responses[-1]["finishReason"] == "FINISH_REASON_LENGTH"
    assert responses[-1]["usage"]["completionTokens"] == 3


def test_errors_are_one_line_and_nonzero(tokenizer: str, scheduler: str, capsys: pytest.CaptureFixture[str]) -> None:
    def fails(expect: int, *args: str, **kw: object) -> str:
        code, out, err = run(capsys, *args, **kw)
        assert code == expect and out == [] and err.count("\n") == 1 and err.startswith("strata grpc: "), err
        return err

    assert "UNAUTHENTICATED: missing API key" in fails(1, tokenizer, "call", "strata.v1.Strata/GetModelInfo")
    wrong = [("authorization", "Bearer nope")]
    assert "UNAUTHENTICATED: invalid API key" in fails(1, tokenizer, "call", "strata.v1.Strata/Tokenize",
                                                      metadata=wrong)
    # The server's own status comes through unchanged.
    err = fails(1, tokenizer, "call", "strata.v1.Strata/Detokenize", '{"ids": [99999999]}', metadata=AUTH)
    assert "INVALID_ARGUMENT: ids: 99999999 is out of range" in err
    assert "UNAVAILABLE: failed to connect to all addresses" in fails(1, DEAD, "list")
    assert "UNAVAILABLE: failed to connect to all addresses" in fails(1, DEAD, "call", "strata.v1.Strata/GetModelInfo")

    err = fails(2, tokenizer, "describe", "strata.v1.Nope")
    assert "unknown service strata.v1.Nope" in err and "strata.v1.Strata" in err
    err = fails(2, tokenizer, "call", "strata.v1.Strata/Generat", metadata=AUTH)
    assert "no method 'Generat' in strata.v1.Strata" in err and "Generate, Tokenize" in err
    assert "give a service" in fails(2, tokenizer, "call")
    assert "not a strata.v1.TokenizeRequest" in fails(2, tokenizer, "call", "strata.v1.Strata/Tokenize", '{"txt": 1}')
    assert "not a strata.v1.TokenizeRequest" in fails(2, tokenizer, "call", "strata.v1.Strata/Tokenize", "{")
    assert "takes a request stream" in fails(2, scheduler, "call", "strata.kvstore.v1.KVStore/Put")


def test_client_streaming_is_described(scheduler: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, scheduler, "describe", "strata.kvstore.v1.KVStore/Put")
    assert (code, out) == (0, ["rpc Put(stream strata.kvstore.v1.PutRequest) returns (strata.kvstore.v1.PutResponse)"])


def test_cli_exit_status_without_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "grpc", "list", "--address", DEAD],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("strata grpc: UNAVAILABLE: failed to connect to all addresses"), proc.stderr
    assert "Traceback" not in proc.stderr
