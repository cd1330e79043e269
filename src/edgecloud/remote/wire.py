"""The OpenAI wire format as a cloud answers in it: error bodies and server-sent events.

This module owns what :class:`~edgecloud.remote.client.CloudBackend` reads back, without I/O:
:func:`translate` turns an HTTP failure (status, OpenAI / vLLM / FastAPI error body, wait hint)
into the :mod:`edgecloud.errors` tree (the table is in :mod:`edgecloud.remote.client`);
:class:`EventReader` turns SSE lines into :class:`~edgecloud.types.ChatCompletionChunk` objects,
holding the finish chunk back until usage arrives; :func:`usage_counts` and :func:`normalise`
bend the servers' small differences into one shape.
"""

from __future__ import annotations

import email.utils
import json
import re
from datetime import datetime, timezone
from typing import Any, get_args

import httpx
from pydantic import ValidationError

from ..errors import (
    AuthenticationError,
    BackendError,
    BackendUnavailableError,
    ContextOverflowError,
    EdgeCloudError,
    InvalidRequestError,
    ModelNotFoundError,
    RateLimitedError,
    SessionExpiredError,
)
from ..types import ChatCompletionChunk, FinishReason, RouteInfo, Usage, new_completion_id, now

__all__ = ["EventReader", "error_fields", "normalise", "translate", "usage_counts", "wait_hint"]

_FINISH_REASONS = frozenset(get_args(FinishReason))
# In-band error events rarely carry a status; their OpenAI ``type`` says which one it would be.
_STATUS_OF_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "rate_limit_error": 429,
    "rate_limit_exceeded": 429,
}
# Token counts in context-overflow messages: edgecloud's, OpenAI's and vLLM's wordings.
_PROMPT_COUNT = (
    r"prompt is (\d+) tokens",
    r"(\d+) in the messages",
    r"has (\d+) input tokens",
    r"messages resulted in (\d+) tokens",
    r"requested (\d+) tokens",
)
_CONTEXT_COUNT = (r"context window is (\d+)", r"maximum context length is (\d+)")


def wait_hint(headers: httpx.Headers) -> float | None:
    """The server's wait hint in seconds: ``retry-after-ms``, or ``Retry-After`` (seconds or date)."""
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def error_fields(body: Any, text: str) -> tuple[str, Any, Any, Any]:
    """(message, param, code, type) from OpenAI's ``{"error": {...}}``, vLLM's flat shape or FastAPI's."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, str):
        return error, None, None, None
    if not isinstance(error, dict) and isinstance(body, dict) and "message" in body:
        error = body
    if not isinstance(error, dict):
        detail = body.get("detail") if isinstance(body, dict) else None
        return str(detail) if detail else (text.strip()[:500] or "(empty body)"), None, None, None
    return str(error.get("message") or text.strip()[:500] or "(no message)"), error.get("param"), error.get("code"), error.get("type")


def _first_count(patterns: tuple[str, ...], message: str) -> int:
    for pattern in patterns:
        match = re.search(pattern, message)
        if match:
            return int(match.group(1))
    return 0


def translate(status: int, message: str, param: Any, code: Any, said: str, retry_after: float | None,
              kind: Any = None) -> EdgeCloudError:
    """One HTTP failure -> the edgecloud error a caller can act on (``said`` is the full message;
    ``kind``: the error's ``type``, which names an expired session where ``code`` is the status, as
    vLLM's errors and edgecloud's vLLM plugin give it)."""
    if "session_expired" in (code, kind):
        return SessionExpiredError(said)
    if code == "context_length_exceeded" or (status == 400 and "maximum context length" in message.lower()):
        error = ContextOverflowError(_first_count(_PROMPT_COUNT, message), _first_count(_CONTEXT_COUNT, message))
        error.args = (said,)  # the server's words, not a message rebuilt from counts that may be 0
        return error
    if status in (401, 403):
        return AuthenticationError(f"{said}; check the api_key")
    if status == 404:
        return ModelNotFoundError(f"{said}; check the model name and that base_url is the API root")
    if status == 429:
        hint = f" (Retry-After: {retry_after:g} s)" if retry_after is not None else ""
        return RateLimitedError(f"{said}{hint}", retry_after=retry_after)
    if 400 <= status < 500:
        return InvalidRequestError(said, param=param if isinstance(param, str) else None)
    if status in (502, 503, 504):
        return BackendUnavailableError(said, cause="server_error")
    return BackendError(said, cause="server_error")


def usage_counts(raw: dict[str, Any]) -> dict[str, int]:
    details = raw.get("prompt_tokens_details")
    cached = raw.get("cached_tokens") or (details.get("cached_tokens") if isinstance(details, dict) else 0)
    prompt, completion = raw.get("prompt_tokens") or 0, raw.get("completion_tokens") or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": raw.get("total_tokens") or prompt + completion,
        "cached_tokens": cached or 0,
    }


def normalise(payload: dict[str, Any]) -> dict[str, Any]:
    """Bend the servers' small differences into our chunk shape (nulls, extra finish reasons)."""
    for choice in payload.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason") is not None and choice["finish_reason"] not in _FINISH_REASONS:
            choice["finish_reason"] = "stop"
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("content") is None:
            choice["logprobs"] = None
        delta = choice.get("delta")
        if isinstance(delta, dict) and delta.get("role") not in (None, "assistant"):
            delta.pop("role")
    if isinstance(payload.get("usage"), dict):
        payload["usage"] = usage_counts(payload["usage"])
    return payload


