"""Failover for the hybrid client: backend health, failure causes, and one stream across backends.

This module owns three things:

* :class:`CircuitBreaker`: per-backend health. ``failure_threshold`` consecutive failures open
  the circuit (the backend is skipped); after ``cooldown_s`` it is half-open and lets one
  trial request through; a success closes it, a failure opens it again.
* :func:`cause_of` / :func:`can_fall_back`: which errors move a request to another backend,
  and the short cause recorded for it. The cause is typed where the failure happened
  (:attr:`edgecloud.errors.EdgeCloudError.cause`: ``connect``, ``timeout``, ``rate_limited``,
  ``server_error``, ``malformed_stream``, ``disconnected``, ``load_error``, ``out_of_memory``,
  ``context_overflow``, ``runtime_error`` ...); an exception edgecloud did not raise is typed
  by its class (``MemoryError``, ``OSError``), else ``unknown``. No message text is read.
  Bad requests (the same on every backend), a cloud's authentication or unknown-model errors
  (configuration mistakes the operator must see) and privacy refusals never fall back.
* :class:`FailoverStream`: runs one request on a list of :class:`Attempt` in order and yields
  one stream of chunks. When an attempt fails before any text was delivered, the next one
  simply starts; when it fails *after* some text was delivered, the next one continues from
  the prompt plus that partial answer (``continue_final_message``, an assistant prefill), so
  the caller gets one answer with no text repeated and none lost. Tool calls are passed on
  whole: a backend that streams a call in pieces (vLLM) is held until the call is complete
  (the next call starts or the answer finishes), so a failure inside a call drops its pieces
  and the next backend writes that call again; after a whole call was delivered, a failure is
  raised rather than spliced (a continuation cannot carry the calls made so far). Every switch is appended to
  ``route.fallbacks`` (``from``, ``to``, ``cause``, ``error``, ``at_chars``, ``at_tokens``, and
  ``resume_s``: seconds from the failure to the next backend's first text). Every chunk carries
  a snapshot of the route as it was when the chunk was produced (a chunk the caller holds never
  changes afterwards); the final chunk's is the complete one. :class:`FailoverStream` is
  iterated with ``for`` (each backend's ``stream``) or ``async for`` (each backend's
  ``astream``): the decisions live in one sans-I/O core (:class:`_Failover`), the two loops
  only move chunks.

Retries of a retryable cloud error on the *same* endpoint (429/503/connect, with backoff and
``Retry-After``) happen inside :class:`~edgecloud.remote.client.CloudBackend`; this module moves
between endpoints and sides.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from .backend import Backend, aclose_stream, close_stream
from .errors import (
    AuthenticationError,
    BackendError,
    BackendUnavailableError,
    ContextOverflowError,
    EdgeCloudError,
    FailureCause,
    InvalidRequestError,
    ModelError,
    PrivacyViolationError,
)
from .answer import AnswerHooks, AnswerRecorder, Part, event
from .tools.spec import ToolCallDelta
from .types import ChatCompletionChunk, ChatMessage, ChatRequest, RouteInfo

__all__ = ["Attempt", "CircuitBreaker", "FailoverStream", "Handover", "Part", "can_fall_back", "cause_of", "continuation"]

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


def cause_of(exc: BaseException, side: Side) -> FailureCause:
    """A short, low-cardinality name for why a backend failed (metrics label, route record).

    Read from the error's type: edgecloud's errors carry the cause their raise site gave them;
    anything else is named by its class (``MemoryError`` -> ``out_of_memory``; ``OSError`` on
    the edge -> ``load_error``), else ``unknown``.
    """
    if isinstance(exc, EdgeCloudError):
        return exc.cause
    if isinstance(exc, MemoryError):
        return "out_of_memory"
    if isinstance(exc, OSError) and side == "edge":
        return "load_error"
    return "unknown"


def _raise_typed(exc: BaseException, where: str, side: Side) -> NoReturn:
    """Raise ``exc`` when it is one of ours, else a BackendError naming the backend and the cause."""
    if isinstance(exc, EdgeCloudError):
        raise exc
    raise BackendError(f"{where} failed: {type(exc).__name__}: {exc}", cause=cause_of(exc, side)) from exc


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


@dataclass(frozen=True)
class Handover:
    """An answer another run started and could not finish: the attempt that failed with
    ``error`` after ``chars`` characters / ``tokens`` tokens of it reached the caller, under the
    stream head (id, created, model) ``head``. A :class:`FailoverStream` given one records the
    switch against the backend that takes over, and continues the caller's stream."""

    attempt: "Attempt"
    error: BaseException
    chars: int
    tokens: int
    head: ChatCompletionChunk | None = None


