"""What every collaborative answer shares: one stream to the caller, parts, failures, the final chunk.

This module owns :class:`CollabRun`, the base of token mode (:mod:`.token`) and verified mode
(:mod:`.verified`): it emits the caller's chunks (each one's ``route`` says which side wrote
it), keeps one :class:`~edgecloud.fallback.Part` per edge segment and per cloud request (cost
and usage split by side), records a failed cloud request in ``route.fallbacks`` and on its
circuit breaker, lets the other side finish the answer when one side fails for good, and
builds the final chunk (finish reason, usage, ``route.tokens``, ``route.cloud_calls``).

It also owns :func:`pump`, which reads a stream on a helper thread so a cloud request can be
given up at a deadline (a stalled span must not stall the answer).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..backend import Backend
from ..config import CollabSettings
from ..errors import (
    AuthenticationError,
    BackendError,
    ConfigError,
    EdgeCloudError,
    ModelError,
)
from ..fallback import Attempt, Part, can_fall_back, cause_of
from ..types import (
    ChatCompletionChunk,
    ChatMessage,
    ChatRequest,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    FinishReason,
    RouteInfo,
    TokenLogprob,
    Usage,
    new_completion_id,
    now,
)

__all__ = ["CollabHooks", "CollabRun", "SpanDeadline", "pump", "read_chunk"]


class SpanDeadline(BackendError):
    """A cloud request did not answer within the collaboration's deadline."""


_END = object()


def read_chunk(chunk: ChatCompletionChunk, part: Part) -> tuple[str, list[TokenLogprob], FinishReason | None] | None:
    """A streamed chunk's text, token logprobs and finish reason (None: a chunk without a choice);
    its usage, when it has one, goes on ``part``."""
    if chunk.usage is not None:
        part.prompt_tokens = chunk.usage.prompt_tokens
        part.completion_tokens = chunk.usage.completion_tokens
    if not chunk.choices:
        return None
    choice = chunk.choices[0]
    return choice.delta.content or "", choice.logprobs.content if choice.logprobs is not None else [], choice.finish_reason


def pump(make: Callable[[], Iterator[Any]], first_s: float, next_s: float | None = None) -> Iterator[Any]:
    """Items of ``make()``, read on a helper thread; :class:`SpanDeadline` when the first item takes
    longer than ``first_s`` seconds (later ones: ``next_s``, None = no limit). Closing this
    iterator stops the reader at its next item (a reader blocked in I/O ends at its own timeout)."""
    items: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()

    def reader() -> None:
        stream = None
        try:
            stream = make()
            for item in stream:
                items.put(item)
                if stop.is_set():
                    break
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            items.put(exc)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
            items.put(_END)

    threading.Thread(target=reader, name="edgecloud-span", daemon=True).start()
    limit: float | None = first_s
    try:
        while True:
            try:
                item = items.get(timeout=limit)
            except queue.Empty:
                raise SpanDeadline(f"the cloud sent nothing within {limit:g} s", cause="timeout") from None
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            limit = next_s
    finally:
        stop.set()


@dataclass
class CollabHooks:
    """How a collaborative run reports: ``on_fallback(from, to, cause, at_chars)``,
    ``finalize(final_chunk, parts)`` (cost), ``on_span(mode, outcome, cloud_tokens, seconds)``
    (metrics, trace event)."""

    on_fallback: Callable[[str, str, str, int], None] | None = None
    finalize: Callable[[ChatCompletionChunk, list[Part]], None] | None = None
    on_span: Callable[[str, str, int, float], None] | None = None