class EventReader:
    """SSE lines in, our chunks out. No I/O: the sync and async paths feed it the same way.

    The finish chunk is held back until the usage chunk (or ``[DONE]``) arrives, so the
    last chunk handed out carries usage and route together.
    """

    def __init__(self, where: str, route: RouteInfo, model: str) -> None:
        self.where, self.route, self.model = where, route, model
        self.done = False
        self.delivered = 0
        self._data: list[str] = []
        self._event = ""
        self._held: ChatCompletionChunk | None = None
        self._last: ChatCompletionChunk | None = None
        self._usage: Usage | None = None

    def feed(self, line: str) -> list[ChatCompletionChunk]:
        """One line without its line ending; a blank line ends an event."""
        if self.done:
            return []
        if not line:
            return self._dispatch()
        if line.startswith(":"):  # comment, e.g. a keepalive
            return []
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        return []

    def end(self) -> list[ChatCompletionChunk]:
        """The body ended: flush, and accept a finished answer even without ``[DONE]``."""
        out = self._dispatch() if self._data and not self.done else []
        if self.done:
            return out
        if self._held is None:
            raise BackendError(
                f"the stream from {self.where} ended after {self.delivered} chunks without a finish "
                "reason or [DONE]; the server stopped mid-answer",
                cause="disconnected",
            )
        self.done = True
        return [*out, *self._final()]

    def _dispatch(self) -> list[ChatCompletionChunk]:
        data, event = "\n".join(self._data), self._event
        self._data, self._event = [], ""
        if not data.strip():
            return []
        if data.strip() == "[DONE]":
            self.done = True
            return self._final()
        try:
            payload = json.loads(data)
        except ValueError as exc:
            raise BackendError(
                f"{self.where} sent a malformed stream: an event is not JSON ({exc}): {data[:200]!r}",
                cause="malformed_stream",
            ) from exc
        if not isinstance(payload, dict):
            raise BackendError(
                f"{self.where} sent a malformed stream: an event is not a JSON object: {data[:200]!r}",
                cause="malformed_stream",
            )
        if "error" in payload or event == "error":
            raise self._inband_error(payload, data)
        remote = payload.pop("route", None)
        try:
            chunk = ChatCompletionChunk.model_validate(normalise(payload))
        except ValidationError as exc:
            raise BackendError(
                f"{self.where} sent a malformed stream: an event is not a chat.completion.chunk "
                f"({exc.errors()[0]['msg']} at {exc.errors()[0]['loc']}): {data[:200]!r}",
                cause="malformed_stream",
            ) from exc
        return self._accept(chunk, remote)

    def _inband_error(self, payload: dict[str, Any], data: str) -> EdgeCloudError:
        message, param, code, kind = error_fields(payload, data)
        status = code if isinstance(code, int) else _STATUS_OF_TYPE.get(str(kind), 500)
        said = f"{self.where} reported an error after {self.delivered} chunks: {message}"
        return translate(status, message, param, code, said, None, kind)

    def _accept(self, chunk: ChatCompletionChunk, remote: Any) -> list[ChatCompletionChunk]:
        if self._last is None and isinstance(remote, dict) and remote.get("backend"):
            there = f"{remote.get('backend')} on {remote.get('target', '?')}"
            self.route = self.route.model_copy(update={"reason": f"{self.route.reason}; served there by {there}"})
        self._last = chunk
        self._usage = chunk.usage or self._usage
        if not chunk.choices:  # the usage chunk, or an empty keepalive chunk
            return []
        out = [] if self._held is None else [self._held]
        self._held = None
        chunk = chunk.model_copy(update={"usage": None, "route": self.route if self.delivered == 0 else None})
        if any(choice.finish_reason is not None for choice in chunk.choices):
            self._held = chunk
        else:
            out.append(chunk)
        self.delivered += len(out)
        return out

    def _final(self) -> list[ChatCompletionChunk]:
        if self._held is not None:
            final = self._held.model_copy(update={"usage": self._usage, "route": self.route})
        else:
            last = self._last
            final = ChatCompletionChunk(
                id=last.id if last else new_completion_id(),
                created=last.created if last else now(),
                model=last.model if last else self.model,
                usage=self._usage,
                route=self.route,
            )
        self._held = None
        self.delivered += 1
        return [final]
