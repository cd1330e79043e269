"""Plain routing: one side writes the whole answer, through the one failover.

This module owns :class:`PlainMode` (``collab="off"``, and every answer that cannot be shared:
structured output, tool calls, privacy, one side configured): the chosen side streams, and on a
failure the next backend takes over (also mid-stream) as :mod:`edgecloud.fallback` describes.
A structured answer (``response_format`` json_object / json_schema) is not continued by another
backend after some text: the other side's grammar cannot pick up halfway.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from ..fallback import FailoverStream
from ..types import ChatCompletionChunk
from .run import AnswerRun, Mode, register_mode

__all__ = ["PlainMode", "structured"]


def structured(run: AnswerRun) -> bool:
    """Whether the answer is held to a grammar (``response_format`` json_object / json_schema)."""
    fmt = run.request.response_format
    return bool(fmt) and fmt.get("type") != "text"


def _failover(run: AnswerRun) -> FailoverStream:
    run.mid_stream = run.mid_stream and not structured(run)
    return run.failover()


@register_mode
class PlainMode(Mode):
    """One side answers (see the module docstring)."""

    name = "off"

    def chunks(self, run: AnswerRun) -> Iterator[ChatCompletionChunk]:
        return iter(_failover(run))

    async def achunks(self, run: AnswerRun) -> AsyncIterator[ChatCompletionChunk]:
        async for chunk in _failover(run):
            yield chunk
