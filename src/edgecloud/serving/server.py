"""The OpenAI-compatible HTTP server: any :class:`~edgecloud.backend.Backend` behind ``/v1``.

This module owns :func:`create_app` (the FastAPI application) and :func:`serve` (uvicorn).

Routes: ``POST /v1/chat/completions`` (JSON, or server-sent events when ``stream`` is true:
``data: {chunk}`` lines ending with ``data: [DONE]``; with ``stream_options.include_usage``
a last chunk with no choices carries the usage), ``POST /v1/completions`` (raw-text prompts,
same streaming rules; served by backends that implement ``astream_completion``, such as the
torch engine), ``POST /v1/responses`` (OpenAI's Responses API mapped onto the chat path, streamed
events included: :mod:`edgecloud.serving.responses`), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text,
vLLM's names under an ``edgecloud:`` prefix; see
:mod:`edgecloud.observability.server_metrics`). A backend with its own ``metrics`` (the
torch engine's scheduler) reports engine-level figures; for others the server measures
each request itself.

Errors always have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with
the status of the :mod:`edgecloud.errors` class. The body is parsed here, not by FastAPI, so
bad input is a 400 naming the field (never a 422, never a 500):

====================================  ======  =============================
what                                   status  ``code``
====================================  ======  =============================
malformed JSON, bad or unknown fields  400     ``None`` (``param`` names it)
prompt (+ max_tokens) beyond context   400     ``context_length_exceeded``
missing or wrong bearer key            401     ``invalid_api_key``
unknown ``model``                      404     ``model_not_found``
wrong method on a route                405     ``None``
body over ``max_body_bytes``           413     ``request_too_large``
waiting queue full                     429     ``rate_limit_exceeded`` (+ ``Retry-After``)
backend failed                         503     ``None``
====================================  ======  =============================

A prompt that does not fit is a 400 (as OpenAI answers), not a 413: the body was accepted,
its content is what the caller must change, and OpenAI clients map 400 to
``BadRequestError`` with ``code == "context_length_exceeded"``.

Generation runs off the event loop (:meth:`Backend.astream`: a worker thread, or the torch
engine's scheduler thread), so the loop keeps serving; when a streaming client disconnects,
the backend stream is closed and its sequence is cancelled (its KV freed) at the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from ..backend import Backend, ChatTokenizer, aclose_stream
from ..errors import (AuthenticationError, ContextOverflowError, EdgeCloudError, InvalidRequestError, ModelNotFoundError,
                      RateLimitedError, SessionExpiredError)
from ..observability.server_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..observability.server_metrics import ServerMetrics
from ..types import ChatCompletionChunk, ChatRequest, collect_chunks, load_json, now
from ..runtime.completions import (
    Completion,
    CompletionRequest,
    CompletionsBackend,
    ScoringBackend,
    SessionInfo,
    SessionRef,
    scored_completion,
)
from .openapi import openapi_document
from .responses import ResponseBuilder, ResponseStore, ResponsesRequest, chat_request, sse_event
from .sessions import SessionStore

__all__ = ["DEFAULT_MAX_BODY_BYTES", "create_app", "serve"]

logger = logging.getLogger("edgecloud.server")

#: What this server answers (named in a 404).
SERVED_ROUTES = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "GET /v1/models",
                 "GET /health", "GET /metrics")
#: Largest request body accepted (413 beyond): far above any prompt that fits a context.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _BodyTooLarge(EdgeCloudError):
    status_code = 413
    error_type = "invalid_request_error"


#: The OpenAI error ``code`` of each error class (the first that matches).
_ERROR_CODES: tuple[tuple[type[EdgeCloudError], str], ...] = (
    (ContextOverflowError, "context_length_exceeded"), (SessionExpiredError, "session_expired"),
    (AuthenticationError, "invalid_api_key"), (RateLimitedError, "rate_limit_exceeded"),
    (ModelNotFoundError, "model_not_found"), (_BodyTooLarge, "request_too_large"),
)


def _error_code(exc: BaseException) -> str | None:
    return next((code for kind, code in _ERROR_CODES if isinstance(exc, kind)), None)


def _error_body(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, EdgeCloudError):
        error_type, message = exc.error_type, str(exc)
    else:
        error_type, message = "server_error", "the server failed while answering; see its log"
    return {
        "error": {
            "message": message,
            "type": error_type,
            "param": exc.param if isinstance(exc, EdgeCloudError) else None,
            "code": _error_code(exc),
        }
    }


def error_response(exc: BaseException) -> JSONResponse:
    """The OpenAI-shaped JSON answer for ``exc`` (500 only for errors no caller caused)."""
    status = exc.status_code if isinstance(exc, EdgeCloudError) else 500
    if status >= 500:
        logger.error("request failed: %s", exc, exc_info=exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if isinstance(exc, RateLimitedError):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after or 1)))}
    return JSONResponse(_error_body(exc), status_code=status, headers=headers)


class _EventStream(StreamingResponse):
    """SSE response that always closes its chunk iterator, so a disconnect stops generation."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await aclose_stream(self.body_iterator)


