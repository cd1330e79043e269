"""Failover for the hybrid client: backend health, failure causes, and one stream across backends.

This module owns three things:

* :class:`CircuitBreaker`: per-backend health. ``failure_threshold`` consecutive failures open
  the circuit (the backend is skipped); after ``cooldown_s`` it is half-open and lets one
  trial request through; a success closes it, a failure opens it again.
* :func:`cause_of` / :func:`can_fall_back`: which errors move a request to another backend,
  and the short cause recorded for it (cloud: ``connect``, ``timeout``, ``rate_limited``,
  ``server_error``, ``malformed_stream``, ``disconnected``; edge: ``load_error``,
  ``out_of_memory``, ``edge_error``; either: ``context_overflow``).
  Bad requests (the same on every backend), a cloud's authentication or unknown-model errors
  (configuration mistakes the operator must see) and privacy refusals never fall back.
* :class:`FailoverStream`: runs one request on a list of :class:`Attempt` in order and yields
  one stream of chunks. When an attempt fails before any text was delivered, the next one
  simply starts; when it fails *after* some text was delivered, the next one continues from
  the prompt plus that partial answer (``continue_final_message``, an assistant prefill), so
  the caller gets one answer with no text repeated and none lost. Every switch is appended to
  ``route.fallbacks`` (``from``, ``to``, ``cause``, ``error``, ``at_chars``, ``at_tokens``, and
  ``resume_s``: seconds from the failure to the next backend's first text), and every chunk
  carries the current ``route``.

Retries of a retryable cloud error on the *same* endpoint (429/503/connect, with backoff and
``Retry-After``) happen inside :class:`~edgecloud.cloud.client.CloudBackend`; this module moves
between endpoints and sides.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

from .backend import Backend
from .errors import (
    AuthenticationError,
    BackendError,
    BackendUnavailableError,
    ContextOverflowError,
    EdgeCloudError,
    InvalidRequestError,
    ModelError,
    PrivacyViolationError,
    RateLimitedError,
)
from .types import ChatCompletionChunk, ChatMessage, ChatRequest, RouteInfo, Usage

__all__ = ["Attempt", "CircuitBreaker", "FailoverStream", "Part", "can_fall_back", "cause_of"]

Side = Literal["edge", "cloud"]


class CircuitBreaker:
    """Closed → open after ``failure_threshold`` consecutive failures → half-open after ``cooldown_s``."""

    def __init__(
        self, name: str, *, failure_threshold: int = 3, cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.failure_threshold, self.cooldown_s, self._clock = failure_threshold, cooldown_s, clock
        self._failures = 0
        self._opened_at: float | None = None
        self._trial = False
        self._lock = threading.Lock()

    @property
    def state(self) -> Literal["closed", "open", "half_open"]:
        """``closed`` (healthy), ``open`` (skipped) or ``half_open`` (one trial allowed)."""
        with self._lock:
            return self._state()

    def _state(self) -> Literal["closed", "open", "half_open"]:
        if self._opened_at is None:
            return "closed"
        return "half_open" if self._clock() - self._opened_at >= self.cooldown_s else "open"

    def available(self) -> bool:
        """Whether a request could be sent now (does not take the half-open trial)."""
        with self._lock:
            state = self._state()
            return state == "closed" or (state == "half_open" and not self._trial)

    def allow(self) -> bool:
        """Take permission to send one request (the half-open trial, when half-open)."""
        with self._lock:
            state = self._state()
            if state == "closed":
                return True
            if state == "half_open" and not self._trial:
                self._trial = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._failures, self._opened_at, self._trial = 0, None, False

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            self._trial = False
            if self._opened_at is not None or self._failures >= self.failure_threshold:
                self._opened_at = self._clock()  # (re)open: a failed trial restarts the cooldown

    def release(self) -> None:
        """Give back a trial that ended without a verdict (the caller stopped reading)."""
        with self._lock:
            self._trial = False

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.name!r}, {self.state}, failures={self._failures})"


def cause_of(exc: BaseException, side: Side) -> str:
    """A short, low-cardinality name for why a backend failed (metrics label, route record)."""
    if isinstance(exc, ContextOverflowError):
        return "context_overflow"
    if isinstance(exc, RateLimitedError):
        return "rate_limited"
    if side == "edge":
        if isinstance(exc, MemoryError):
            return "out_of_memory"
        return "load_error" if isinstance(exc, (ModelError, OSError)) else "edge_error"
    transport = type(exc.__cause__).__name__ if exc.__cause__ is not None else ""
    text = str(exc)
    if transport in ("ConnectError", "ConnectTimeout") or text.startswith("cannot connect"):
        return "connect"
    if transport.endswith("Timeout") or "(read_timeout)" in text:
        return "timeout"
    if "malformed stream" in text:
        return "malformed_stream"
    if " broke after " in text or " ended after " in text or "dropped the connection" in text:
        return "disconnected"
    return "server_error"


def _raise_typed(exc: BaseException, where: str) -> NoReturn:
    """Raise ``exc`` when it is one of ours, else a BackendError naming the backend."""
    if isinstance(exc, EdgeCloudError):
        raise exc
    raise BackendError(f"{where} failed: {type(exc).__name__}: {exc}") from exc


def can_fall_back(exc: BaseException, side: Side = "edge") -> bool:
    """Whether another backend could answer where this error happened.

    A cloud that refuses the key (401/403) or does not serve the configured model (404) is a
    configuration mistake the operator must see, not an outage: those are raised. On the
    edge, a missing or broken model file falls back like any other load failure.
    """
    if isinstance(exc, (AuthenticationError, PrivacyViolationError)):
        return False
    if side == "cloud" and isinstance(exc, ModelError):
        return False
    if isinstance(exc, ContextOverflowError):
        return True  # the other side may have a larger context
    if isinstance(exc, InvalidRequestError):
        return False  # the request itself is wrong: every backend would refuse it
    return isinstance(exc, (EdgeCloudError, OSError, MemoryError, RuntimeError))


@dataclass
class Attempt:
    """One backend to try, with its health."""

    side: Side
    backend: Backend
    breaker: CircuitBreaker
    label: str = ""


@dataclass
class Part:
    """What one backend contributed to an answer (for cost and usage)."""

    side: Side
    backend: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    ok: bool = False
    chars: int = 0


@dataclass
class FailoverStream:
    """One request over ``attempts`` in order, switching on failure (also mid-stream).

    ``on_fallback(from_side, to_side, cause, at_chars)`` is called at each switch; ``finalize``
    receives the last chunk (with the finish reason) and the parts, before it is yielded, to
    set usage and cost. ``usage`` of the final chunk is the sum of the parts: the prompt
    tokens of the first part, completion tokens of all (a part cut short without usage is
    counted as one token per content chunk it delivered).
    """

    attempts: list[Attempt]
    request: ChatRequest
    route: RouteInfo
    mid_stream: bool = True
    on_fallback: Callable[[str, str, str, int], None] | None = None
    finalize: Callable[[ChatCompletionChunk, list[Part]], None] | None = None
    parts: list[Part] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[ChatCompletionChunk]:
        delivered: list[str] = []
        head: ChatCompletionChunk | None = None  # id/created/model of the caller's stream
        last_error: BaseException | None = None
        pending_from: tuple[Attempt, BaseException] | None = None
        failed_at: float | None = None  # when the last failure was seen (for ``resume_s``)
        for attempt in self.attempts:
            if not attempt.breaker.allow():
                self.skipped.append(f"{attempt.label or attempt.side}: circuit open")
                continue
            if pending_from is not None:
                self._record(pending_from[0], attempt, pending_from[1], len("".join(delivered)))
                pending_from = None
            text = "".join(delivered)
            request = self._continuation(text) if text else self.request
            self.route.target, self.route.backend = attempt.side, attempt.backend.name
            part = Part(attempt.side, attempt.backend.name)
            self.parts.append(part)
            started = time.perf_counter()
            stream: Any = None
            verdict = False
            try:
                stream = attempt.backend.stream(request)
                for chunk in stream:
                    chunk.route = self.route
                    if head is None:
                        head = chunk
                    else:
                        chunk.id, chunk.created, chunk.model = head.id, head.created, head.model
                    content = chunk.text
                    if content and failed_at is not None:
                        self.route.fallbacks[-1]["resume_s"] = round(time.perf_counter() - failed_at, 4)
                        failed_at = None
                    if content:
                        delivered.append(content)
                        part.chars += len(content)
                        part.completion_tokens += 1
                    if chunk.usage is not None:
                        part.prompt_tokens = chunk.usage.prompt_tokens
                        part.completion_tokens = chunk.usage.completion_tokens
                    finished = any(c.finish_reason is not None for c in chunk.choices)
                    if finished:
                        part.ok, part.seconds = True, time.perf_counter() - started
                        attempt.breaker.success()
                        verdict = True
                        chunk.usage = self._usage(chunk.usage)
                        if self.finalize is not None:
                            self.finalize(chunk, self.parts)
                    elif len(self.parts) > 1 and not content and chunk.choices and chunk.choices[0].delta.role:
                        continue  # a continuing backend's opening role chunk: the caller had one
                    yield chunk
                if verdict:
                    return
                raise BackendError(f"{attempt.backend.name} ended its stream without a finish reason")
            except GeneratorExit:
                raise
            except BaseException as exc:  # noqa: BLE001 - classified below, re-raised if final
                part.seconds = time.perf_counter() - started
                if verdict:
                    raise
                attempt.breaker.failure()
                verdict = True
                if not isinstance(exc, Exception):
                    raise
                if not can_fall_back(exc, attempt.side) or (delivered and not self.mid_stream):
                    _raise_typed(exc, attempt.label or attempt.backend.name)
                last_error = exc
                pending_from = (attempt, exc)
                failed_at = time.perf_counter()
            finally:
                if not verdict:
                    attempt.breaker.release()
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
        if last_error is not None:
            failed = pending_from[0] if pending_from is not None else self.attempts[-1]
            _raise_typed(last_error, failed.label or failed.backend.name)
        raise BackendUnavailableError(
            "no backend could take the request: " + "; ".join(self.skipped or ["none configured"])
        )

    def _record(self, failed: Attempt, nxt: Attempt, exc: BaseException, at_chars: int) -> None:
        cause = cause_of(exc, failed.side)
        self.route.fallbacks.append({
            "from": failed.side, "from_backend": failed.label or failed.backend.name,
            "to": nxt.side, "to_backend": nxt.label or nxt.backend.name,
            "cause": cause, "error": str(exc)[:300], "at_chars": at_chars,
            "at_tokens": sum(p.completion_tokens for p in self.parts),
        })
        if self.on_fallback is not None:
            self.on_fallback(failed.side, nxt.side, cause, at_chars)

    def _continuation(self, partial: str) -> ChatRequest:
        """The request that continues ``partial``: prompt + the partial answer as an open turn."""
        done_tokens = sum(p.completion_tokens for p in self.parts)  # called before the next part starts
        update: dict[str, Any] = {
            "messages": [*self.request.messages, ChatMessage(role="assistant", content=partial)],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
        if self.request.max_tokens is not None:
            update["max_tokens"] = max(1, self.request.max_tokens - done_tokens)
        return self.request.model_copy(update=update)

    def _usage(self, reported: Usage | None) -> Usage:
        if len(self.parts) == 1 and reported is not None:
            return reported  # one backend answered: its own count (with cached tokens) stands
        earlier = sum(p.completion_tokens for p in self.parts[:-1])
        # the caller's prompt: the first part's count, else the last part's minus the partial answer
        prompt = (self.parts[0].prompt_tokens or max(0, self.parts[-1].prompt_tokens - earlier)) if self.parts else 0
        completion = sum(p.completion_tokens for p in self.parts)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