class CollabRun:
    """Base of a collaborative answer (see the module docstring); subclasses implement :meth:`chunks`."""

    mode = "collab"

    def __init__(
        self, request: ChatRequest, edge: Backend, clouds: list[Attempt], settings: CollabSettings,
        route: RouteInfo, hooks: CollabHooks | None = None,
    ) -> None:
        self.request, self.edge, self.clouds, self.settings = request, edge, clouds, settings
        self.route, self.hooks = route, hooks or CollabHooks()
        self.id, self.created = new_completion_id(), now()
        self.model = edge.model_name or edge.name
        self.text = ""
        self.tokens = {"edge": 0, "cloud": 0}
        self.parts: list[Part] = []
        self.prompt_tokens = 0
        self.cloud_calls = 0
        self._opened = False
        route.collab = self.mode
        route.tokens, route.cloud_calls = dict(self.tokens), 0

    # ------------------------------------------------------------------ the caller's chunks

    def emit(self, side: str, text: str, logprobs: list[TokenLogprob] | None = None,
             backend: str | None = None) -> Iterator[ChatCompletionChunk]:
        """The chunks that hand ``text`` (written by ``side``) to the caller."""
        if not self._opened:
            self._opened = True
            yield self._chunk(ChoiceDelta(role="assistant", content=""), side, backend)
        if not text:
            return
        self.text += text
        keep = logprobs if self.request.logprobs and logprobs else None
        if keep is not None:
            top_n = self.request.top_logprobs or 0
            keep = [e.model_copy(update={"top_logprobs": e.top_logprobs[:top_n]}) for e in keep]
        yield self._chunk(ChoiceDelta(content=text), side, backend, logprobs=keep)

    def _chunk(self, delta: ChoiceDelta, side: str, backend: str | None, *, logprobs: Any = None,
               finish: FinishReason | None = None, usage: Usage | None = None) -> ChatCompletionChunk:
        route = self.route.model_copy(update={"fallbacks": [dict(f) for f in self.route.fallbacks],
                                             "tokens": dict(self.tokens), "cloud_calls": self.cloud_calls})
        if side in ("edge", "cloud"):
            route.target = side  # type: ignore[assignment]
            route.backend = backend or (self.edge.name if side == "edge" else "cloud")
        choice = ChunkChoice(delta=delta, finish_reason=finish,
                             logprobs=ChoiceLogprobs(content=logprobs) if logprobs is not None else None)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice],
                                   usage=usage, route=route)

    def final(self, reason: FinishReason) -> Iterator[ChatCompletionChunk]:
        """The last chunk: finish reason, usage summed over the parts, the complete route, cost."""
        yield from self.emit("edge", "")  # the role chunk, if nothing was written at all
        completion = self.tokens["edge"] + self.tokens["cloud"]
        usage = Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                      total_tokens=self.prompt_tokens + completion)
        self.route.tokens, self.route.cloud_calls = dict(self.tokens), self.cloud_calls
        self.route.target = "edge" if self.tokens["edge"] >= self.tokens["cloud"] else "cloud"  # type: ignore[assignment]
        self.route.backend = "edgecloud-collab"
        chunk = self._chunk(ChoiceDelta(), "", None, finish=reason, usage=usage)
        chunk.route = self.route.model_copy(update={"fallbacks": [dict(f) for f in self.route.fallbacks]})
        if self.hooks.finalize is not None:
            self.hooks.finalize(chunk, self.parts)
        yield chunk

    # ------------------------------------------------------------------ requests and failures

    def count_prompt(self) -> None:
        """The caller's prompt tokens, counted by the edge's tokenizer where it has one (for usage)."""
        tokenize = getattr(self.edge, "tokenize_chat", None)
        if tokenize is not None:
            try:
                self.prompt_tokens = len(tokenize(self.request.message_dicts()))
            except Exception:  # noqa: BLE001 - a count for usage; the answer does not depend on it
                self.prompt_tokens = 0

    def remaining(self) -> int | None:
        """Answer tokens still allowed by ``max_tokens`` (None: no limit asked)."""
        if self.request.max_tokens is None:
            return None
        return max(0, self.request.max_tokens - self.tokens["edge"] - self.tokens["cloud"])

    def continuation(self, **update: Any) -> ChatRequest:
        """The caller's request continued from the answer so far (an open assistant turn)."""
        changes: dict[str, Any] = dict(update)
        if self.text:
            base = self.request
            messages = list(base.messages)
            if base.continue_final_message:  # the caller's own partial answer goes first
                last = messages[-1]
                messages[-1] = ChatMessage(role=last.role, content=last.content + self.text)
            else:
                messages.append(ChatMessage(role="assistant", content=self.text))
            changes.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
        left = self.remaining()
        if left is not None:
            changes["max_tokens"] = max(1, min(left, changes.get("max_tokens") or left))
        return self.request.model_copy(update=changes)

    def cloud_attempt(self) -> Attempt | None:
        """The first cloud whose circuit lets a request through (it is taken: report the outcome)."""
        for attempt in self.clouds:
            if attempt.breaker.allow():
                return attempt
        return None

    def cloud_failed(self, attempt: Attempt, exc: BaseException, what: str) -> None:
        """A cloud request failed: raise a configuration mistake, else record it and carry on on the edge."""
        if isinstance(exc, ConfigError):
            attempt.breaker.release()
            raise exc
        if isinstance(exc, (AuthenticationError, ModelError)):
            attempt.breaker.release()
            raise ConfigError(f"the cloud ({attempt.label or attempt.backend.name}) refused a {what}: {exc}; "
                              "check cloud_api_key and cloud_model", cause=exc.cause) from exc
        if not isinstance(exc, Exception) or not can_fall_back(exc, "cloud"):
            attempt.breaker.release()
            raise exc
        attempt.breaker.failure()
        cause = cause_of(exc, "cloud")
        self.route.fallbacks.append({
            "from": "cloud", "from_backend": attempt.label or attempt.backend.name, "to": "edge",
            "to_backend": self.edge.name, "cause": cause, "error": str(exc)[:300], "at_chars": len(self.text),
            "at_tokens": self.tokens["edge"] + self.tokens["cloud"], "during": what,
        })
        if self.hooks.on_fallback is not None:
            self.hooks.on_fallback("cloud", "edge", cause, len(self.text))

    def span_done(self, outcome: str, cloud_tokens: int, seconds: float) -> None:
        if self.hooks.on_span is not None:
            self.hooks.on_span(self.mode, outcome, cloud_tokens, seconds)

    def new_part(self, side: str, backend: str) -> Part:
        part = Part(side, backend)  # type: ignore[arg-type]
        self.parts.append(part)
        return part

    def cloud_finishes(self, exc: BaseException) -> Iterator[ChatCompletionChunk]:
        """The edge failed mid-answer: the cloud writes the rest (as a plain fallback would)."""
        if not isinstance(exc, Exception) or not can_fall_back(exc, "edge"):
            raise exc
        cause = cause_of(exc, "edge")
        for attempt in self.clouds:
            if not attempt.breaker.allow():
                continue
            self.route.fallbacks.append({
                "from": "edge", "from_backend": self.edge.name, "to": "cloud",
                "to_backend": attempt.label or attempt.backend.name, "cause": cause, "error": str(exc)[:300],
                "at_chars": len(self.text), "at_tokens": self.tokens["edge"] + self.tokens["cloud"],
            })
            if self.hooks.on_fallback is not None:
                self.hooks.on_fallback("edge", "cloud", cause, len(self.text))
            part = self.new_part("cloud", attempt.backend.name)
            self.cloud_calls += 1
            started = time.perf_counter()
            reason: FinishReason = "stop"
            counted = 0
            stream = attempt.backend.stream(self.continuation())
            try:
                for chunk in stream:
                    facts = read_chunk(chunk, part)
                    if facts is None:
                        continue
                    content, _, finish = facts
                    if content:
                        counted += 1
                        self.tokens["cloud"] += 1
                        yield from self.emit("cloud", content, backend=attempt.backend.name)
                    if finish is not None:
                        reason = finish
                        self.tokens["cloud"] += max(0, part.completion_tokens - counted)  # the exact count
            except Exception as cloud_exc:
                attempt.breaker.failure()
                raise BackendError(f"the edge failed ({exc}) and the cloud could not finish: {cloud_exc}",
                                   cause=cause_of(cloud_exc, "cloud")) from cloud_exc
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
            attempt.breaker.success()
            part.ok, part.seconds = True, time.perf_counter() - started
            yield from self.final(reason)
            return
        if isinstance(exc, EdgeCloudError):
            raise exc
        raise BackendError(f"the edge failed: {exc}", cause=cause) from exc

    def chunks(self) -> Iterator[ChatCompletionChunk]:  # pragma: no cover - abstract
        raise NotImplementedError
