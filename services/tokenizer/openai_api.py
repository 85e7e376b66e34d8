"""The OpenAI-compatible HTTP front door of the tokenizer service (FastAPI, served by uvicorn).

Every generation goes through ``StrataServicer.generate``, the same path as
``strata.v1.Strata/Generate``; this module only translates bodies, streams Server-Sent Events and
maps errors to OpenAI's JSON shape:

    {"error": {"message": "temperature: must be >= 0 ...", "type": "invalid_request_error",
               "param": "temperature", "code": null}}

with HTTP 400 (a bad parameter, named), 401 (missing or wrong API key), 404 (unknown model), 409
(duplicate request id), 429 (the scheduler sheds load), 503 (no scheduler or worker), 500
(anything else). A client that disconnects cancels its requests, which frees their slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import grpc
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.auth import ApiKeys
from services.common.errors import StrataError
from services.tokenizer.openai_schema import ChatCompletionRequest, CompletionRequest, public_message
from strata.v1 import strata_pb2 as pb

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}
MAX_BODY_BYTES = 32 << 20  # as the public gRPC port's message limit


class ApiError(Exception):
    """An error with its HTTP status, answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "internal_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def api_error(exc: BaseException, prompt_field: str) -> ApiError:
    """The HTTP form of an exception raised on the generation path."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, StrataError):
        status = HTTP_STATUS.get(exc.code, 500)
        message, param = public_message(str(exc), prompt_field) if status == 400 else (str(exc), None)
        return ApiError(status, message, param)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}")


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first of pydantic's complaints, naming the parameter as the client sent it."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    e = errors[0]
    if e.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}")
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # Union members add their type names to the location: keep the client's field path only.
    path = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "list")]
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    if not path:
        if e.get("type") == "missing":
            return ApiError(400, "request body is required (a JSON object)")
        head, sep, _ = msg.partition(": ")
        return ApiError(400, msg, head if sep and " " not in head else None)
    name = path[0] + "".join(f"[{x}]" if x.isdigit() else f".{x}" for x in path[1:])
    return ApiError(400, f"{name}: {msg}", path[0])


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    last: pb.GenerateResponse | None = None


class Choices:
    """Runs one internal request per choice and merges their responses in arrival order.

    ``close`` cancels every request still running (its gRPC call to the scheduler is cancelled,
    which aborts it there and frees its slots)."""

    def __init__(
        self,
        generate: Callable[[pb.GenerateRequest], AsyncIterator[pb.GenerateResponse]],
        requests: list[pb.GenerateRequest],
    ) -> None:
        self._queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | None]] = asyncio.Queue()
        # One choice (the usual case) is read in the consumer's own task: no task and queue hop
        # per streamed token.
        self._single = generate(requests[0]) if len(requests) == 1 else None
        self._tasks = [] if self._single else [
            asyncio.create_task(self._run(i, generate(r))) for i, r in enumerate(requests)
        ]
        self._open = len(requests)

    async def _run(self, index: int, stream: AsyncIterator[pb.GenerateResponse]) -> None:
        try:
            async for resp in stream:
                await self._queue.put((index, resp))
            await self._queue.put((index, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which decides the status
            await self._queue.put((index, exc))
        finally:
            await _aclose(stream)

    async def __aiter__(self) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        if self._single is not None:
            async for resp in self._single:
                yield 0, resp
            return
        while self._open:
            index, item = await self._queue.get()
            if item is None:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    async def close(self) -> None:
        if self._single is not None:
            await _aclose(self._single)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _aclose(stream: AsyncIterator[pb.GenerateResponse]) -> None:
    """End a response stream early: its request is aborted on the scheduler and its slots freed."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(BaseException):
            await aclose()


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Run ``work``, cancelling it if the client goes away first (FastAPI has read the body, so
    the next ASGI message is the disconnect)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done():
            return Response(status_code=499)
        raise
    finally:
        watcher.cancel()


