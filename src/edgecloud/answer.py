"""The one answer recorder: everything an answer says about where it ran, written in one place.

This module owns :class:`AnswerRecorder`, created once per request by its run (or by a
:class:`~edgecloud.fallback.FailoverStream` used on its own), and :class:`Part`, one backend
request's share of an answer. Every layer that produces an answer *reports* to the recorder;
none writes a route field itself (``tests/test_layering.py`` reads the source to hold that):

* the router's decision (target, reason, score) starts the record;
* :meth:`~AnswerRecorder.note` adds a typed :class:`~edgecloud.types.RouteNote` (the route's
  ``reason`` is the decision's words followed by each note's);
* :meth:`~AnswerRecorder.serving` says which side and backend write now (the failover);
* :meth:`~AnswerRecorder.fell_back` records a typed :class:`~edgecloud.types.FallbackEvent`;
* :meth:`~AnswerRecorder.collaborating` / :meth:`~AnswerRecorder.wrote` /
  :meth:`~AnswerRecorder.cloud_call` count who wrote which tokens, in a shared answer;
* :meth:`~AnswerRecorder.part` opens a :class:`Part` for each backend request (cost, usage);
* :meth:`~AnswerRecorder.finish` completes the last chunk: usage, the final route, cost.

Chunks carry :meth:`~AnswerRecorder.snapshot` copies: a chunk the caller holds never changes
afterwards; the final chunk's route is the complete one. Hooks (metrics, trace events, pricing)
are called by the recorder as the facts arrive, so a layer has one place to report to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .types import ChatCompletionChunk, FallbackEvent, NoteCode, RouteInfo, RouteNote, Usage

__all__ = ["AnswerHooks", "AnswerRecorder", "Part"]

Side = Literal["edge", "cloud"]


@dataclass
class Part:
    """What one backend request contributed to an answer (for cost and usage).

    ``prompt_tokens`` is what the request billed as input (``cached_tokens`` of it read from the
    server's prefix cache), ``completion_tokens`` what it generated; ``calls`` counts the
    requests behind this part (a collaborative part may stand for several rounds) and
    ``passes`` the cloud's forward passes for them.
    """

    side: Side
    backend: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    ok: bool = False
    chars: int = 0
    cached_tokens: int = 0
    calls: int = 0
    passes: int = 0
    #: False for an answer that was written but not handed to the caller (a cascade's escalated
    #: edge answer): it is paid for, but not part of the answer's usage or tokens.
    delivered: bool = True


@dataclass
class AnswerHooks:
    """Who hears about an answer as it forms: ``on_fallback(from, to, cause, at_chars)`` and
    ``on_span(mode, outcome, cloud_tokens, seconds)`` (metrics, trace events) and
    ``finalize(final_chunk, parts)`` (pricing: sets ``final_chunk.cost``)."""

    on_fallback: Callable[[str, str, str, int], None] | None = None
    on_span: Callable[[str, str, int, float], None] | None = None
    finalize: Callable[[ChatCompletionChunk, list[Part]], None] | None = None


class AnswerRecorder:
    """The route, parts and token counts of one answer; the only writer of route fields.

    ``route`` is the live record (read it, never write it); give an existing
    :class:`~edgecloud.types.RouteInfo` to record into it, or let the recorder start one from
    the router's decision (``target``, ``score``, and ``decided``: the deciding rule's note code
    and its words, the route's first note).
    """

    def __init__(
        self, route: RouteInfo | None = None, *, target: Side = "edge", decided: tuple[NoteCode, str] | None = None,
        score: float | None = None, hooks: AnswerHooks | None = None,
    ) -> None:
        self.route = route if route is not None else RouteInfo(target=target, backend="", score=score)
        self._base_reason = self.route.reason
        self.hooks = hooks or AnswerHooks()
        self.parts: list[Part] = []
        #: Answer tokens per side, counted as a shared answer is written (None: from the parts).
        self._tokens: dict[str, int] | None = None
        self._calls = 0
        #: The caller's prompt tokens, when a shared answer counted them (its usage reports them).
        self.prompt_tokens = 0
        self._snapshot: RouteInfo | None = None
        if decided is not None:  # the router's decision, coded by the rule that made it
            self.note(decided[0], decided[1], score)

    # ------------------------------------------------------------------ facts

    def note(self, code: NoteCode, text: str, value: float | None = None) -> None:
        """Add a typed note; its words join the route's reason."""
        self.route.notes.append(RouteNote(code=code, text=text, value=value))
        self.route.reason = "; ".join(t for t in [self._base_reason, *(n.text for n in self.route.notes)] if t)
        self._changed()

    def redirect(self, target: Side) -> None:
        """The answer starts on ``target`` after all (a mode that starts on the other side)."""
        self.route.target = target
        self._changed()

    def serving(self, side: Side, backend: str) -> None:
        """``backend`` on ``side`` writes the answer from now on."""
        self.route.target, self.route.backend = side, backend
        self._changed()

    def fell_back(self, event: FallbackEvent) -> None:
        """A backend failed (or its answer was not good enough) and ``event.to`` takes over."""
        self.route.fallbacks.append(event)
        self._changed()
        if self.hooks.on_fallback is not None:
            self.hooks.on_fallback(event.from_, event.to, event.cause, event.at_chars)

    def resumed(self, seconds: float) -> None:
        """The backend that took over wrote its first text ``seconds`` after the last failure."""
        last = self.route.fallbacks[-1]
        self.route.fallbacks[-1] = last.model_copy(update={"resume_s": round(seconds, 4)})
        self._changed()

    def collaborating(self, mode: str) -> None:
        """The sides share this answer in ``mode``: tokens and cloud calls are counted as written."""
        self.route.collab = mode
        self._tokens = {"edge": 0, "cloud": 0}
        self._calls = 0
        self.route.tokens, self.route.cloud_calls = dict(self._tokens), 0
        self._changed()

    def set_mode(self, mode: str) -> None:
        """How the sides share the answer (``off``, ``cascade`` ...), before anything is written."""
        self.route.collab = mode
        self._changed()

    def wrote(self, side: Side, n: int) -> None:
        """``n`` more answer tokens were written by ``side`` (a shared answer)."""
        if self._tokens is not None and n:
            self._tokens[side] += n
            self._changed()

    def cloud_call(self) -> None:
        """One more request went to the cloud for this shared answer."""
        self._calls += 1
        self._changed()

    def span(self, mode: str, outcome: str, cloud_tokens: int, seconds: float) -> None:
        """A cloud span or verification round ended (``outcome``: ok, line, finished, failed ...)."""
        if self.hooks.on_span is not None:
            self.hooks.on_span(mode, outcome, cloud_tokens, seconds)

    def discard(self) -> None:
        """The parts so far were not handed to the caller (their answer was replaced)."""
        for part in self.parts:
            part.delivered = False
        self._changed()

    def part(self, side: Side, backend: str) -> Part:
        """A new part of the answer (one backend request, or a collaborative side's share)."""
        part = Part(side, backend)
        self.parts.append(part)
        return part

    # ------------------------------------------------------------------ reading

    @property
    def tokens(self) -> dict[str, int]:
        """Answer tokens per side so far."""
        if self._tokens is not None:
            return dict(self._tokens)
        counted = {"edge": 0, "cloud": 0}
        for part in self.parts:
            if part.delivered:
                counted[part.side] += part.completion_tokens
        return counted

    @property
    def cloud_calls(self) -> int:
        """Requests sent to the cloud for this answer so far."""
        return self._calls if self._tokens is not None else sum(1 for p in self.parts if p.side == "cloud")

    def snapshot(self, side: Side | None = None, backend: str | None = None) -> RouteInfo:
        """The route as it stands now, as a copy no later event changes (``side``/``backend``: who
        wrote the chunk that carries it, in a shared answer)."""
        if self._snapshot is None:
            update: dict[str, Any] = {"fallbacks": list(self.route.fallbacks), "notes": list(self.route.notes)}
            if self._tokens is not None:
                update.update(tokens=dict(self._tokens), cloud_calls=self._calls)
            self._snapshot = self.route.model_copy(update=update)
        if side is None:
            return self._snapshot
        return self._snapshot.model_copy(update={"target": side, "backend": backend or self._snapshot.backend})

    def usage(self, reported: Usage | None = None) -> Usage:
        """The answer's usage: one backend's own report when it alone answered, else the parts summed
        (the caller's prompt counted once: :attr:`prompt_tokens` in a shared answer, else the
        first part's, else the last part's less the partial answer it continued)."""
        if self._tokens is not None:
            prompt = self.prompt_tokens
            completion = self._tokens["edge"] + self._tokens["cloud"]
            return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        parts = [p for p in self.parts if p.delivered]
        if len(parts) == 1 and reported is not None:
            return reported
        earlier = sum(p.completion_tokens for p in parts[:-1])
        prompt = (parts[0].prompt_tokens or max(0, parts[-1].prompt_tokens - earlier)) if parts else 0
        completion = sum(p.completion_tokens for p in parts)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def finish(self, chunk: ChatCompletionChunk, reported: Usage | None = None) -> ChatCompletionChunk:
        """Complete the answer's last chunk: its usage, the final route (tokens per side, cloud
        calls; a shared answer is credited to the side that wrote most of it) and its cost."""
        chunk.usage = self.usage(reported)
        tokens = self.tokens
        self.route.tokens, self.route.cloud_calls = tokens, self.cloud_calls
        if self._tokens is not None:
            self.route.target = "edge" if tokens["edge"] >= tokens["cloud"] else "cloud"
            self.route.backend = "edgecloud-collab"
        self._changed()
        chunk.route = self.snapshot()
        if self.hooks.finalize is not None:
            self.hooks.finalize(chunk, self.parts)
        return chunk

    def _changed(self) -> None:
        self._snapshot = None


def event(failed_side: Side, failed_backend: str, to_side: Side, to_backend: str, cause: str, error: BaseException | str,
          *, at_chars: int = 0, at_tokens: int = 0, during: str | None = None) -> FallbackEvent:
    """A :class:`~edgecloud.types.FallbackEvent` (the error's text cut to 300 characters)."""
    return FallbackEvent(from_=failed_side, from_backend=failed_backend, to=to_side, to_backend=to_backend,
                         cause=cause, error=str(error)[:300], at_chars=at_chars, at_tokens=at_tokens, during=during)
