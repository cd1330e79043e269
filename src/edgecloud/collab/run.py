"""What every way of writing an answer shares: the mode interface, its registry, and the shared-answer base.

This module owns:

* :class:`AnswerRun` - everything a mode needs for one request: the request, the attempts
  (edge and cloud backends with their circuit breakers), the settings, and the answer's
  :class:`~edgecloud.answer.AnswerRecorder` (the only place a mode reports to);
* :class:`Mode` and :data:`MODES` - one strategy per way of sharing an answer (``off``: one side
  writes it through the failover; ``cascade``; ``token``; ``verified``); a new mode is one
  module and one :func:`register_mode` line;
* :class:`SharedAnswer` - the base of the modes in which both sides write (token, verified):
  the caller's one stream (each chunk's ``route`` says which side wrote it), token counting,
  recorded cloud failures, the final chunk; when the edge fails mid-answer it hands the rest to
  the one failover (:class:`~edgecloud.fallback.FailoverStream` with a
  :class:`~edgecloud.fallback.Handover`), as a plain answer would;
* :func:`pump` - reading a cloud stream on a helper thread so a span can be given up at a
  deadline (a stalled span must not stall the answer).
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from ..answer import AnswerRecorder, Part, event
from ..backend import ChatTokenizer, close_stream, iterate_in_worker
from ..config import CollabSettings
from ..errors import AuthenticationError, BackendError, ConfigError, ExtensionUnsupportedError, ModelError
from ..fallback import Attempt, FailoverStream, Handover, can_fall_back, cause_of, continuation
from ..router.cascade import ConfidenceCheck
from ..tools.parse import ToolCallParser
from ..tools.spec import ToolCall
from .auto import auto_mode
from ..types import (
    ChatCompletionChunk,
    ChatRequest,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    FinishReason,
    TokenLogprob,
    new_completion_id,
    now,
)

__all__ = [
    "MODES", "AnswerRun", "Mode", "SharedAnswer", "SharedMode", "SpanDeadline", "pump", "read_chunk", "register_mode",
    "strip_logprobs",
]


@dataclass
class AnswerRun:
    """One request as a mode sees it (built by :class:`~edgecloud.hybrid.Hybrid`)."""

    request: ChatRequest
    #: Backends to use, in failover order (the chosen side first).
    attempts: list[Attempt]
    settings: CollabSettings
    recorder: AnswerRecorder
    #: Whether a stream broken after some text continues on another backend.
    mid_stream: bool = True
    #: The cascade's check of a finished edge answer (None: the packaged one).
    confidence: ConfidenceCheck | None = None
    #: Whether ``collab="auto"`` chose the mode (a mode that turns out not to fit then steps aside).
    auto: bool = False
    #: Whether the clouds see a redacted conversation (no token ids may be shared with them).
    redacted: bool = False
    #: The edge attempt verified mode drafts with, where it is another file than the edge's (a
    #: faster one of the same model: ``edge_draft_model``), made on first use; None: the edge's.
    drafter: Callable[[], Attempt] | None = None

    def step_down(self, refused: ExtensionUnsupportedError, by: Attempt) -> Iterator[ChatCompletionChunk]:
        """The answer, written by the next mode ``auto`` ranks (:func:`~edgecloud.collab.auto.auto_mode`)
        now that ``by`` refused an extension; called before anything of it was shown."""
        edge = self.edge
        assert edge is not None
        name, why = auto_mode(edge.backend, [a.backend for a in self.clouds], redacted=self.redacted, probe=True,
                              request=self.request)
        mode = MODES[name or "off"]
        self.recorder.note("collab_mode", f"{by.label or by.backend.name} refused {refused.extension!r}: "
                                          f"{mode.name} mode instead ({why})")
        self.recorder.set_mode(mode.name)
        yield from mode().chunks(self)

    @property
    def edge(self) -> Attempt | None:
        return next((a for a in self.attempts if a.side == "edge"), None)

    @property
    def clouds(self) -> list[Attempt]:
        return [a for a in self.attempts if a.side == "cloud"]

    def failover(self, request: ChatRequest | None = None, attempts: list[Attempt] | None = None,
                 handover: Handover | None = None) -> FailoverStream:
        """The one failover over ``attempts`` (default: all) for ``request`` (default: the caller's)."""
        return FailoverStream(self.attempts if attempts is None else attempts, request or self.request, self.recorder,
                              self.mid_stream, handover=handover)


class Mode(ABC):
    """One way to write an answer. Subclasses implement :meth:`chunks`; :meth:`achunks` runs it on
    the worker pool unless a mode has an async path of its own."""

    #: The registry name (``collab=`` on a request or in the settings).
    name: ClassVar[str]
    #: Whether both sides write (token counts and cloud calls are counted as the answer forms).
    shared: ClassVar[bool] = False
    #: Whether it decides between the sides while the answer is written (needs both sides up).
    decides_while_writing: ClassVar[bool] = False
    #: Whether it runs only for the router's middle band of scores (the buffered cascade).
    middle_band_only: ClassVar[bool] = False
    #: Whether the cloud writes the answer's first tokens (the edge does in every other shared mode).
    cloud_opens: ClassVar[bool] = False
    #: Whether it reads the edge's token logprobs (an edge runtime without them cannot run it).
    needs_logprobs: ClassVar[bool] = False
    #: Whether it works on a redacted conversation (a mode that sends token ids cannot).
    can_redact: ClassVar[bool] = True
    #: How the sides share the answer, in words (the route's ``collab_mode`` note).
    describe: ClassVar[str] = ""

    @abstractmethod
    def chunks(self, run: AnswerRun) -> Iterator[ChatCompletionChunk]:
        """The caller's chunks for ``run``."""

    async def achunks(self, run: AnswerRun) -> AsyncIterator[ChatCompletionChunk]:
        """Async twin of :meth:`chunks` (the edge decodes on a worker thread anyway)."""
        async for chunk in iterate_in_worker(lambda: self.chunks(run)):
            yield chunk


#: Every mode by name; :func:`register_mode` adds one.
MODES: dict[str, type[Mode]] = {}


def register_mode(mode: type[Mode]) -> type[Mode]:
    """Add ``mode`` to :data:`MODES` under its ``name`` (a class decorator)."""
    MODES[mode.name] = mode
    return mode


class SharedMode(Mode):
    """A mode in which both sides write: each answer is one :attr:`answer` run."""

    shared = True
    decides_while_writing = True
    #: The per-answer state and loop (a :class:`SharedAnswer` subclass).
    answer: ClassVar[type[SharedAnswer]]

    def chunks(self, run: AnswerRun) -> Iterator[ChatCompletionChunk]:
        return self.answer(run).chunks()


# ---------------------------------------------------------------------------- helpers


class SpanDeadline(BackendError):
    """A cloud request did not answer within the collaboration's deadline."""


_END = object()


def strip_logprobs(chunks: list[ChatCompletionChunk]) -> None:
    """Drop the token logprobs a mode asked for itself from chunks the caller did not ask them for."""
    for chunk in chunks:
        for choice in chunk.choices:
            choice.logprobs = None


def read_chunk(chunk: ChatCompletionChunk, part: Part) -> tuple[str, list[TokenLogprob], FinishReason | None] | None:
    """A streamed chunk's text, token logprobs and finish reason (None: a chunk without a choice);
    its usage, when it has one, goes on ``part``."""
    if chunk.usage is not None:
        part.prompt_tokens = chunk.usage.prompt_tokens
        part.completion_tokens = chunk.usage.completion_tokens
        part.cached_tokens = chunk.usage.cached_tokens
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
            close_stream(stream)
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


# ---------------------------------------------------------------------------- answers both sides write


class SharedAnswer:
    """One answer both sides write (the base of token and verified mode's per-request state).

    ``edge`` is the edge attempt (its backend writes by default), ``clouds`` the cloud attempts
    in order. Subclasses implement :meth:`chunks`.
    """

    mode = "shared"

    def __init__(self, run: AnswerRun) -> None:
        edge = run.edge
        if edge is None or not run.clouds:
            raise ConfigError(f"collab={self.mode!r} needs an edge model and a cloud endpoint")
        self.run, self.request, self.settings, self.recorder = run, run.request, run.settings, run.recorder
        self.edge_attempt, self.edge, self.clouds = edge, edge.backend, run.clouds
        self.id, self.created = new_completion_id(), now()
        self.model = self.edge.model_name or self.edge.name
        self.text = ""
        self._opened = False
        #: Tool calls in the answer text (verified mode writes calls with both sides), streamed as OpenAI does.
        self._calls = (ToolCallParser((t.function.name for t in self.request.tools or ()), stream=True)
                       if self.request.tool_mode.mode != "none" and self.request.tools else None)
        self.recorder.collaborating(self.mode)

    # ------------------------------------------------------------------ the caller's chunks

    @property
    def written(self) -> int:
        """Answer tokens written so far, by both sides."""
        tokens = self.recorder.tokens
        return tokens["edge"] + tokens["cloud"]

    def emit(self, side: str, text: str, logprobs: list[TokenLogprob] | None = None,
             backend: str | None = None) -> Iterator[ChatCompletionChunk]:
        """The chunks that hand ``text`` (written by ``side``) to the caller."""
        if not self._opened:
            self._opened = True
            yield self._chunk(ChoiceDelta(role="assistant", content=""), side, backend)
        if not text:
            return
        self.text += text
        calls: list[ToolCall] = []
        if self._calls is not None:
            text, calls = self._calls.push(text)
        keep = logprobs if self.request.logprobs and logprobs else None
        if keep is not None:
            top_n = self.request.top_logprobs or 0
            keep = [e.model_copy(update={"top_logprobs": e.top_logprobs[:top_n]}) for e in keep]
        if text:
            yield self._chunk(ChoiceDelta(content=text), side, backend, logprobs=keep)
        yield from self._call_chunks(calls, side, backend)

    def _call_chunks(self, calls: list[ToolCall], side: str, backend: str | None) -> Iterator[ChatCompletionChunk]:
        """One chunk per tool-call delta (the streamed pieces, then ``calls`` whole), as OpenAI streams them."""
        if self._calls is not None:
            for delta in self._calls.deltas(calls):
                yield self._chunk(ChoiceDelta(tool_calls=[delta]), side, backend)

    def _chunk(self, delta: ChoiceDelta, side: str, backend: str | None, *, logprobs: Any = None,
               finish: FinishReason | None = None) -> ChatCompletionChunk:
        if side == "edge":
            route = self.recorder.snapshot("edge", backend or self.edge.name)
        elif side == "cloud":
            route = self.recorder.snapshot("cloud", backend or "cloud")
        else:
            route = self.recorder.snapshot()
        choice = ChunkChoice(delta=delta, finish_reason=finish,
                             logprobs=ChoiceLogprobs(content=logprobs) if logprobs is not None else None)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice], route=route)

    def final(self, reason: FinishReason) -> Iterator[ChatCompletionChunk]:
        """The last chunk: finish reason, usage summed over the sides, the complete route, cost."""
        yield from self.emit("edge", "")  # the role chunk, if nothing was written at all
        if self._calls is not None:  # what the parser still holds: text, or a call without its closing tag
            tail, calls = self._calls.flush()
            if tail:
                yield self._chunk(ChoiceDelta(content=tail), "", None)
            yield from self._call_chunks(calls, "", None)
            if self._calls.calls and reason == "stop":
                reason = "tool_calls"
        yield self.recorder.finish(self._chunk(ChoiceDelta(), "", None, finish=reason))

    # ------------------------------------------------------------------ requests and failures

    def count_prompt(self) -> None:
        """The caller's prompt tokens, counted by the edge's tokenizer where it has one (for usage)."""
        if isinstance(self.edge, ChatTokenizer):
            try:
                self.recorder.prompt_tokens = len(self.edge.tokenize_chat(self.request.message_dicts()))
            except Exception:  # noqa: BLE001 - a count for usage; the answer does not depend on it
                self.recorder.prompt_tokens = 0

    def remaining(self) -> int | None:
        """Answer tokens still allowed by ``max_tokens`` (None: no limit asked)."""
        if self.request.max_tokens is None:
            return None
        return max(0, self.request.max_tokens - self.written)

    def continuation(self, **update: Any) -> ChatRequest:
        """The caller's request continued from the answer so far (an open assistant turn)."""
        return continuation(self.request, self.text, self.written, **update)

    def cloud_attempt(self) -> Attempt | None:
        """The first cloud whose circuit lets a request through (it is taken: report the outcome)."""
        for attempt in self.clouds:
            if attempt.breaker.allow():
                return attempt
        return None

    def cloud_failed(self, attempt: Attempt, exc: BaseException, what: str) -> None:
        """A cloud request failed: raise a configuration mistake, else record it and carry on on the edge."""
        if isinstance(exc, ExtensionUnsupportedError) and self.run.auto:
            attempt.breaker.release()  # not an outage: the endpoint works, without this extension
            self.clouds = [a for a in self.clouds if a is not attempt]
            self.recorder.note("collab_mode", f"{attempt.label or attempt.backend.name} refused {exc.extension!r} "
                                              f"({exc}): the edge writes on alone")
            return
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
        self.recorder.fell_back(event("cloud", attempt.label or attempt.backend.name, "edge", self.edge.name,
                                      cause_of(exc, "cloud"), exc, at_chars=len(self.text), at_tokens=self.written,
                                      during=what))

    def span_done(self, outcome: str, cloud_tokens: int, seconds: float) -> None:
        self.recorder.span(self.mode, outcome, cloud_tokens, seconds)

    def cloud_finishes(self, exc: BaseException) -> Iterator[ChatCompletionChunk]:
        """The edge failed mid-answer: the cloud writes the rest through the one failover."""
        if not isinstance(exc, Exception) or not can_fall_back(exc, "edge"):
            raise exc
        head = ChatCompletionChunk(id=self.id, created=self.created, model=self.model)
        handover = Handover(self.edge_attempt, exc, chars=len(self.text), tokens=self.written, head=head)
        yield from self.run.failover(self.continuation(), self.clouds, handover)

    def chunks(self) -> Iterator[ChatCompletionChunk]:  # pragma: no cover - abstract
        raise NotImplementedError
