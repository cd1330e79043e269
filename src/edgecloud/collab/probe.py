"""Probe mode: the edge writes its first tokens unseen, and its uncertainty over them decides.

This module owns :class:`ProbeMode` (``collab="probe"``; what ``auto`` runs for a cloud that only
chats, :mod:`.auto`). The edge starts the answer with token logprobs; its first
:attr:`~edgecloud.router.probe.ProbeCheck.tokens` tokens are held back while the
:class:`~edgecloud.router.probe.ProbeCheck` reads them. Then either

* the edge is sure enough: the held tokens go to the caller and the edge streams the rest of its
  answer (the route notes ``probe`` with the check's score), or
* it is not: the edge's stream is closed and the cloud writes the whole answer (a plain chat
  request: nothing beyond what a hosted API takes), recorded as a ``low_confidence`` fallback.

The cloud is called at most once per answer and never sees the edge's tokens, so an answer costs
either nothing in the cloud or exactly the cloud's own answer. An edge that fails, before or after
the decision, falls back through the one failover as a plain answer does.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..answer import event
from ..backend import close_stream
from ..fallback import FailoverStream
from ..router.probe import ProbeCheck
from ..types import ChatCompletionChunk
from .run import AnswerRun, Mode, register_mode, strip_logprobs

__all__ = ["ProbeMode"]


@register_mode
class ProbeMode(Mode):
    """The edge's first tokens decide who writes the answer (see the module docstring)."""

    name = "probe"
    needs_logprobs = True
    decides_while_writing = True
    describe = "the edge's first tokens decide whether it or the cloud writes the answer"

    def chunks(self, run: AnswerRun) -> Iterator[ChatCompletionChunk]:
        check = ProbeCheck.packaged()
        asked = run.request
        request = asked.model_copy(update={"logprobs": True, "top_logprobs": max(2, asked.top_logprobs or 0)})
        first = run.failover(request)
        stream = iter(first)
        held: list[ChatCompletionChunk] = []
        seen: list[tuple[float, float]] = []
        finished = False
        try:
            for chunk in stream:
                held.append(chunk)
                if first.parts and first.parts[-1].side != "edge":
                    break  # the edge failed: the failover's cloud answer passes through
                for choice in chunk.choices:
                    for entry in choice.logprobs.content if choice.logprobs else []:
                        tops = sorted((t.logprob for t in entry.top_logprobs if t.logprob < entry.logprob),
                                      reverse=True)
                        seen.append((entry.logprob, tops[0] if tops else -30.0))
                    finished = finished or choice.finish_reason is not None
                if finished or len(seen) >= check.tokens:
                    break
            on_edge = not first.parts or first.parts[-1].side == "edge"
            if on_edge and run.clouds:
                p = check.p_escalate(seen, finished)
                threshold = check.threshold if run.settings.probe_threshold is None else run.settings.probe_threshold
                if p >= threshold:
                    yield from self._escalate(run, stream, len(seen), p, threshold)
                    return
                run.recorder.note("probe", f"the edge writes: its first {len(seen)} tokens scored {p:.2f} "
                                           f"< {threshold:.2f}", p)
                if finished:
                    held[-1].route = run.recorder.snapshot()  # the final chunk carries the complete route
            if not asked.logprobs:
                strip_logprobs(held)
            yield from held
            for chunk in stream:
                if not asked.logprobs:
                    strip_logprobs([chunk])
                yield chunk
        finally:
            close_stream(stream)

    @staticmethod
    def _escalate(run: AnswerRun, stream: Iterator[ChatCompletionChunk], tokens: int, p: float,
                  threshold: float) -> Iterator[ChatCompletionChunk]:
        """The cloud writes the whole answer; the edge's probe is paid for, never shown."""
        close_stream(stream)
        edge, clouds = run.edge, run.clouds
        assert edge is not None
        recorder = run.recorder
        recorder.discard()
        recorder.note("probe", f"the cloud writes: the edge's first {tokens} tokens scored {p:.2f} >= "
                               f"{threshold:.2f}", p)
        recorder.fell_back(event("edge", edge.label or edge.backend.name, "cloud",
                                 clouds[0].label or clouds[0].backend.name, "low_confidence",
                                 f"probe score {p:.2f} >= {threshold:.2f} after {tokens} tokens"))
        cloud: FailoverStream = run.failover(attempts=clouds)
        yield from cloud
