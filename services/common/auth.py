"""Optional API keys for the public endpoints: ``Authorization: Bearer <key>`` on HTTP ``/v1/*``
and the same ``authorization`` metadata on the public gRPC service.

Keys come from ``--api-key`` (comma-separated) and ``--api-key-file`` (one key per line, ``#``
comments); none configured means no check. Health, reflection and metrics stay open: probes and
scrapers carry no keys.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from services.common.config import ConfigError

OPEN_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


class ApiKeys:
    def __init__(self, keys: frozenset[str] = frozenset()) -> None:
        self._keys = keys

    @classmethod
    def load(cls, keys: str = "", key_file: str = "") -> ApiKeys:
        found = {k.strip() for k in keys.split(",") if k.strip()}
        if key_file:
            try:
                lines = Path(key_file).read_text().splitlines()
            except OSError as e:
                raise ConfigError(f"api_key_file: cannot read {key_file}: {e.strerror}") from e
            found |= {ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")}
            if not found:
                raise ConfigError(f"api_key_file: {key_file} holds no key")
        return cls(frozenset(found))

    def __bool__(self) -> bool:
        return bool(self._keys)

    def accepts(self, key: str) -> bool:
        # Compare against every key in constant time, so timing does not tell which one is close.
        hits = [hmac.compare_digest(key.encode(), k.encode()) for k in self._keys]
        return any(hits)

    def check_header(self, value: str) -> str | None:
        """None if ``value`` (an authorization header) is accepted, else why not."""
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "missing API key: send authorization: Bearer <key>"
        return None if self.accepts(token.strip()) else "invalid API key"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without an accepted key with UNAUTHENTICATED (health and reflection open)."""

    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not self._keys or details.method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        value = metadata.get("authorization", "")
        why = self._keys.check_header(value if isinstance(value, str) else value.decode())
        if why is None:
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return handler

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_stream:

            async def deny_stream(request: object, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
                yield  # pragma: no cover - abort raises

            return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
        return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