@dataclass
class Attempt:
    """One backend to try, with its health."""

    side: Side
    backend: Backend
    breaker: CircuitBreaker
    label: str = ""


class FailoverStream:
    """One request over ``attempts`` in order, switching on failure (also mid-stream).

    ``record`` is the answer's :class:`~edgecloud.answer.AnswerRecorder` (or a
    :class:`~edgecloud.types.RouteInfo` to record into: a recorder is made around it). The
    final chunk's ``usage`` is the sum of the parts: the prompt tokens of the first part,
    completion tokens of all (a part cut short without usage is counted as one token per content
    chunk it delivered). ``on_fallback(from_side, to_side, cause, at_chars)`` and
    ``finalize(final_chunk, parts)`` are hooks for a stream used on its own (a recorder given in
    carries its own). Iterate it with ``for`` or ``async for``.
    """

    def __init__(
        self, attempts: list[Attempt], request: ChatRequest, record: AnswerRecorder | RouteInfo,
        mid_stream: bool = True, on_fallback: Callable[[str, str, str, int], None] | None = None,
        finalize: Callable[[ChatCompletionChunk, list[Part]], None] | None = None,
        handover: Handover | None = None,
    ) -> None:
        self.attempts, self.request, self.mid_stream, self.handover = attempts, request, mid_stream, handover
        if isinstance(record, AnswerRecorder):
            self.recorder = record
        else:
            self.recorder = AnswerRecorder(record, hooks=AnswerHooks(on_fallback=on_fallback, finalize=finalize))
        #: The parts this stream ran (one per attempt that started).
        self.parts: list[Part] = []
        self.skipped: list[str] = []

    @property
    def route(self) -> RouteInfo:
        """The answer's live route record (read-only: the recorder writes it)."""
        return self.recorder.route

    def __iter__(self) -> Iterator[ChatCompletionChunk]:
        run = _Failover(self)
        for attempt, request in run.plan():
            with run.attempting():
                yield from run.pass_on(attempt.backend.stream(request))
                return
        run.exhausted()

    async def __aiter__(self) -> AsyncIterator[ChatCompletionChunk]:
        run = _Failover(self)
        for attempt, request in run.plan():
            with run.attempting():
                async for out in run.apass_on(attempt.backend.astream(request)):
                    yield out
                return
        run.exhausted()

    def snapshot(self) -> RouteInfo:
        """The route as it stands now, as a copy no later switch will change."""
        return self.recorder.snapshot()

    def _continuation(self, partial: str) -> ChatRequest:
        """The request that continues ``partial``: prompt + the partial answer as an open turn."""
        return continuation(self.request, partial, sum(p.completion_tokens for p in self.parts))


def continuation(request: ChatRequest, partial: str, done_tokens: int = 0, **update: Any) -> ChatRequest:
    """``request`` continued after ``partial`` more answer text (``done_tokens`` of ``max_tokens``
    used): the partial answer becomes an open assistant turn, or extends the one ``request``
    already continues. ``update``: further fields (a span's own ``max_tokens``, logprobs)."""
    changes: dict[str, Any] = dict(update)
    if partial:
        messages = list(request.messages)
        if request.continue_final_message:  # the caller's own partial answer goes first
            last = messages[-1]
            messages[-1] = ChatMessage(role=last.role, content=last.content + partial)
        else:
            messages.append(ChatMessage(role="assistant", content=partial))
        changes.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
    if request.max_tokens is not None:
        left = max(0, request.max_tokens - done_tokens)
        changes["max_tokens"] = max(1, min(left, changes.get("max_tokens") or left))
    return request.model_copy(update=changes)


