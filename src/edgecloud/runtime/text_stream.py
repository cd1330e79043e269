"""Turning generated token bytes into text that is safe to emit, one token at a time.

This module owns :class:`TextStream`: incremental UTF-8 decoding (a multi-byte character
split across tokens is held until complete, never emitted in halves) and stop strings (text
that could still become the start of a stop sequence is held back; once a stop sequence
appears, the text before it is released and nothing of the stop sequence is). Every edge
runtime that decodes token by token can share it.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

__all__ = ["TextStream"]


class TextStream:
    """Feed token bytes with :meth:`push`; emit what it returns."""

    __slots__ = ("_decoder", "_stops", "_held", "_max_hold", "stopped")

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        #: True once a stop sequence has been seen; the caller should finish.
        self.stopped = False

    def push(self, data: bytes) -> str:
        """Add one token's bytes; return the text that can be emitted now ('' if none)."""
        text = self._held + self._decoder.decode(data)
        if not self._stops or not text:
            self._held = ""
            return text
        cut = -1
        for stop in self._stops:
            at = text.find(stop)
            if at != -1 and (cut == -1 or at < cut):
                cut = at
        if cut != -1:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._holdback(text)
        if keep:
            self._held = text[-keep:]
            return text[:-keep]
        self._held = ""
        return text

    def flush(self) -> str:
        """Text still held back when generation ends without a stop sequence.

        An incomplete UTF-8 sequence at the very end (a length cut mid-character) is dropped.
        """
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop sequence."""
        for k in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0