def _first_per_key(pairs: Iterable[tuple[str, float]]) -> dict[str, float]:
    """The legacy format keys top logprobs by text; two ids that decode alike keep the likelier."""
    out: dict[str, float] = {}
    for k, v in pairs:
        out.setdefault(k, v)
    return out


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class OpenAIFront:
    """The routes; ``generate`` is ``StrataServicer.generate``, ``ready`` says whether a scheduler
    with a connected worker serves."""

    def __init__(
        self,
        generate: Callable[[pb.GenerateRequest], AsyncIterator[pb.GenerateResponse]],
        decode: Callable[[list[int]], str],
        model: str,
        context_length: int,
        keys: ApiKeys,
        registry: CollectorRegistry,
        ready: Callable[[], Awaitable[bool]],
    ) -> None:
        self.generate = generate
        self.model = model
        self.context_length = context_length
        self.keys = keys
        self.registry = registry
        self.ready = ready
        self.created = int(time.time())
        self.token_text = lru_cache(maxsize=65536)(lambda i: decode([i]))

    # -- app ------------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        app = FastAPI(title="Strata", docs_url=None, redoc_url=None)

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            return validation_error(exc).response()

        @app.exception_handler(ApiError)
        async def _api(request: Request, exc: ApiError) -> JSONResponse:
            return exc.response()

        app.add_middleware(_BodyLimit)

        v1 = APIRouter(prefix="/v1", dependencies=[Depends(self._authorize)])
        v1.add_api_route("/models", self.models, methods=["GET"])
        v1.add_api_route("/chat/completions", self.chat, methods=["POST"], response_model=None)
        v1.add_api_route("/completions", self.completions, methods=["POST"], response_model=None)
        app.include_router(v1)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        return app

    async def _authorize(self, request: Request) -> None:
        if not self.keys:
            return
        why = self.keys.check_header(request.headers.get("authorization", ""))
        if why is not None:
            raise ApiError(401, why, code="invalid_api_key")

    # -- plain routes ---------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "strata",
            "max_model_len": self.context_length,
        }
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        if await self.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": "no scheduler with a worker"}, status_code=503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # -- generation -----------------------------------------------------------------------------
    def _check_model(self, name: str) -> None:
        if name != self.model:
            raise ApiError(
                404, f"model: {name!r} does not exist; this server serves {self.model!r}", "model", "model_not_found"
            )

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._serve(body, request, chat=True)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._serve(body, request, chat=False)

    async def _serve(self, body: ChatCompletionRequest | CompletionRequest, request: Request, chat: bool) -> Response:
        self._check_model(body.model)
        prompt_field = "messages" if chat else "prompt"
        rid = body.request_id or request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            internal = body.requests(rid)
        except StrataError as e:
            raise api_error(e, prompt_field) from e
        reply = _Reply(self, body, chat, ("chatcmpl-" if chat else "cmpl-") + rid)
        choices = Choices(self.generate, internal)
        if not body.stream:
            return await _unless_disconnected(request, reply.whole(choices, prompt_field))
        events = reply.events(choices)
        try:  # errors before the first token (validation, routing) get a real HTTP status
            first = await events.__anext__()
        except StopAsyncIteration:
            first = b""
        except BaseException as e:
            await choices.close()
            raise api_error(e, prompt_field) from e

        async def stream() -> AsyncIterator[bytes]:
            try:
                yield first
                async for event in events:
                    yield event
            except Exception as e:
                yield _sse(api_error(e, prompt_field).body())
                yield _sse("[DONE]")
            finally:
                await choices.close()

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )


