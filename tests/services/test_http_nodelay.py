"""The HTTP front's connections run without Nagle's algorithm: with it on, every response's
second write (a body after its headers, an SSE chunk after the previous one) waited for the
client's delayed ACK, 40 ms on most requests of a keep-alive connection."""

from __future__ import annotations

import asyncio
import socket

from services.tokenizer.http_server import bind


def test_accepted_connections_have_tcp_nodelay() -> None:
    async def run() -> int:
        sock = bind("127.0.0.1", 0)
        port = sock.getsockname()[1]
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                s = transport.get_extra_info("socket")
                seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)  # as uvicorn serves it
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            value = await asyncio.wait_for(seen, 5)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(run()) != 0