def _sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


async def _read_json(request: Request, max_body_bytes: int) -> Any:
    """The request body as JSON; 413 when too large, 400 when not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise _BodyTooLarge(f"request body is {declared} bytes; the limit is {max_body_bytes} bytes")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_body_bytes:
            raise _BodyTooLarge(f"request body exceeds the limit of {max_body_bytes} bytes")
    return load_json(bytes(body))


class _RequestObserver:
    """Server-side metrics for a backend without its own: one request's chunks, timed."""

    def __init__(self, metrics: ServerMetrics, in_flight: list[int]) -> None:
        self.metrics = metrics
        self.in_flight = in_flight
        self.start = time.perf_counter()
        self.last = 0.0
        self.reason = "error"
        in_flight[0] += 1
        metrics.set_queue(in_flight[0], 0)

    def chunk(self, text: str, finish: str | None, usage: Any) -> None:
        at = time.perf_counter()
        if text:
            self.metrics.on_token(self.last == 0.0, at - (self.last or self.start))
            self.last = at
        if finish is not None:
            self.reason = finish
        if usage is not None:
            self.metrics.prompt_tokens.labels(self.metrics.model_name).inc(usage.prompt_tokens)

    def done(self, cancelled: bool = False) -> None:
        self.in_flight[0] -= 1
        self.metrics.set_queue(self.in_flight[0], 0)
        self.metrics.on_finished("cancelled" if cancelled and self.reason == "error" else self.reason, time.perf_counter() - self.start)


def _chunk_facts(chunk: ChatCompletionChunk | Completion) -> tuple[str, str | None]:
    """The text and finish reason a chunk of either kind carries."""
    if not chunk.choices:
        return "", None
    choice = chunk.choices[0]
    text = choice.text if isinstance(chunk, Completion) else (choice.delta.content or "")  # type: ignore[union-attr]
    return text, choice.finish_reason


