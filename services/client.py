"""A small synchronous client of ``strata.v1.Strata`` (used by ``strata generate`` and ``strata up``)."""

from __future__ import annotations

from typing import TextIO

import grpc

from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc

FINISH_NAMES = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in pb.FinishReason.items()}


def generate_text(
    address: str,
    text: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    chat: bool = False,
    seed: int | None = None,
    out: TextIO | None = None,
    timeout_s: float = 120.0,
) -> pb.GenerateResponse:
    """Stream a completion, writing text to ``out`` as it arrives; returns the last response
    with the whole text and ids filled in."""
    sampling = pb.SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    if seed is not None:
        sampling.seed = seed
    req = pb.GenerateRequest(sampling=sampling, stream=True)
    if chat:
        req.messages.messages.add(role="user", content=text)
    else:
        req.text = text
    total = pb.GenerateResponse()
    with grpc.insecure_channel(address) as channel:
        for resp in pgrpc.StrataStub(channel).Generate(req, timeout=timeout_s):
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
    if out is not None:
        u = total.usage
        out.write(
            f"\n[finish={FINISH_NAMES[total.finish_reason]} prompt={u.prompt_tokens} "
            f"completion={u.completion_tokens} cached={u.cached_tokens}]\n"
        )
    return total
