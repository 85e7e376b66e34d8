"""The floor under the tokenizer's fronts: what a bare streaming server costs per message.

    python benchmarks/front_floor.py [--streams 256] [--messages 256] [--repeats 2]

A server that does nothing but stream: grpc.aio with a unary-stream handler yielding a small
``GenerateResponse`` (on asyncio and on uvloop), and uvicorn + FastAPI's ``StreamingResponse``
sending 60-byte SSE events (asyncio or uvloop, h11 or httptools). Its CPU (user + system, from
/proc) over ``--streams`` concurrent streams of ``--messages`` each, from a client in this
process, divided by the messages: the part of the tokenizer's CPU per token (``make
bench-overhead``) that no work of ours can remove while each token is its own message.
``--paced-ms``: the gRPC handlers yield all at once every so many ms (a decode step), instead of
as fast as the client reads.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

EVENT = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"ab"}]}\n\n'


def _grpc_server(port_out: Any, loop: str, messages: int, paced_s: float) -> None:
    import grpc
    import uvloop

    from strata.v1 import strata_pb2 as pb
    from strata.v1 import strata_pb2_grpc as pgrpc

    tick: list[asyncio.Future[None]] = []

    async def next_step() -> None:
        if not tick or tick[0].done():
            running = asyncio.get_running_loop()
            tick[:] = [running.create_future()]
            running.call_later(paced_s, tick[0].set_result, None)
        await tick[0]

    class Streamer(pgrpc.StrataServicer):
        async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
            for i in range(messages):
                await (next_step() if paced_s > 0 else asyncio.sleep(0))
                yield pb.GenerateResponse(token_ids=[i], text="ab")

    async def main() -> None:
        server = grpc.aio.server()
        pgrpc.add_StrataServicer_to_server(Streamer(), server)
        port_out.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main()) if loop == "uvloop" else asyncio.run(main())


def _http_server(port_out: Any, loop: str, http: str, messages: int) -> None:
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            for _ in range(messages):
                await asyncio.sleep(0)
                yield EVENT

        return StreamingResponse(events(), media_type="text/event-stream")

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    port_out.put(sock.getsockname()[1])
    config = uvicorn.Config(app, log_level="warning", access_log=False, loop=loop, http=http, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


async def _grpc_client(port: int, streams: int) -> int:
    import grpc

    from strata.v1 import strata_pb2 as pb
    from strata.v1 import strata_pb2_grpc as pgrpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pgrpc.StrataStub(channel)

        async def one() -> int:
            return sum([1 async for _ in stub.Generate(pb.GenerateRequest())])

        return sum(await asyncio.gather(*[one() for _ in range(streams)]))


async def _http_client(port: int, streams: int) -> int:
    import httpx2

    limits = httpx2.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx2.AsyncClient(limits=limits, timeout=300) as client:

        async def one() -> int:
            async with client.stream("GET", f"http://127.0.0.1:{port}/stream") as r:
                return sum([1 async for line in r.aiter_lines() if line.startswith("data:")])

        return sum(await asyncio.gather(*[one() for _ in range(streams)]))


def measure(kind: str, loop: str, http: str, a: argparse.Namespace) -> float:
    """Server CPU µs per message of one fresh server (after one unmeasured warm-up pass)."""
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    if kind == "grpc":
        proc = ctx.Process(target=_grpc_server, args=(ports, loop, a.messages, a.paced_ms / 1e3))
    else:
        proc = ctx.Process(target=_http_server, args=(ports, loop, http, a.messages))
    proc.start()
    try:
        port = ports.get(timeout=60)
        client = _grpc_client if kind == "grpc" else _http_client
        for _ in range(50):  # uvicorn listens once its server has started
            try:
                asyncio.run(client(port, a.streams))
                break
            except Exception:  # not up yet
                time.sleep(0.1)
        server = psutil.Process(proc.pid)
        before = server.cpu_times()
        n = asyncio.run(client(port, a.streams))
        after = server.cpu_times()
        return 1e6 * (after.user - before.user + after.system - before.system) / n
    finally:
        proc.kill()
        proc.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--messages", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--paced-ms", type=float, default=0.0, help="gRPC: yield every so many ms, all streams at once")
    a = p.parse_args(argv)
    cases = [("grpc", "asyncio", ""), ("grpc", "uvloop", ""), ("http", "asyncio", "h11"),
             ("http", "uvloop", "httptools"), ("http", "asyncio", "httptools"), ("http", "uvloop", "h11")]  # fmt: skip
    results: dict[tuple[str, str, str], list[float]] = {c: [] for c in cases}
    for _ in range(a.repeats):  # alternated
        for case in cases:
            results[case].append(measure(*case, a))
            print(f"  {' '.join(x for x in case if x)}: {results[case][-1]:.1f} µs/message", flush=True)
    print(f"\n{a.streams} streams × {a.messages} messages, server CPU µs per message (each run)")
    for case, us in results.items():
        print(f"| {' + '.join(x for x in case if x)} | {' · '.join(f'{u:.1f}' for u in us)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
