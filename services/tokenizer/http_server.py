"""uvicorn inside the tokenizer's own event loop, on a socket bound by us.

Binding ourselves (``SO_REUSEADDR`` only, never ``SO_REUSEPORT``) makes a port already in use an
error at start instead of a second server silently sharing it, and lets port 0 pick a free one.
The service owns signals and shutdown, so uvicorn's own signal capture is switched off.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


class _Embedded(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; ``OSError`` naming the address if it is taken.

    Made with ``IPPROTO_TCP`` spelled out: asyncio turns Nagle's algorithm off (``TCP_NODELAY``)
    only on connections whose socket says so, and an accepted socket inherits the listener's
    protocol number, 0 by default. With Nagle on, a response's second write (its body after the
    headers, each SSE chunk after the previous one) waited for the client's delayed ACK: 40 ms
    added to most requests and streamed tokens on a keep-alive connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class HttpServer:
    def __init__(
        self, app: FastAPI, host: str, port: int, tls_cert: str = "", tls_key: str = "", fd: int = -1
    ) -> None:
        """HTTPS when ``tls_cert`` and ``tls_key`` are given. ``fd`` >= 0: serve on that inherited
        listening socket (another front process bound it) instead of binding ``host:port``."""
        if fd >= 0:
            self._sock = socket.socket(fileno=fd)
            self._sock.setblocking(False)
        else:
            self._sock = bind(host, port)
        self.port = self._sock.getsockname()[1]
        self.fd = self._sock.fileno()  # what other front processes inherit
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2,
            ssl_certfile=tls_cert or None, ssl_keyfile=tls_key or None,
        )  # fmt: skip
        self._server = _Embedded(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._sock.close()