def create_app(
    backend: Backend,
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    sessions: SessionStore | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving ``backend`` under the name ``model_name``.

    ``sessions`` holds the token sessions of ``/v1/completions`` (see
    :mod:`edgecloud.serving.sessions`; default: a store of its default size).

    With ``api_key`` set, every ``/v1`` route needs ``Authorization: Bearer <api_key>``
    (compared in constant time); ``/health`` and ``/metrics`` stay open for load balancers
    and scrapers. The app does not own ``backend``: load it before serving and close it
    afterwards (:func:`serve` does both).
    """
    app = FastAPI(title="edgecloud", docs_url=None, redoc_url=None, openapi_url=None)
    document = openapi_document(model_name)
    created = now()
    expected_key = api_key.encode() if api_key else None
    engine_metrics = backend.metrics
    metrics: ServerMetrics = engine_metrics if isinstance(engine_metrics, ServerMetrics) else ServerMetrics(model_name)
    observe = metrics is not engine_metrics  # the server measures requests itself
    in_flight = [0]
    sessions = sessions if sessions is not None else SessionStore()
    responses = ResponseStore()

    def check_key(request: Request) -> None:
        if expected_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise AuthenticationError("missing API key; send the header 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(given.strip().encode(), expected_key):
            raise AuthenticationError("incorrect API key provided")

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != model_name:
            error = ModelNotFoundError(f"the model {requested!r} does not exist here; this server serves {model_name!r}")
            error.param = "model"
            raise error

    @app.exception_handler(EdgeCloudError)
    async def _edgecloud_error(request: Request, exc: EdgeCloudError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (f"no route {request.method} {request.url.path} here; this server serves "
                       f"{', '.join(SERVED_ROUTES)}")
        body = {"error": {"message": message, "type": error_type, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidRequestError(f"invalid request: {exc.errors()}"))

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 only when a request could be served now; 503 with the reason otherwise (a dead
        engine loop is restarted by the probe itself, see TorchEngineBackend.health)."""
        reason = await asyncio.to_thread(backend.health)
        if reason is None:
            return JSONResponse({"status": "ok", "model": model_name})
        return JSONResponse({"status": "unavailable", "model": model_name, "reason": reason}, status_code=503)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(document)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        check_key(request)
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "edgecloud"}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's ``/tokenize`` for chat: the prompt token ids this server evaluates for ``messages``
        (and ``tools``), so a client drafting for it starts from the server's own rendering."""
        try:
            check_key(request)
            body = await _read_json(request, max_body_bytes)
            if not isinstance(body, dict) or "messages" not in body:
                raise InvalidRequestError("send messages (and tools) to tokenize a chat prompt", param="messages")
            if body.get("add_generation_prompt", True) is not True:
                raise InvalidRequestError("only add_generation_prompt=true is served here", param="add_generation_prompt")
            ask = {k: v for k, v in body.items() if k in ("model", "messages", "tools", "tool_choice")}
            chat = ChatRequest.parse(ask)
            check_model(chat.model)
            if not isinstance(backend, ChatTokenizer):
                raise InvalidRequestError(f"/tokenize is not served by the {backend.name} runtime", param="messages")
            tokens = await asyncio.to_thread(backend.tokenize_chat, chat.message_dicts(), chat.tool_dicts())
            return JSONResponse({"count": len(tokens), "max_model_len": backend.n_ctx, "tokens": tokens})
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return error_response(exc)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            check_key(request)
            chat = ChatRequest.parse(await _read_json(request, max_body_bytes))
            check_model(chat.model)
            chunks = _observed(backend.astream(chat))
            if not chat.stream:
                completion = collect_chunks([chunk async for chunk in chunks])
                completion.model = model_name
                return Response(completion.model_dump_json(), media_type="application/json")
            return await _start_stream(chunks, chat.stream_options)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return error_response(exc)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            check_key(request)
            body = CompletionRequest.parse(await _read_json(request, max_body_bytes))
            check_model(body.model)
            ref = body.session
            if body.echo or body.logprobs is not None:
                if not isinstance(backend, ScoringBackend):
                    raise InvalidRequestError(
                        f"echo/logprobs (scoring a continuation) is not served by the {backend.name} runtime; "
                        "serve with the llama.cpp engine (edgecloud serve --engine llamacpp)", param="echo")
                if body.stream:
                    raise InvalidRequestError("a scoring request (echo + logprobs) is answered whole; set stream=false",
                                              param="stream")
                # in a session: after its earlier checks, in arrival order
                async with sessions.turn(ref.id) if ref is not None else contextlib.nullcontext():
                    return await _scored(backend, body, ref)
            context = sessions.resolve(ref, body.token_ids or []) if ref is not None else None
            if not isinstance(backend, CompletionsBackend):
                raise InvalidRequestError(
                    f"/v1/completions is not served by the {backend.name} runtime; use /v1/chat/completions "
                    "or serve with the torch engine (edgecloud serve --runtime torch)"
                )
            if ref is not None and context is not None:
                body = body.model_copy(update={"prompt": context, "session": None})
                sessions.hold(ref.id, context)
            chunks = _observed(_in_session(backend.astream_completion(body), ref, context))
            if not body.stream:
                return Response((await _collect_text(chunks)).model_dump_json(), media_type="application/json")
            return await _start_stream(chunks, body.stream_options)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return error_response(exc)

    async def _scored(backend: ScoringBackend, body: CompletionRequest, ref: SessionRef | None) -> Response:
        """A scoring request (``echo`` + ``logprobs``), in its session when it names one: what the
        session holds afterwards is the context, less the drafts a ``keep_verified`` check rejected."""
        context = sessions.resolve(ref, body.token_ids or []) if ref is not None else None
        started = time.perf_counter()
        scored = await asyncio.to_thread(scored_completion, backend, body, model_name, context,
                                         ref.base if ref is not None else 0)
        usage = scored.usage
        assert usage is not None
        metrics.on_scored(usage.prompt_tokens, usage.context_tokens or 0, usage.completion_tokens,
                          time.perf_counter() - started, usage.cached_tokens)
        if ref is not None and context is not None:
            if scored.verified is not None:  # the drafts it agrees with, then its own token
                context = scored.verified.held(context)
            sessions.hold(ref.id, context)
            scored.session = SessionInfo(id=ref.id, tokens=len(context), resumes=True)
        return Response(scored.model_dump_json(), media_type="application/json")

    async def _in_session(chunks: AsyncIterator[Completion], ref: SessionRef | None,
                          context: list[int] | None) -> AsyncIterator[Completion]:
        """A session's generation: usage counts only the tokens sent (the held ones as context).
        Asked for its token ids (``return_token_ids``), the session then holds what was generated
        too, and the last chunk says what it holds (the next request sends only what follows)."""
        generated: list[int] | None = [] if ref is not None and context is not None else None
        try:
            async for chunk in chunks:
                if ref is not None and chunk.usage is not None:
                    held = min(ref.base, chunk.usage.prompt_tokens)
                    chunk.usage = chunk.usage.model_copy(update={
                        "prompt_tokens": chunk.usage.prompt_tokens - held, "context_tokens": held,
                        "total_tokens": chunk.usage.total_tokens - held})
                choice = chunk.choices[0] if chunk.choices else None
                if generated is not None and choice is not None and choice.token_ids is not None:
                    generated += choice.token_ids
                    if choice.finish_reason is not None:
                        assert ref is not None and context is not None
                        sessions.hold(ref.id, context + generated)
                        chunk.session = SessionInfo(id=ref.id, tokens=len(context) + len(generated), resumes=True)
                yield chunk
        finally:
            await aclose_stream(chunks)

    async def _observed(chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``chunks``, with server-side metrics when the backend keeps none."""
        if not observe:
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]
            return
        observer = _RequestObserver(metrics, in_flight)
        finished = False
        try:
            async for chunk in chunks:
                text, finish = _chunk_facts(chunk)
                observer.chunk(text, finish, chunk.usage)
                yield chunk
            finished = True
        finally:
            observer.done(cancelled=not finished)
            await chunks.aclose()  # type: ignore[attr-defined]

    async def _collect_text(chunks: AsyncIterator[Completion]) -> Completion:
        parts, ids, last = [], [], None
        async for chunk in chunks:
            last = chunk
            parts.extend(choice.text for choice in chunk.choices)
            ids.extend(t for choice in chunk.choices for t in choice.token_ids or ())
        if last is None:
            raise InvalidRequestError("the backend produced no answer")
        choice = last.choices[0].model_copy(update={"text": "".join(parts), **(
            {"token_ids": ids} if last.choices[0].token_ids is not None else {})})
        return last.model_copy(update={"model": model_name, "choices": [choice]})

    async def _first(chunks: AsyncIterator[Any]) -> Any:
        """The stream's first chunk (None: it had none), pulled before answering 200, so errors
        raised before generation (context overflow, queue full, unsupported option, backend
        down) keep their status."""
        try:
            return await chunks.__anext__()
        except StopAsyncIteration:
            return None
        except BaseException:
            await chunks.aclose()  # type: ignore[attr-defined]
            raise

    async def _start_stream(chunks: AsyncIterator[Any], stream_options: Any) -> Response:
        first = await _first(chunks)
        include_usage = bool(stream_options and stream_options.include_usage)
        return _EventStream(
            _event_stream(chunks, first, include_usage), media_type="text/event-stream", headers=_SSE_HEADERS
        )

    async def _event_stream(chunks: AsyncIterator[Any], first: Any, include_usage: bool) -> AsyncIterator[bytes]:
        usage = None
        last = None
        try:
            pending = [first] if first is not None else []
            while True:
                if pending:
                    chunk = pending.pop()
                else:
                    try:
                        chunk = await chunks.__anext__()
                    except StopAsyncIteration:
                        break
                last = chunk
                usage = chunk.usage or usage
                if chunk.choices:
                    out = chunk.model_copy(update={"model": model_name, "usage": None})
                    yield _sse(out.model_dump_json())
            if include_usage and last is not None and usage is not None:
                tail = last.model_copy(update={"model": model_name, "choices": [], "usage": usage, "route": None})
                yield _sse(tail.model_dump_json())
            yield _sse("[DONE]")
        except Exception as exc:  # the status line is sent: report in-band, as OpenAI does
            yield _sse(json.dumps(_error_body(exc)))
            if not isinstance(exc, EdgeCloudError):
                logger.error("stream failed: %s", exc, exc_info=exc)
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        try:
            check_key(request)
            body = ResponsesRequest.parse(await _read_json(request, max_body_bytes))
            check_model(body.model)
            previous = body.previous_response_id
            chat, conversation = chat_request(body, responses.get(previous) if previous else [])
            builder = ResponseBuilder(body, model_name, previous)
            chunks = _observed(backend.astream(chat))
            if not body.stream:
                result = builder.completed(collect_chunks([chunk async for chunk in chunks]))
                if body.store is not False:
                    responses.put(result["id"], conversation + builder.output_messages(result))
                return JSONResponse(result)
            first = await _first(chunks)
            keep = body.store is not False
            return _EventStream(_response_events(chunks, first, builder, conversation if keep else None),
                                media_type="text/event-stream", headers=_SSE_HEADERS)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return error_response(exc)

    async def _response_events(chunks: AsyncIterator[ChatCompletionChunk], first: Any, builder: ResponseBuilder,
                               conversation: list[dict[str, Any]] | None) -> AsyncIterator[bytes]:
        usage, finish = None, None
        try:
            for event in builder.start():
                yield sse_event(event)
            pending = [first] if first is not None else []
            while True:
                try:
                    chunk = pending.pop() if pending else await chunks.__anext__()
                except StopAsyncIteration:
                    break
                usage = chunk.usage or usage
                finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
                for event in builder.chunk(chunk):
                    yield sse_event(event)
            events, final = builder.finish(usage, finish)
            for event in events:
                yield sse_event(event)
            if conversation is not None:
                responses.put(final["id"], conversation + builder.output_messages(final))
        except Exception as exc:  # the status line is sent: report in-band, as OpenAI does
            yield sse_event({"type": "error", "sequence_number": 0, **_error_body(exc)["error"]})
            if not isinstance(exc, EdgeCloudError):
                logger.error("response stream failed: %s", exc, exc_info=exc)
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    return app


def serve(
    backend: Backend,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
    on_loaded: Callable[[], None] | None = None,
) -> None:
    """Load ``backend``, serve it with uvicorn until interrupted, then close it.

    ``model_name`` defaults to the backend's ``model_name`` attribute (or its registry name);
    ``on_loaded`` runs once the backend is loaded (``edgecloud serve`` says what it serves).
    """
    import uvicorn

    name = model_name or backend.model_name or backend.name
    backend.load()
    if on_loaded is not None:
        on_loaded()
    app = create_app(backend, model_name=name, api_key=api_key, max_body_bytes=max_body_bytes)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        backend.close()
