"""Token mode: the edge writes, and hands the cloud a span wherever it is unsure.

This module owns :class:`TokenCollab`. The edge streams from its first token with its own
next-token distribution (``logprobs`` + ``top_logprobs``, which every edge runtime gives);
each token passes the :class:`~edgecloud.collab.gate.Gate` before the caller sees it. When
the gate says the edge is unsure, that token is dropped, the edge's stream is closed, and the
cloud continues from the prompt plus the text so far (``continue_final_message``) for one
span: at most ``span_tokens`` tokens, and with ``span_stop="line"`` up to the end of the line
it is writing (the span ends with the token that holds the line break). Then the edge resumes from the combined text (its prefix cache makes that
cost only the span's tokens). The caller sees one stream; each chunk's ``route.target`` says
which side wrote it.

Failures: a span that fails, answers 429 or sends nothing within ``span_timeout_s`` is
dropped (``route.fallbacks`` records it, the circuit breaker counts it) and the edge writes
the token it was unsure of itself; while the cloud's circuit is open the edge writes alone.
A cloud that refuses the key or the model (401/403/404) is a configuration mistake: raised
as :class:`~edgecloud.errors.ConfigError`. An edge that fails mid-answer hands the rest to
the cloud.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from ..backend import close_stream
from ..errors import BackendError
from ..fallback import Attempt
from ..types import ChatCompletionChunk, FinishReason, TokenLogprob
from .run import SharedAnswer, SharedMode, pump, read_chunk, register_mode
from .gate import Gate

__all__ = ["TokenCollab", "TokenMode"]


def _split(content: str, entries: list[TokenLogprob], cut: int) -> str | None:
    """The text of ``entries[:cut]`` when ``content`` starts with it (None: no clean split)."""
    head = b"".join(bytes(e.bytes or []) for e in entries[:cut])
    try:
        prefix = head.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return prefix if content.startswith(prefix) else None


class TokenCollab(SharedAnswer):
    """One answer in token mode (see the module docstring)."""

    mode = "token"

    @property
    def gate(self) -> Gate:
        return Gate(self.settings.gate_signal, self.settings.gate)

    def chunks(self) -> Iterator[ChatCompletionChunk]:
        gate, trust = self.gate, 0
        self.count_prompt()
        while True:
            outcome = yield from self._edge_segment(gate, trust)
            if outcome is None:  # the edge failed: the cloud finished the answer
                return
            if outcome is not True:  # the edge finished the answer
                yield from self.final(outcome)
                return
            if self.remaining() == 0:
                yield from self.final("length")
                return
            trust = 1  # unless a span writes it, the edge writes the token it was unsure of
            attempt = self.cloud_attempt()
            if attempt is None:  # every cloud circuit is open: the edge writes alone for now
                continue
            at = len(self.text)
            finished = yield from self._span(attempt)
            if finished is not None:
                yield from self.final(finished)
                return
            if len(self.text) > at:
                trust = 0
            if self.remaining() == 0:
                yield from self.final("length")
                return

    def _edge_segment(self, gate: Gate, trust: int) -> Iterator[ChatCompletionChunk]:
        """Stream the edge until it finishes (returns the finish reason), is unsure (returns
        True), or fails (the cloud finishes the answer; returns None)."""
        request = self.continuation(logprobs=True, top_logprobs=max(self.settings.top_logprobs,
                                                                        self.request.top_logprobs or 0))
        part = self.recorder.part("edge", self.edge.name)
        started = time.perf_counter()
        spans_possible = bool(self.clouds)
        stream = None
        try:
            stream = self.edge.stream(request)
            for chunk in stream:
                facts = read_chunk(chunk, part)
                if facts is None:
                    continue
                content, entries, finish_reason = facts
                cut = None
                if spans_possible:
                    for i, entry in enumerate(entries):
                        if trust > 0:
                            trust -= 1
                            continue
                        if gate.unsure(entry):
                            cut = i
                            break
                if cut is not None:
                    prefix = _split(content, entries, cut)
                    if prefix is not None:
                        self.recorder.wrote("edge", cut)
                        part.completion_tokens += cut
                        yield from self.emit("edge", prefix, entries[:cut])
                        return True
                n = len(entries) if entries else (1 if content else 0)
                self.recorder.wrote("edge", n)
                part.completion_tokens += n
                yield from self.emit("edge", content, entries)
                if finish_reason is not None:
                    part.ok = True
                    return finish_reason
            raise BackendError(f"{self.edge.name} ended its stream without a finish reason", cause="disconnected")
        except Exception as exc:  # noqa: BLE001 - the edge failed: the cloud finishes the answer
            close_stream(stream)
            stream = None
            part.seconds = time.perf_counter() - started
            yield from self.cloud_finishes(exc)
            return None
        finally:
            part.seconds = time.perf_counter() - started
            close_stream(stream)

    def _span(self, attempt: Attempt) -> Iterator[ChatCompletionChunk]:
        """One cloud span; returns the finish reason when the cloud ended the answer, else None."""
        settings = self.settings
        request = self.continuation(max_tokens=settings.span_tokens, logprobs=True, top_logprobs=None)
        part = self.recorder.part("cloud", attempt.backend.name)
        part.prompt_tokens = self.recorder.prompt_tokens + self.written  # unless usage says
        part.calls = 1
        self.recorder.cloud_call()
        started = time.perf_counter()
        written, outcome = 0, "ok"
        finish: FinishReason | None = None
        reads = pump(lambda: attempt.backend.stream(request), settings.span_timeout_s, None)
        try:
            for chunk in reads:
                facts = read_chunk(chunk, part)
                if facts is None:
                    continue
                content, entries, finish_reason = facts
                n = len(entries) if entries else (1 if content else 0)
                if settings.span_stop == "line" and "\n" in content:  # the span ends with this token
                    written += n
                    self.recorder.wrote("cloud", n)
                    yield from self.emit("cloud", content, entries, backend=attempt.backend.name)
                    outcome = "line"
                    break
                written += n
                self.recorder.wrote("cloud", n)
                yield from self.emit("cloud", content, entries, backend=attempt.backend.name)
                if finish_reason is not None:
                    if finish_reason == "stop" or self.remaining() == 0:
                        finish = finish_reason
                        outcome = "finished"
                    else:
                        outcome = "budget"
                    break
        except Exception as exc:  # noqa: BLE001 - classified: a configuration mistake is raised
            part.seconds = time.perf_counter() - started
            self.cloud_failed(attempt, exc, "span")
            self.span_done("failed", written, part.seconds)
            return None
        finally:
            reads.close()
        attempt.breaker.success()
        part.ok, part.completion_tokens = True, written
        part.seconds = time.perf_counter() - started
        self.span_done(outcome, written, part.seconds)
        return finish


@register_mode
class TokenMode(SharedMode):
    """Token mode (see the module docstring)."""

    name = "token"
    needs_logprobs = True
    describe = "the edge writes, the cloud writes spans where the edge is unsure"
    answer = TokenCollab
