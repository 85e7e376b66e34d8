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
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from functools import lru_cache, partial
from typing import Any, Protocol

import grpc
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.auth import ApiKeys
from services.common.errors import InvalidArgument, StrataError
from services.tokenizer.chat import Prepared
from services.tokenizer.chat_output import ChatOutput
from services.tokenizer.openai_reply import GenerationFailed, Reply, sse
from services.tokenizer.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_messages,
    public_message,
)
from services.tokenizer.reasoning import ReasoningFormat
from services.tokenizer.tool_parsers import ToolFormat
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
    if isinstance(exc, GenerationFailed):
        return ApiError(500, str(exc))
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


class Backend(Protocol):
    """What the routes need of the tokenizer service (``StrataServicer``); each raises
    ``StrataError`` naming the field at fault."""

    async def prepare(self, request: pb.GenerateRequest) -> Prepared: ...

    def generate(
        self, request: pb.GenerateRequest, timeout_s: float | None = None, prepared: Prepared | None = None
    ) -> AsyncIterator[pb.GenerateResponse]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    async def tokenize_text(self, text: str, add_special_tokens: bool) -> list[int]: ...

    async def tokenize_chat(
        self, chat: pb.ChatMessages, add_generation_prompt: bool, continue_final: bool, add_special_tokens: bool
    ) -> list[int]: ...

    def token_strs(self, ids: list[int]) -> list[str]: ...

    def detokenize_ids(self, ids: list[int]) -> str: ...


class OpenAIFront:
    """The routes; ``ready`` says whether a scheduler with a connected worker serves;
    ``tool_format`` and ``reasoning`` are the model's formats (``--tool-call-parser``,
    ``--reasoning-parser``)."""

    def __init__(
        self,
        backend: Backend,
        model: str,
        context_length: int,
        keys: ApiKeys,
        registry: CollectorRegistry,
        ready: Callable[[], Awaitable[bool]],
        tool_format: ToolFormat = "hermes",
        reasoning: ReasoningFormat = "none",
    ) -> None:
        self.backend = backend
        self.model = model
        self.context_length = context_length
        self.keys = keys
        self.registry = registry
        self.ready = ready
        self.tool_format: ToolFormat = tool_format
        self.reasoning: ReasoningFormat = reasoning
        self.created = int(time.time())
        self.token_text = lru_cache(maxsize=65536)(lambda i: backend.decode([i]))

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
        # vLLM's tokenizer routes (outside /v1, as there), behind the same API keys
        tokens = APIRouter(dependencies=[Depends(self._authorize)])
        tokens.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        tokens.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.include_router(tokens)
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

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """``{count, max_model_len, tokens, token_strs}`` of a prompt, or of a conversation as the
        chat template renders it."""
        if body.model is not None:
            self._check_model(body.model)
        b = self.backend
        try:
            if body.prompt is not None:
                ids = await b.tokenize_text(body.prompt, body.add_special_tokens is not False)
            else:
                assert body.messages is not None
                chat = chat_messages(body.messages, body.tools, body.chat_template_kwargs)
                generation_prompt = body.add_generation_prompt and not body.continue_final_message
                ids = await b.tokenize_chat(chat, generation_prompt, body.continue_final_message,
                                            bool(body.add_special_tokens))  # fmt: skip
        except StrataError as e:
            raise api_error(e, "prompt" if body.prompt is not None else "messages") from e
        return {
            "count": len(ids),
            "max_model_len": self.context_length,
            "tokens": ids,
            "token_strs": b.token_strs(ids) if body.return_token_strs else None,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """``{prompt}``: the text of token ids, special tokens included (so it tokenizes back)."""
        if body.model is not None:
            self._check_model(body.model)
        try:
            if any(i < 0 for i in body.tokens):
                raise InvalidArgument("tokens: token ids must be >= 0")
            return {"prompt": self.backend.detokenize_ids(body.tokens)}
        except StrataError as e:
            raise api_error(e, "tokens") from e

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
            # A conversation is rendered (and its tool grammar built) once for all its choices.
            prepared = await self.backend.prepare(internal[0]) if chat else None
        except StrataError as e:
            raise api_error(e, prompt_field) from e
        echo = None
        if isinstance(body, CompletionRequest) and body.echo:  # a prompt of ids echoes as its text
            echo = [p if isinstance(p, str) else self.backend.decode(p) for p in body.prompts()]
        reply = Reply(self.model, self.token_text, body, ("chatcmpl-" if chat else "cmpl-") + rid,
                      self._chat_output(body, prepared), self.reasoning != "none", echo)  # fmt: skip
        choices = Choices(partial(self.backend.generate, prepared=prepared), internal)
        if not body.stream:
            return await _unless_disconnected(request, self._whole(reply, choices, prompt_field))
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
                yield sse(api_error(e, prompt_field).body())
                yield sse("[DONE]")
            finally:
                await choices.close()

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    @staticmethod
    async def _whole(reply: Reply, choices: Choices, prompt_field: str) -> Response:
        try:
            return JSONResponse(await reply.whole(choices))
        except BaseException as e:
            raise api_error(e, prompt_field) from e
        finally:
            await choices.close()

    def _chat_output(
        self, body: ChatCompletionRequest | CompletionRequest, prepared: Prepared | None
    ) -> Callable[[], ChatOutput] | None:
        """How each choice's answer is split, or None where it is all content (no reasoning
        parser, no tools)."""
        if not isinstance(body, ChatCompletionRequest) or prepared is None:
            return None
        tools = body.tool_calls_expected
        if self.reasoning == "none" and not tools:
            return None
        return partial(
            ChatOutput.for_request, self.reasoning, prepared.reasoning_open,
            self.tool_format if tools else None, prepared.tool_schemas, body.parallel_tool_calls,
        )  # fmt: skip


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