class _Failover:
    """The decisions of one :class:`FailoverStream` run, without I/O: which attempt starts with
    which request, what each chunk becomes, and what a failure means. The sync and async loops
    of :class:`FailoverStream` call these in the same order."""

    def __init__(self, owner: FailoverStream) -> None:
        self.owner = owner
        self.recorder = owner.recorder
        self.delivered: list[str] = []
        self.head: ChatCompletionChunk | None = None  # id/created/model of the caller's stream
        self.last_error: BaseException | None = None
        self.pending_from: tuple[Attempt, BaseException] | None = None
        self.failed_at: float | None = None  # when the last failure was seen (for ``resume_s``)
        self.attempt: Attempt | None = None
        self.part: Part | None = None
        self.started = 0.0
        self.verdict = False
        self.calls: dict[int, ToolCallDelta] = {}  # the current attempt's calls, not yet passed on
        self.calls_delivered = 0
        handover = owner.handover
        if handover is not None:
            self.pending_from = (handover.attempt, handover.error)
            self.last_error = handover.error  # raised (typed) when no other backend can take over
            self.head = handover.head
            self.failed_at = time.perf_counter()

    def plan(self) -> Iterator[tuple[Attempt, ChatRequest]]:
        """Each attempt that may run, with the request it runs (after a failure: the continuation)."""
        for attempt in self.owner.attempts:
            request = self.begin(attempt)
            if request is not None:
                yield attempt, request

    @contextlib.contextmanager
    def attempting(self) -> Iterator[None]:
        """Around one attempt: a failure is classified (:meth:`failed` re-raises what no other
        backend may take over; a cancellation or interrupt passes through untouched)."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - classified in failed(), re-raised if final
            self.failed(exc)
        finally:
            self.settle()

    def pass_on(self, stream: Iterator[ChatCompletionChunk]) -> Iterator[ChatCompletionChunk]:
        """What the caller gets of one attempt's stream; raises when it ends unfinished."""
        try:
            for chunk in stream:
                yield from self.kept(chunk)
            self.ended()
        finally:
            close_stream(stream)

    async def apass_on(self, chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[ChatCompletionChunk]:
        """Async twin of :meth:`pass_on`."""
        try:
            async for chunk in chunks:
                for out in self.kept(chunk):
                    yield out
            self.ended()
        finally:
            await aclose_stream(chunks)

    def kept(self, chunk: ChatCompletionChunk) -> tuple[ChatCompletionChunk, ...]:
        """What the caller gets for ``chunk``: it (as :meth:`take` made it), or nothing."""
        out = self.take(chunk)
        return () if out is None else (out,)

    def _hold_calls(self, chunk: ChatCompletionChunk, finished: bool) -> bool:
        """Take the tool-call pieces off ``chunk``; put back the calls that are complete (every one
        before the highest index seen; all of them when the answer is ``finished``), renumbered
        after those already delivered. True when ``chunk`` carried pieces."""
        took = False
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                ToolCallDelta.gather(self.calls, piece)
                took = True
            choice.delta.tool_calls = None
        if not self.calls or not chunk.choices:
            return took
        last = max(self.calls)
        ready = [i for i in sorted(self.calls) if finished or i < last]
        if ready:
            out = []
            for i in ready:
                call = self.calls.pop(i)
                call.index = self.calls_delivered
                self.calls_delivered += 1
                out.append(call)
            chunk.choices[0].delta.tool_calls = out
        return took

    def begin(self, attempt: Attempt) -> ChatRequest | None:
        """The request ``attempt`` should run, or None when it cannot take over."""
        owner = self.owner
        if self.delivered and not attempt.backend.supports_continuation:
            # it cannot continue a partial answer, and restarting would repeat delivered text
            owner.skipped.append(f"{attempt.label or attempt.side}: cannot continue a partial answer")
            return None
        if not attempt.breaker.allow():
            owner.skipped.append(f"{attempt.label or attempt.side}: circuit open")
            return None
        text = "".join(self.delivered)
        if self.pending_from is not None:
            failed, exc = self.pending_from
            prior = owner.handover
            self.recorder.fell_back(event(
                failed.side, failed.label or failed.backend.name, attempt.side, attempt.label or attempt.backend.name,
                cause_of(exc, failed.side), exc, at_chars=len(text) + (prior.chars if prior else 0),
                at_tokens=sum(p.completion_tokens for p in owner.parts) + (prior.tokens if prior else 0)))
            self.pending_from = None
        self.recorder.serving(attempt.side, attempt.backend.name)
        if attempt.side == "cloud":
            self.recorder.cloud_call()
        self.attempt, self.verdict = attempt, False
        self.part = self.recorder.part(attempt.side, attempt.backend.name)
        owner.parts.append(self.part)
        self.started = time.perf_counter()
        return owner._continuation(text) if text else owner.request

    def take(self, chunk: ChatCompletionChunk) -> ChatCompletionChunk | None:
        """What the caller gets for ``chunk`` (None: drop it)."""
        owner, part, attempt = self.owner, self.part, self.attempt
        assert part is not None and attempt is not None
        if self.head is None:
            self.head = chunk
        else:
            chunk.id, chunk.created, chunk.model = self.head.id, self.head.created, self.head.model
        finished = any(c.finish_reason is not None for c in chunk.choices)
        held_pieces = self._hold_calls(chunk, finished)
        content = chunk.text
        if content and self.failed_at is not None:
            self.recorder.resumed(time.perf_counter() - self.failed_at)
            self.failed_at = None
        if content:
            self.delivered.append(content)
            part.chars += len(content)
            part.completion_tokens += 1
            self.recorder.wrote(attempt.side, 1)
        if chunk.usage is not None:
            # the backend's exact count replaces one token per chunk
            self.recorder.wrote(attempt.side, max(0, chunk.usage.completion_tokens - part.completion_tokens))
            part.prompt_tokens = chunk.usage.prompt_tokens
            part.completion_tokens = chunk.usage.completion_tokens
            part.cached_tokens = chunk.usage.cached_tokens
        if finished:
            part.ok, part.seconds = True, time.perf_counter() - self.started
            part.calls = 1
            attempt.breaker.success()
            self.verdict = True
            return self.recorder.finish(chunk, chunk.usage)
        if (len(owner.parts) > 1 or owner.handover) and not content and chunk.choices and chunk.choices[0].delta.role:
            return None  # a continuing backend's opening role chunk: the caller had one
        if held_pieces and not content and not chunk.choices[0].delta.role and not chunk.choices[0].delta.tool_calls \
                and chunk.choices[0].logprobs is None and chunk.usage is None:
            return None  # only pieces of a call, held until it is whole
        chunk.route = self.recorder.snapshot()
        return chunk

    def ended(self) -> None:
        """The backend's stream ended: fine after a finish chunk, a failure otherwise."""
        if not self.verdict:
            assert self.attempt is not None
            raise BackendError(
                f"{self.attempt.backend.name} ended its stream without a finish reason", cause="disconnected"
            )

    def failed(self, exc: BaseException) -> None:
        """Classify a failure of the current attempt; raises when no other backend may take over."""
        attempt, part = self.attempt, self.part
        assert attempt is not None and part is not None
        part.seconds = time.perf_counter() - self.started
        part.calls = 1
        if self.verdict or not isinstance(exc, Exception):
            raise exc  # after the finish, or a cancellation / interrupt: not the backend's failure
        attempt.breaker.failure()
        self.verdict = True
        self.calls.clear()  # pieces of an unfinished call: the next backend writes it again
        # after a whole call was delivered a continuation cannot carry it: raised, not spliced
        if not can_fall_back(exc, attempt.side) or (self.delivered and not self.owner.mid_stream) or self.calls_delivered:
            _raise_typed(exc, attempt.label or attempt.backend.name, attempt.side)
        self.last_error = exc
        self.pending_from = (attempt, exc)
        self.failed_at = time.perf_counter()

    def settle(self) -> None:
        """Give back a half-open trial that ended without a verdict (the caller stopped reading)."""
        if not self.verdict and self.attempt is not None:
            self.attempt.breaker.release()

    def exhausted(self) -> NoReturn:
        """Every attempt failed or was skipped."""
        owner = self.owner
        if self.last_error is not None:
            failed = self.pending_from[0] if self.pending_from is not None else owner.attempts[-1]
            _raise_typed(self.last_error, failed.label or failed.backend.name, failed.side)
        raise BackendUnavailableError(
            "no backend could take the request: " + "; ".join(owner.skipped or ["none configured"]),
            cause="circuit_open" if owner.skipped else "unknown",
        )
