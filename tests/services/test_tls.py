"""TLS on the public ports and mutual TLS between services, with API keys, on real processes.

Generation through TLS equals transformers; a client without the key gets UNAUTHENTICATED; a
client (or service) whose certificate another CA signed, or that brings none, cannot reach an
internal service; HTTPS serves the OpenAI API with the same certificates; etcd itself serves TLS
and requires a client certificate of the CA (the stack registers and discovers through it).
"""

from __future__ import annotations

import json
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.etcd_proc import free_port
from services.common.tls import TlsFiles, make_dev_certs
from services.supervisor import Stack, start_stack
from strata.kvstore.v1 import kvstore_pb2 as kpb
from strata.kvstore.v1 import kvstore_pb2_grpc as kgrpc
from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc
from tests.reference import hf_greedy, hf_tokenizer

KEY = "sk-tls"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_dev_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def stack(tiny_qwen3: Path, certs: TlsFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    common = ("--tls-cert", certs.cert, "--tls-key", certs.key, "--tls-ca", certs.ca)
    s = start_stack(
        tiny_qwen3, free_port(), tmp_path_factory.mktemp("tls-stack"), common_args=common, http_port=free_port(),
        tokenizer_args=("--api-key", KEY), say=lambda _: None, etcd_tls=certs, grammar_preload=False,
    )  # fmt: skip
    yield s
    s.stop()


def _creds(files: TlsFiles, client_cert: bool) -> grpc.ChannelCredentials:
    read = lambda p: Path(p).read_bytes()  # noqa: E731
    if client_cert:
        return grpc.ssl_channel_credentials(read(files.ca), read(files.key), read(files.cert))
    return grpc.ssl_channel_credentials(read(files.ca))


def test_generation_through_tls_equals_transformers(stack: Stack, certs: TlsFiles, tiny_qwen3: Path) -> None:
    tok = hf_tokenizer(str(tiny_qwen3))
    want = hf_greedy(tiny_qwen3, tok.encode("The cache keeps", add_special_tokens=False), 16)
    req = pb.GenerateRequest(text="The cache keeps", sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=16))
    with grpc.secure_channel(stack.child("tokenizer").address, _creds(certs, client_cert=False)) as ch:
        api = pgrpc.StrataStub(ch)
        out = list(api.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60))
        assert [t for r in out for t in r.token_ids] == want
        with pytest.raises(grpc.RpcError) as e:
            list(api.Generate(req, timeout=60))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_clients_cannot_reach_a_tls_port(stack: Stack) -> None:
    with grpc.insecure_channel(stack.child("tokenizer").address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pgrpc.StrataStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("who", ["no certificate", "another CA", "plaintext"])
def test_internal_services_require_a_certificate_from_the_ca(
    stack: Stack, certs: TlsFiles, tmp_path: Path, who: str
) -> None:
    """The kvstore stands for every internal port: only the services' CA gets in."""
    address = stack.child("kvstore").address
    if who == "plaintext":
        ch = grpc.insecure_channel(address)
    elif who == "no certificate":
        ch = grpc.secure_channel(address, _creds(certs, client_cert=False))
    else:
        rogue = make_dev_certs(tmp_path / "rogue")
        # trusts the real CA (so the server's certificate passes) but presents a rogue certificate
        creds = grpc.ssl_channel_credentials(
            Path(certs.ca).read_bytes(), Path(rogue.key).read_bytes(), Path(rogue.cert).read_bytes()
        )
        ch = grpc.secure_channel(address, creds)
    with ch, pytest.raises(grpc.RpcError) as e:
        kgrpc.KVStoreStub(ch).Stats(kpb.StatsRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(address, _creds(certs, client_cert=True)) as ok:
        assert kgrpc.KVStoreStub(ok).Stats(kpb.StatsRequest(), timeout=5).capacity_bytes > 0


def test_https_serves_the_openai_api(stack: Stack, certs: TlsFiles) -> None:
    https = stack.child("tokenizer").extra["https"]
    ctx = ssl.create_default_context(cafile=certs.ca)
    body = json.dumps({"model": stack.child("tokenizer").extra.get("model", "qwen3-tiny"), "prompt": "hi",
                       "max_tokens": 3}).encode()
    with urllib.request.urlopen(f"https://{https}/health", context=ctx, timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok"}
    models = urllib.request.Request(f"https://{https}/v1/models", headers={"authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(models, context=ctx, timeout=10) as r:
        name = json.loads(r.read())["data"][0]["id"]
    req = urllib.request.Request(
        f"https://{https}/v1/completions", data=body.replace(b"qwen3-tiny", name.encode()),
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, context=ctx, timeout=60) as r:
        assert json.loads(r.read())["usage"]["completion_tokens"] == 3


def test_etcd_over_tls_requires_a_certificate_of_the_ca(stack: Stack, certs: TlsFiles, tmp_path: Path) -> None:
    """The stack above registered every service through an https:// etcd; a client without a
    certificate (or plaintext) cannot read it, one with the CA's certificate can."""
    import asyncio

    from services.common import tls
    from services.common.discovery import Discovery

    assert stack.etcd is not None and stack.etcd_endpoint.startswith("https://")

    async def members(endpoint: str) -> set[str]:
        d = Discovery(endpoint, "scheduler")
        await asyncio.wait_for(d.start(timeout=3.0), 5.0)
        try:
            return {r.address for r in d.members().values()}
        finally:
            await d.stop()

    before = tls.files()
    try:
        tls.configure(certs)
        assert asyncio.run(members(stack.etcd_endpoint)) == {stack.child("scheduler").address}
        other = make_dev_certs(tmp_path / "other")  # a certificate another CA signed
        tls.configure(TlsFiles(other.cert, other.key, certs.ca))
        with pytest.raises(Exception):  # noqa: B017 - refused during the TLS handshake, whatever aetcd raises
            asyncio.run(members(stack.etcd_endpoint))
        tls.configure(certs)
        plain = stack.etcd_endpoint.removeprefix("https://")
        with pytest.raises(Exception):  # noqa: B017 - a plaintext client gets no answer
            asyncio.run(members(plain))
    finally:
        tls.configure(before)


@pytest.mark.parametrize("name", ["kvstore", "worker", "scheduler", "tokenizer"])
def test_the_health_check_speaks_tls(stack: Stack, certs: TlsFiles, name: str) -> None:
    """compose.tls.yaml's health checks: SERVING over mutual TLS, refused without it."""
    from services.healthcheck import main

    address = stack.child(name).address
    with pytest.raises(SystemExit) as ok:
        main([address, "--tls-ca", certs.ca, "--tls-cert", certs.cert, "--tls-key", certs.key])
    assert ok.value.code == 0
    with pytest.raises(SystemExit) as plain:
        main([address])
    assert plain.value.code == 1
