"""The buffered cascade: the edge answers first, off-stream, and a confidence check decides.

This module owns :class:`CascadeMode` (``collab="cascade"``, for middle-band router scores): the
edge's whole answer is collected (with token logprobs where its runtime gives them: a signal);
the confidence check (:mod:`edgecloud.router.cascade`) either accepts it (it is replayed to the
caller) or escalates: the cloud answers instead, through the one failover, and the route
records a ``low_confidence`` fallback. An edge that fails outright falls back like any answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator

from ..answer import event
from ..fallback import FailoverStream
from ..router.cascade import ConfidenceCheck, signals
from ..types import ChatCompletionChunk, ChatRequest, collect_chunks
from .run import AnswerRun, Mode, register_mode, strip_logprobs
from .plain import structured

__all__ = ["CascadeMode"]


def _probe(run: AnswerRun) -> ChatRequest:
    """The edge's request: with logprobs when the edge runtime gives them (a signal)."""
    edge = run.edge
    if run.request.logprobs or edge is None or not edge.backend.supports_logprobs:
        return run.request
    return run.request.model_copy(update={"logprobs": True})


def _first(run: AnswerRun) -> FailoverStream:
    run.mid_stream = run.mid_stream and not structured(run)
    return run.failover(_probe(run))


def _judge(run: AnswerRun, first: FailoverStream, buffered: list[ChatCompletionChunk]
           ) -> FailoverStream | list[ChatCompletionChunk]:
    """The check's verdict on a buffered edge answer: the chunks to replay, or the cloud stream."""
    answered_on = first.parts[-1].side if first.parts else "edge"
    if answered_on != "edge" or not buffered:
        return buffered
    request, recorder = run.request, run.recorder
    edge = run.edge
    assert edge is not None
    answer = collect_chunks(buffered)
    choice = answer.choices[0]
    logprobs = [e.logprob for e in choice.logprobs.content] if choice.logprobs else []
    prompt = next((m.content for m in reversed(request.messages) if m.role == "user"), "")
    sig = signals(prompt, answer.text, finish_reason=choice.finish_reason, logprobs=logprobs,
                  route_score=recorder.route.score)
    check = (run.confidence or ConfidenceCheck.packaged()).for_backend(edge.backend.supports_logprobs)
    p_good = check.p_good(sig)
    if p_good >= check.threshold:
        recorder.note("cascade_accepted", f"edge answer accepted (confidence {p_good:.2f})", p_good)
        if not request.logprobs:
            strip_logprobs(buffered)
        buffered[-1].route = recorder.snapshot()  # the final chunk carries the complete route
        return buffered
    clouds = run.clouds
    recorder.discard()  # the edge's answer is paid for, but the caller gets the cloud's
    recorder.fell_back(event("edge", edge.label or edge.backend.name, "cloud",
                             clouds[0].label or clouds[0].backend.name if clouds else "cloud", "low_confidence",
                             f"edge answer confidence {p_good:.2f} < {check.threshold}"))
    return run.failover(attempts=clouds)


@register_mode
class CascadeMode(Mode):
    """Edge first, checked, escalated when unsure (see the module docstring)."""

    name = "cascade"
    middle_band_only = True

    def chunks(self, run: AnswerRun) -> Iterator[ChatCompletionChunk]:
        first = _first(run)
        verdict: Iterable[ChatCompletionChunk] = _judge(run, first, list(first))
        yield from verdict

    async def achunks(self, run: AnswerRun) -> AsyncIterator[ChatCompletionChunk]:
        first = _first(run)
        buffered = [chunk async for chunk in first]
        verdict = _judge(run, first, buffered)
        if isinstance(verdict, FailoverStream):
            async for chunk in verdict:
                yield chunk
        else:
            for chunk in verdict:
                yield chunk
