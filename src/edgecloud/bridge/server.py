"""The in-process bridge: :class:`Bridge` answers JSON-RPC lines for a host app that embeds Python.

``bridge.handle(line, emit)`` takes one request line and returns at once; what the request
produces (its notifications, then exactly one response) goes out through ``emit`` as JSON
text without a trailing newline. ``handle`` is thread-safe and ``emit`` is always called
under one lock, so lines never interleave mid-line even when requests run concurrently. The
locks are re-entrant: ``emit`` may itself call ``handle`` (say, a cancel on the first delta).

Threads: every request with an id runs on its own worker thread, so a long ``chat.create``
never holds up ``models.list`` and two chats interleave their ``chat.delta`` lines by id (the
edge runtime itself answers one chat at a time; the second waits for the first to finish).
``chat.cancel`` is answered inline, on the caller's thread, so it is never queued behind
the request it cancels.

Cancel: a cancelled ``chat.create`` stops reading its stream at the next chunk and closes it
(the runtime stops generating), then answers error ``-32800`` with the text streamed so far
in ``data.text``. A chat still waiting for the edge runtime stops as soon as it gets it.
A failing ``emit`` (the host went away) cancels the request it was sending for.

Lifecycle: the :class:`~edgecloud.client.EdgeCloud` client is built on first use (or passed
in; then the caller closes it). ``shutdown`` cancels the other in-flight requests, answers
``{}``, refuses later requests (``-32600``) and closes the bridge; :meth:`Bridge.close`
does the same without a reply, waiting up to ``drain_timeout_s`` for in-flight requests to
answer. :attr:`Bridge.stopped` is set once closed. The protocol itself is documented in
:mod:`edgecloud.bridge.protocol`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from .. import store
from .._version import __version__
from ..backend import SessionBackend
from ..client import EdgeCloud
from ..edge.memory import plan as plan_memory
from ..errors import BackendUnavailableError, EdgeCloudError, InvalidRequestError
from ..types import ChatCompletionChunk, collect_chunks, load_json
from .protocol import (
    METHODS,
    NOTIFICATIONS,
    BridgeConfig,
    CancelResult,
    Capabilities,
    ChatDelta,
    ChatResult,
    EmptyResult,
    ErrorCode,
    InitializeResult,
    ModelInfo,
    ModelsListResult,
    PlanResult,
    PullProgress,
    PullResult,
    RequestId,
    SessionResult,
)

__all__ = ["Bridge", "Emit", "DEFAULT_MAX_LINE_BYTES"]

Emit = Callable[[str], None]
#: Longest request line accepted (bytes); longer ones answer -32600 without being parsed.
DEFAULT_MAX_LINE_BYTES = 1024 * 1024

log = logging.getLogger(__name__)
_NO_ID = object()


class _RpcError(Exception):
    """A JSON-RPC error answered to the request ``id`` (None when it could not be read)."""

    def __init__(self, id: RequestId | None, code: ErrorCode, message: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.id, self.code, self.data = id, code, data


class _Cancelled(Exception):
    def __init__(self, text: str) -> None:
        super().__init__("request cancelled")
        self.text = text


@dataclass
class _Call:
    id: RequestId
    method: str
    params: Any
    emit: Emit
    cancelled: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


def _message(id: RequestId | None, *, result: BaseModel | None = None, error: _RpcError | None = None) -> dict[str, Any]:
    if error is None:
        return {"jsonrpc": "2.0", "id": id, "result": result.model_dump(mode="json") if result else {}}
    body: dict[str, Any] = {"code": int(error.code), "message": str(error)}
    if error.data is not None:
        body["data"] = error.data
    return {"jsonrpc": "2.0", "id": id, "error": body}


def _as_rpc_error(id: RequestId, exc: Exception) -> _RpcError:
    """The one place an exception raised while serving becomes a JSON-RPC error."""
    if isinstance(exc, _RpcError):
        return exc
    if isinstance(exc, _Cancelled):
        return _RpcError(id, ErrorCode.REQUEST_CANCELLED, str(exc), {"text": exc.text})
    if isinstance(exc, InvalidRequestError):
        return _RpcError(id, ErrorCode.INVALID_PARAMS, str(exc), {"param": exc.param})
    if isinstance(exc, EdgeCloudError):
        return _RpcError(id, ErrorCode.SERVER_ERROR, str(exc), {"type": exc.error_type, "error": type(exc).__name__})
    log.exception("bridge: unexpected error in request %r", id)
    return _RpcError(id, ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}: {exc}",
                     {"error": type(exc).__name__})


class Bridge:
    """Serve the bridge protocol in-process: ``handle(line, emit)`` per request line."""

    def __init__(
        self,
        client: EdgeCloud | None = None,
        *,
        client_factory: Callable[[], EdgeCloud] | None = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        drain_timeout_s: float = 5.0,
        progress_interval_s: float = 0.25,
        **client_kwargs: Any,
    ) -> None:
        """``client`` (closed by its owner), or one built by ``client_factory`` / ``EdgeCloud(**client_kwargs)``."""
        if client is not None and (client_factory is not None or client_kwargs):
            raise TypeError("pass a client, a client_factory or EdgeCloud arguments, not several")
        self._client = client
        self._owns_client = client is None
        self._factory = client_factory or (lambda: EdgeCloud(**client_kwargs))
        self.max_line_bytes = max_line_bytes
        self.drain_timeout_s = drain_timeout_s
        self.progress_interval_s = progress_interval_s
        self._handlers: dict[str, Callable[[_Call], BaseModel]] = {
            "initialize": self._initialize, "chat.create": self._chat, "chat.cancel": self._cancel,
            "models.list": self._models_list, "models.pull": self._models_pull, "plan": self._plan,
            "session.save": self._session_save, "session.restore": self._session_restore, "shutdown": self._shutdown,
        }
        #: ``initialize``'s session: the default ``prompt_cache_key`` of ``chat.create``.
        self._session: str | None = None
        self._calls: dict[RequestId, _Call] = {}
        # Re-entrant: a host's emit callback may call handle() (e.g. cancel on the first delta).
        self._lock = threading.RLock()  # the in-flight table and the accepting flag
        self._emit_lock = threading.RLock()
        self._client_lock = threading.Lock()
        self._accepting = True
        #: Set once the bridge is closed (after ``shutdown`` or :meth:`close`).
        self.stopped = threading.Event()

    # ------------------------------------------------------------------ the entry points

    def handle(self, line: str | bytes, emit: Emit) -> None:
        """Accept one request line; its notifications and response go to ``emit``. Never raises on bad input."""
        try:
            call = self._parse(line, emit)
        except _RpcError as exc:
            self._send(emit, _message(exc.id, error=exc))
            return
        if call is None:
            return
        if call.method == "chat.cancel":
            self._run(call)
            return
        call.thread = threading.Thread(target=self._run, args=(call,), name=f"bridge-{call.method}-{call.id}",
                                       daemon=True)
        with self._lock:
            if not self._accepting:
                error = _RpcError(call.id, ErrorCode.INVALID_REQUEST, "the bridge is shut down; start a new one")
            elif call.id in self._calls:
                error = _RpcError(call.id, ErrorCode.INVALID_REQUEST,
                                  f"id {call.id!r} is already in flight; give every request a new id")
            else:
                error = None
                self._calls[call.id] = call
        if error is not None:
            self._send(emit, _message(call.id, error=error))
            return
        call.thread.start()

    def reject_overlong(self, emit: Emit) -> None:
        """Answer a line that was not read because it is longer than ``max_line_bytes``."""
        self._send(emit, _message(None, error=self._overlong()))

    def close(self, timeout: float | None = None) -> None:
        """Cancel in-flight requests, wait up to ``timeout`` (default ``drain_timeout_s``) each, close the client."""
        with self._lock:
            self._accepting = False
            calls = list(self._calls.values())
        self._cancel_and_wait(calls, self.drain_timeout_s if timeout is None else timeout)
        with self._client_lock:
            client, self._client = self._client, None
            if client is not None and self._owns_client:
                client.close()
        self.stopped.set()

    def __enter__(self) -> Bridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _parse(self, line: str | bytes, emit: Emit) -> _Call | None:
        """The call a line asks for, None for a notification; _RpcError for bad input."""
        if len(line) > self.max_line_bytes:
            raise self._overlong()
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _RpcError(None, ErrorCode.PARSE_ERROR, f"request line is not UTF-8: {exc.reason}") from None
        try:
            obj = load_json(line, what="request line")  # nesting bounded, as on the server
        except InvalidRequestError as exc:
            raise _RpcError(None, ErrorCode.PARSE_ERROR, f"malformed JSON: {exc}") from None
        if isinstance(obj, list):
            raise _RpcError(None, ErrorCode.INVALID_REQUEST, "batches are not supported: send one request per line")
        if not isinstance(obj, dict):
            raise _RpcError(None, ErrorCode.INVALID_REQUEST, f"expected a JSON-RPC request object, got {type(obj).__name__}")
        rid = obj.get("id", _NO_ID)
        valid_id = isinstance(rid, (int, str)) and not isinstance(rid, bool)
        reply_to = rid if valid_id else None
        if obj.get("jsonrpc") != "2.0":
            raise _RpcError(reply_to, ErrorCode.INVALID_REQUEST, "not a JSON-RPC 2.0 request: 'jsonrpc' must be \"2.0\"")
        if not isinstance(obj.get("method"), str):
            raise _RpcError(reply_to, ErrorCode.INVALID_REQUEST, "not a JSON-RPC 2.0 request: 'method' must be a string")
        if rid is not _NO_ID and not valid_id:
            raise _RpcError(None, ErrorCode.INVALID_REQUEST, "'id' must be a string or an integer")
        method, raw = obj["method"], obj.get("params")
        spec = METHODS.get(method)
        try:
            if spec is None:
                raise _RpcError(reply_to, ErrorCode.METHOD_NOT_FOUND,
                                f"unknown method {method!r}; methods: {', '.join(METHODS)}")
            if raw is not None and not isinstance(raw, dict):
                raise InvalidRequestError("'params' must be an object (named parameters)", param="params")
            call = _Call(reply_to, method, spec.params.parse(raw or {}), emit)
        except (_RpcError, InvalidRequestError) as exc:
            if rid is _NO_ID:
                return None  # a notification is never answered, not even with an error
            raise _as_rpc_error(reply_to, exc) from None
        if rid is _NO_ID:  # notifications: only a cancel does anything (like LSP's $/cancelRequest)
            if method == "chat.cancel":
                self._cancel(call, quiet=True)
            return None
        return call

    def _overlong(self) -> _RpcError:
        return _RpcError(None, ErrorCode.INVALID_REQUEST, f"request line is longer than {self.max_line_bytes} bytes; "
                         "it was not read", {"limit": self.max_line_bytes})

    def _send(self, emit: Emit, message: dict[str, Any]) -> bool:
        line = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
        with self._emit_lock:
            try:
                emit(line)
            except Exception:  # noqa: BLE001 - the host's writer failed; nobody is left to tell
                log.warning("bridge: emit failed for a %s message", message.get("method", "response"), exc_info=True)
                return False
        return True

    def _notify(self, call: _Call, method: str, params: BaseModel) -> None:
        """Send a notification for ``call``; if the host cannot take it, cancel the call."""
        if not self._send(call.emit, {"jsonrpc": "2.0", "method": method, "params": params.model_dump(mode="json")}):
            call.cancelled.set()

    def _run(self, call: _Call) -> None:
        try:
            message = _message(call.id, result=self._handlers[call.method](call))
        except Exception as exc:  # noqa: BLE001 - every failure becomes this request's error response
            message = _message(call.id, error=_as_rpc_error(call.id, exc))
        with self._lock:  # leave the table and answer together: a later cancel sees either both or neither
            if self._calls.get(call.id) is call:
                del self._calls[call.id]
            self._send(call.emit, message)
        if call.method == "shutdown":
            self.close()

    def _cancel_and_wait(self, calls: list[_Call], timeout: float) -> None:
        for call in calls:
            call.cancelled.set()
        me = threading.current_thread()
        for call in calls:
            if call.thread is not None and call.thread is not me and call.thread.is_alive():
                call.thread.join(timeout)

    def _get_client(self) -> EdgeCloud:
        with self._client_lock:
            if self.stopped.is_set():
                raise BackendUnavailableError("the bridge is closed")
            if self._client is None:
                self._client = self._factory()
            return self._client

    # ------------------------------------------------------------------ methods

    def _initialize(self, call: _Call) -> InitializeResult:
        self._session = call.params.session
        settings = self._get_client().settings
        urls = [str(u) for u in settings.cloud_base_url]
        return InitializeResult(
            edgecloud_version=__version__,
            capabilities=Capabilities(methods=list(METHODS), notifications=list(NOTIFICATIONS)),
            config=BridgeConfig(edge_model=settings.edge_model, cloud=bool(urls), cloud_model=settings.cloud_model,
                                cloud_base_url=urls),
        )

    def _chat(self, call: _Call) -> ChatResult:
        params = call.params
        fields = params.model_dump(exclude_unset=True, exclude={"messages", "stream"})
        if self._session is not None:
            fields.setdefault("prompt_cache_key", self._session)
        messages = [m.model_dump(exclude_none=True) for m in params.messages]
        client = self._get_client()
        if call.cancelled.is_set():
            raise _Cancelled("")
        chunks: list[ChatCompletionChunk] = []
        deltas: list[str] = []
        stream = client.chat.completions.create(messages=messages, stream=True, **fields)
        try:
            for chunk in stream:  # type: ignore[union-attr]
                if call.cancelled.is_set():
                    break
                chunks.append(chunk)
                if chunk.text:
                    deltas.append(chunk.text)
                    if params.stream:
                        self._notify(call, "chat.delta", ChatDelta(id=call.id, delta=chunk.text, index=len(deltas) - 1))
        finally:
            stream.close()  # type: ignore[union-attr]
        if call.cancelled.is_set():
            raise _Cancelled("".join(deltas))
        answer = collect_chunks(chunks)
        return ChatResult(completion_id=answer.id, model=answer.model, text=answer.text,
                          tool_calls=answer.choices[0].message.tool_calls, finish_reason=answer.choices[0].finish_reason, usage=answer.usage, route=answer.route,
                          cost=answer.cost)

    def _cancel(self, call: _Call, *, quiet: bool = False) -> CancelResult:
        with self._lock:
            target = self._calls.get(call.params.id)
        if target is None or target.method != "chat.create":
            if quiet:
                return CancelResult(cancelled=False)
            raise InvalidRequestError(f"no chat.create request with id {call.params.id!r} is in flight "
                                      "(it finished, or never started)", param="id")
        target.cancelled.set()
        return CancelResult()

    def _models_list(self, call: _Call) -> ModelsListResult:
        models = []
        for entry in store.catalogue().values():
            installed = store.is_pulled(entry.name)
            models.append(ModelInfo(
                name=entry.name, description=entry.description, parameters=entry.parameters,
                quantization=entry.quantization, size_bytes=entry.size_bytes, installed=installed,
                fetchable_here=entry.fetchable_here, path=str(store.model_file(entry.name)) if installed else None,
            ))
        return ModelsListResult(models=models)

    def _models_pull(self, call: _Call) -> PullResult:
        """``store.pull`` with its progress callback as ``models.pull.progress`` notifications
        (at most one per ``progress_interval_s``, and always the last one)."""
        name = call.params.name
        last = [0.0]

        def report(done: int, total: int) -> None:
            now = time.monotonic()
            if done >= total or now - last[0] >= self.progress_interval_s:
                last[0] = now
                self._notify(call, "models.pull.progress", PullProgress(id=call.id, done=done, total=total))

        path = store.pull(name, progress=False, force=call.params.force, on_progress=report)
        return PullResult(name=name, path=str(path))

    def _plan(self, call: _Call) -> PlanResult:
        p = call.params
        return PlanResult(**plan_memory(p.model, p.device, p.ctx, kv_cache_type=p.kv_cache_type).to_dict())

    def _session_backend(self) -> SessionBackend | None:
        edge = self._get_client().edge
        return edge if isinstance(edge, SessionBackend) else None

    def _session_save(self, call: _Call) -> SessionResult:
        name = call.params.session or self._session
        edge = self._session_backend()
        return SessionResult(session=name, tokens=edge.save_session(name) if edge is not None else 0)

    def _session_restore(self, call: _Call) -> SessionResult:
        name = call.params.session or self._session
        if name is None:
            raise InvalidRequestError("name the session to restore (or set one in initialize)", param="session")
        edge = self._session_backend()
        return SessionResult(session=name, tokens=edge.restore_session(name) if edge is not None else 0)

    def _shutdown(self, call: _Call) -> EmptyResult:
        with self._lock:
            self._accepting = False
            others = [c for c in self._calls.values() if c is not call]
        self._cancel_and_wait(others, self.drain_timeout_s)
        return EmptyResult()
