"""A small synchronous client of ``strata.v1.Strata`` (used by ``strata generate`` and ``strata up``)."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

import grpc

from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc

FINISH_NAMES = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in pb.FinishReason.items()}


class ClientError(Exception):
    """A failed call, as one line: ``STATUS: message``."""


def _one_line(e: grpc.RpcError) -> ClientError:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    name = code.name if code is not None else "ERROR"
    if code == grpc.StatusCode.UNAVAILABLE and "connect" in (details or ""):
        details = f"{details} (is Strata running? start it with `strata up --model DIR`)"
    return ClientError(f"{name}: {details}")


def _channel(address: str, ca: str) -> grpc.Channel:
    if not ca:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(ca).read_bytes()))


def generate(
    address: str,
    request: pb.GenerateRequest,
    key: str = "",
    out: TextIO | None = None,
    timeout_s: float = 120.0,
    ca: str = "",
) -> pb.GenerateResponse:
    """Stream ``request``, writing text to ``out`` as it arrives; returns the last response with
    the whole text and ids filled in. ``ca``: TLS, verifying the server against this CA (PEM
    file). Raises ``ClientError`` with the server's status."""
    request.stream = True
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    total = pb.GenerateResponse()
    try:
        with _channel(address, ca) as channel:
            for resp in pgrpc.StrataStub(channel).Generate(request, timeout=timeout_s, metadata=metadata):
                total.token_ids.extend(resp.token_ids)
                total.text += resp.text
                if out is not None and resp.text:
                    out.write(resp.text)
                    out.flush()
                if resp.finish_reason:
                    total.finish_reason = resp.finish_reason
                    total.usage.CopyFrom(resp.usage)
                    total.error = resp.error
                    total.request_id = resp.request_id
    except grpc.RpcError as e:
        raise _one_line(e) from None
    if out is not None:
        u = total.usage
        out.write(
            f"\n[finish={FINISH_NAMES[total.finish_reason]} prompt={u.prompt_tokens} "
            f"completion={u.completion_tokens} cached={u.cached_tokens}]\n"
        )
    return total


def generate_text(
    address: str,
    text: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    chat: bool = False,
    seed: int | None = None,
    out: TextIO | None = None,
    timeout_s: float = 120.0,
    key: str = "",
    ca: str = "",
) -> pb.GenerateResponse:
    """One prompt, as text or as a user chat message."""
    sampling = pb.SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    if seed is not None:
        sampling.seed = seed
    req = pb.GenerateRequest(sampling=sampling)
    if chat:
        req.messages.messages.add(role="user", content=text)
    else:
        req.text = text
    return generate(address, req, key, out, timeout_s, ca)


def show_cache_example(address: str, prompt: str, key: str = "", out: TextIO | None = None, ca: str = "") -> None:
    """Send ``prompt`` twice, greedy: the second reply reports the prompt pages the cache kept."""
    shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
    for attempt in ("first", "again"):
        if out is not None:
            out.write(f'\nexample ({attempt}): strata generate --address {address} "{shown}"\n')
        generate_text(address, prompt, max_new_tokens=16, temperature=0.0, out=out, key=key, ca=ca)
