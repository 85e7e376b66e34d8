"""The error policy of every Strata server, in one place.

Domain code raises the exceptions below (or ``StepError``); ``ErrorInterceptor`` turns them into
precise gRPC status codes with the exception's message, so servicers stay thin and no request is
dropped with only a log line. Anything unexpected becomes INTERNAL and is logged with its traceback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.common.step import StepError

log = logging.getLogger(__name__)


class StrataError(Exception):
    """Base of errors that carry their gRPC status code."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(StrataError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(StrataError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(StrataError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(StrataError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(StrataError):
    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(StrataError):
    code = grpc.StatusCode.FAILED_PRECONDITION


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code for an exception raised by domain code."""
    if isinstance(exc, StrataError):
        return exc.code
    if isinstance(exc, StepError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    if type(exc).__name__ == "_ServerStoppedError":  # grpc.aio: this server is shutting down
        log.info("%s ended: the server is stopping", method)
        raise exc
    code = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", method, exc_info=exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
    else:
        log.info("%s -> %s: %s", method, code.name, exc)
        message = str(exc)
    await context.abort(code, message)


class _DecodeLog:
    """At most one warning per ``every_s`` about undecodable requests (a client can send them at
    will; the log must not grow with them), counting the ones it did not write."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s, self.last, self.skipped = every_s, -every_s, 0

    def warn(self, method: str, reason: str) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.skipped += 1
            return
        log.warning("%s: undecodable request (%s); %d more since the last warning", method, reason, self.skipped)
        self.last, self.skipped = now, 0


_decode_log = _DecodeLog()


def _parse(deserializer: Callable[[bytes], Any] | None, raw: Any, method: str) -> Any:
    """The request from its bytes; a corrupt payload or invalid UTF-8 is INVALID_ARGUMENT."""
    if deserializer is None:
        return raw
    try:
        return deserializer(raw)
    except Exception as exc:  # DecodeError, UnicodeDecodeError: whatever the parser refuses
        reason = f"{type(exc).__name__}: {exc}"
        _decode_log.warn(method, reason)
        raise InvalidArgument(f"request: not a valid {method.rsplit('/', 1)[-1]} request message ({reason})") from None


def _wrap_unary(
    fn: Callable[..., Awaitable[Any]], method: str, deserializer: Callable[[bytes], Any] | None = None
) -> Callable[..., Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(_parse(deserializer, request, method), context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await _abort(context, exc, method)

    return call


def _wrap_stream(
    fn: Callable[..., AsyncIterator[Any]], method: str, deserializer: Callable[[bytes], Any] | None = None
) -> Callable[..., AsyncIterator[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(_parse(deserializer, request, method), context):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await _abort(context, exc, method)

    return call


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping any handler to the status codes of ``status_of``."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        # Single-request methods parse their request inside the handler, where a decode error
        # becomes INVALID_ARGUMENT (grpc's own parsing would answer UNKNOWN and log a traceback).
        raw = {"request_deserializer": None, "response_serializer": handler.response_serializer}
        deser = handler.request_deserializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, method, deser), **raw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream, method, deser), **raw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, method), **kwargs)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream, method), **kwargs
            )
        return handler
