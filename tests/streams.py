"""Concurrent streams through the public API, for the tests that kill a service under load and
check that every stream resumes with the tokens of an uninterrupted run (issue #29)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from strata.v1 import strata_pb2 as pb
from strata.v1 import strata_pb2_grpc as pgrpc

# A grammar the tiny random model can follow for a while (it ends by the grammar or by length).
REGEX = r"[a-z]{2,8}@(cache|page)\.(com|org)( [a-z]{1,12}){0,40}"


def mixed(n: int, max_new_tokens: int, seeded: int = 2, constrained: int = 2) -> list[pb.GenerateRequest]:
    """``n`` streaming requests with distinct prompts: the last ``seeded + constrained`` sample at
    temperature 0.9 with a fixed seed (the constrained ones under ``REGEX``), the rest greedy."""
    reqs = []
    for i in range(n):
        sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
        kw: dict[str, str] = {}
        if i >= n - seeded - constrained:
            sampling = pb.SamplingParams(temperature=0.9, seed=29 + i, max_new_tokens=max_new_tokens, ignore_eos=True)
        if i >= n - constrained:
            sampling.ignore_eos = False
            kw["regex"] = REGEX
        ids = [5 + i, 17, 33 + 2 * i, 9, 100 + i, 7 + i]
        reqs.append(pb.GenerateRequest(input_ids=pb.TokenIds(ids=ids), sampling=sampling, stream=True, **kw))
    return reqs


@dataclass(slots=True)
class Stream:
    """What one request streamed: ids, arrival times, its final usage, or the error it ended with."""

    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    usage: pb.Usage | None = None
    finish: int = 0
    error: grpc.StatusCode | None = None

    def gap_after(self, t: float) -> float:
        """Seconds from ``t`` to the first token after it (the stream's resume latency)."""
        return next((x for x in self.times if x > t), float("inf")) - t


def run(
    api: pgrpc.StrataStub, reqs: list[pb.GenerateRequest], during: Callable[[list[Stream]], None] | None = None,
    timeout_s: float = 120.0,
) -> list[Stream]:
    """Run ``reqs`` at once, one thread each; ``during(streams)`` runs meanwhile (to kill something),
    then every stream is waited for."""
    streams = [Stream() for _ in reqs]

    def one(req: pb.GenerateRequest, s: Stream) -> None:
        try:
            for r in api.Generate(req, timeout=timeout_s):
                s.ids += r.token_ids
                s.times.append(time.monotonic())
                if r.finish_reason:
                    s.usage, s.finish = r.usage, r.finish_reason
        except grpc.RpcError as e:
            s.error = e.code()

    threads = [threading.Thread(target=one, args=(r, s), daemon=True) for r, s in zip(reqs, streams, strict=True)]
    for t in threads:
        t.start()
    try:
        if during is not None:
            during(streams)
    finally:
        for t in threads:
            t.join(timeout_s)
    return streams


def wait_streaming(streams: list[Stream], tokens: int, timeout_s: float = 60.0) -> None:
    """Until every stream has at least ``tokens`` tokens (or ended)."""
    deadline = time.monotonic() + timeout_s
    while any(len(s.ids) < tokens and not s.finish and s.error is None for s in streams):
        assert time.monotonic() < deadline, [len(s.ids) for s in streams]
        time.sleep(0.01)