class _BodyLimit:
    """Refuses a body whose Content-Length exceeds ``MAX_BODY_BYTES`` (413, OpenAI's error shape).

    A plain ASGI middleware: FastAPI's ``@app.middleware("http")`` (Starlette's
    ``BaseHTTPMiddleware``) relays every chunk of a streamed response through an anyio memory
    stream, which was a third of the HTTP front's CPU per streamed token."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
            if size.isdigit() and int(size) > MAX_BODY_BYTES:
                error = ApiError(413, f"request body: at most {MAX_BODY_BYTES} bytes, got {size.decode()}")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Reply:
    """Builds one body's response objects (whole or as SSE chunks)."""

    def __init__(
        self, front: OpenAIFront, body: ChatCompletionRequest | CompletionRequest, chat: bool, id_: str
    ) -> None:
        self.front, self.body, self.chat, self.id = front, body, chat, id_
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.front.model}

    def usage(self, lasts: dict[int, pb.GenerateResponse]) -> dict[str, Any]:
        n = self.body.n
        prompt = sum(r.usage.prompt_tokens for i, r in lasts.items() if i % n == 0)
        cached = sum(r.usage.cached_tokens for i, r in lasts.items() if i % n == 0)
        completion = sum(r.usage.completion_tokens for r in lasts.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def logprobs(self, lps: list[pb.TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        if not lps:
            return None
        text = self.front.token_text
        if self.chat:

            def entry(token_id: int, lp: float) -> dict[str, Any]:
                t = text(token_id)
                return {"token": t, "logprob": lp, "bytes": list(t.encode())}

            return {
                "content": [
                    {**entry(x.token_id, x.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in x.top]}
                    for x in lps
                ]
            }
        tokens = [text(x.token_id) for x in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [_first_per_key((text(t.token_id), t.logprob) for t in x.top) for x in lps],
            "text_offset": offsets,
        }

    @staticmethod
    def _finish(resp: pb.GenerateResponse) -> str:
        if resp.finish_reason == pb.FINISH_REASON_ERROR:
            raise ApiError(500, f"generation failed: {resp.error or 'unknown error'}")
        return FINISH[resp.finish_reason]

    async def whole(self, choices: Choices, prompt_field: str) -> Response:
        got: dict[int, _Choice] = {}
        try:
            async for index, resp in choices:
                c = got.setdefault(index, _Choice())
                c.text.append(resp.text)
                c.logprobs += resp.logprobs
                if resp.finish_reason:
                    c.last = resp
        except BaseException as e:
            raise api_error(e, prompt_field) from e
        finally:
            await choices.close()
        lasts = {i: c.last for i, c in got.items() if c.last is not None}
        out = []
        for i in sorted(got):
            c = got[i]
            assert c.last is not None
            text = "".join(c.text)
            item: dict[str, Any] = {
                "index": i,
                "logprobs": self.logprobs(c.logprobs),
                "finish_reason": self._finish(c.last),
            }
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = text
            out.append(item)
        return JSONResponse({**self._head(self.object), "choices": out, "usage": self.usage(lasts)})

    async def events(self, choices: Choices) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        include_usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        started: set[int] = set()
        offsets: dict[int, int] = {}
        lasts: dict[int, pb.GenerateResponse] = {}
        # The chunk of a token in mid-stream (no logprobs, no finish, not the first) is the same
        # JSON but for its index and text: formatted from a prefix made once.
        head = json.dumps(self._head(obj), separators=(",", ":"))[:-1].replace("%", "%%")  # ids may hold %
        field = '"delta":{"content":%s}' if self.chat else '"text":%s'
        tail = ',"usage":null}' if include_usage else "}"
        plain = head + ',"choices":[{"index":%d,"logprobs":null,"finish_reason":null,' + field + "}]" + tail
        async for index, resp in choices:
            finish = self._finish(resp) if resp.finish_reason else None
            if finish is not None:
                lasts[index] = resp
            # One chunk per sampled token (or per batch of tokens that arrived together), even when
            # it adds no text yet (half a UTF-8 character, held-back stop-string text): clients
            # count chunks as tokens and time the first one as TTFT.
            if not (resp.token_ids or resp.text or finish or (self.chat and index not in started)):
                continue
            if finish is None and not resp.logprobs and index in started:
                yield b"data: " + (plain % (index, json.dumps(resp.text))).encode() + b"\n\n"
                continue
            choice: dict[str, Any] = {
                "index": index,
                "logprobs": self.logprobs(list(resp.logprobs), offsets.get(index, 0)),
                "finish_reason": finish,
            }
            offsets[index] = offsets.get(index, 0) + sum(len(self.front.token_text(x.token_id)) for x in resp.logprobs)
            if self.chat:
                delta: dict[str, Any] = {"content": resp.text}
                if index not in started:
                    delta["role"] = "assistant"
                choice["delta"] = delta
            else:
                choice["text"] = resp.text
            started.add(index)
            chunk = {**self._head(obj), "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            yield _sse(chunk)
        if include_usage:
            yield _sse({**self._head(obj), "choices": [], "usage": self.usage(lasts)})
        yield _sse("[DONE]")
