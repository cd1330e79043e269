"""The model's tool calls, read from its streamed text.

This module owns :class:`ToolCallParser`: text deltas in, answer text and whole
:class:`~edgecloud.tools.spec.ToolCall` objects out. A call is written
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes / Qwen2.5's format, and the
one :mod:`edgecloud.tools.prompt` teaches templates without tools); ``"parameters"`` is read as
``"arguments"`` (Llama 3's spelling). Text that might be the start of a tag is held back until it
is known not to be; text inside a tag is never shown as answer text. A tag whose body is not a
call (not JSON, no name) is handed back as text, as written: nothing is dropped. A call cut off
by the token budget is a call only if what was written parses; otherwise it is text too.
Whitespace around calls is not answer text (an answer of calls alone has ``content: null``).

Small models often answer with a bare call instead, a JSON object naming a declared function,
fenced (```json) or not: an answer that *opens* that way is held back while it can still be
one, and is a call when the object parses and names a declared function (the text after it,
if any, stays text). A slipped doubled opening brace (``{{"name": ...``) is forgiven, in a bare
call or between the tags. Any other answer streams as it comes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from .prompt import CLOSE, OPEN
from .spec import CalledFunction, ToolCall, new_call_id

__all__ = ["ToolCallParser", "parse_call"]


def _slipped(text: str) -> str:
    """``text`` without a slipped extra opening brace (``{{"name": ...}}`` or ``{{"name": ...}``)."""
    squeezed = text.strip()
    if squeezed.startswith("{") and re.sub(r"\s+", "", squeezed).startswith("{" + _BARE_START):
        inner = squeezed[1:].lstrip()
        try:
            _, end = json.JSONDecoder().raw_decode(inner)
        except ValueError:
            return text
        rest = inner[end:].strip()
        return inner[:end] + (rest[1:] if rest.startswith("}") else rest)
    return text


def parse_call(body: str) -> ToolCall | None:
    """The call ``body`` (the text between the tags) writes, None when it is not one (a slipped
    doubled opening brace is forgiven)."""
    try:
        data = json.loads(_slipped(body))
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments: Any = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=new_call_id(), function=CalledFunction(name=data["name"],
                                                              arguments=json.dumps(arguments, ensure_ascii=False)))


_FENCE = re.compile(r"\s*(?:```(?:json)?\s*)?")
_BARE_START = '{"name"'


def _bare_call(text: str, names: set[str]) -> tuple[ToolCall, str] | None:
    """The call a whole answer opens with (and the text after it), None when it opens with none."""
    body = _slipped(text[_FENCE.match(text).end():])  # type: ignore[union-attr]
    try:
        data, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return None
    call = parse_call(json.dumps(data)) if isinstance(data, dict) and data.get("name") in names else None
    if call is None:
        return None
    rest = body[end:].lstrip()
    return call, rest.removeprefix("```").strip()


def _bare_state(text: str) -> str:
    """``maybe`` while ``text`` (the answer so far) may still open with a bare call, ``yes`` once
    it opens with ``{"name"``, ``no`` when it cannot."""
    if "```json".startswith(text.strip()):
        return "maybe"  # nothing but whitespace or the start of a fence so far
    fence = _FENCE.match(text)
    rest = text[fence.end():]  # type: ignore[union-attr]
    if not rest:
        return "maybe"
    squeezed = re.sub(r"\s+", "", rest)
    if squeezed.startswith("{{"):  # a slipped doubled opening brace
        squeezed = squeezed[1:]
    if squeezed.startswith(_BARE_START):
        return "yes"
    if _BARE_START.startswith(squeezed) and not rest.endswith("```"):
        return "maybe"
    return "no"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that a ``tag`` could start with."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Split streamed answer text into text and tool calls (:meth:`push` each delta, then :meth:`flush`)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._names = set(names)
        self._opening = "maybe" if self._names else "no"  # may the answer still open with a bare call?
        self._buffer = ""
        self._in_call = False
        self._space = ""  # whitespace not yet known to be answer text
        self._after_call = False  # a call was the last thing found
        #: Every call found so far, in order.
        self.calls: list[ToolCall] = []

    def _text(self, text: str) -> str:
        """Answer text to emit; trailing whitespace is held until something other than a call
        follows it (the space around calls is not answer text)."""
        out = self._space + text
        kept = out.rstrip()
        self._space = out[len(kept):]
        if self._after_call:
            kept = kept.lstrip()
        if kept:
            self._after_call = False
        return kept

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Answer text to emit now, and the calls completed by ``delta``."""
        self._buffer += delta
        if self._opening != "no":
            self._opening = _bare_state(self._buffer)
            if self._opening != "no" and OPEN not in self._buffer:
                return "", []  # held: the answer may be a bare call
            self._opening = "no"
        text: list[str] = []
        found: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._in_call = False
                call = parse_call(body)
                if call is None:
                    text.append(self._text(OPEN + body + CLOSE))
                else:
                    self._space, self._after_call = "", True
                    self.calls.append(call)
                    found.append(call)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                text.append(self._text(self._buffer[:start]))
                self._buffer = self._buffer[start + len(OPEN):]
                self._in_call = True
                continue
            held = _held_prefix(self._buffer, OPEN)
            text.append(self._text(self._buffer[:len(self._buffer) - held]))
            self._buffer = self._buffer[len(self._buffer) - held:]
            break
        return "".join(text), found

    def flush(self) -> tuple[str, list[ToolCall]]:
        """What is still held at the end of the answer: text, or a call left without its closing tag."""
        rest, self._buffer = self._buffer, ""
        if self._opening == "yes":
            self._opening = "no"
            bare = _bare_call(rest, self._names)
            if bare is not None:
                self.calls.append(bare[0])
                return bare[1], [bare[0]]
        if self._in_call:
            self._in_call = False
            call = parse_call(rest)
            if call is not None:
                self.calls.append(call)
                self._space = ""
                return "", [call]
            return self._text(OPEN + rest), []
        text = self._text(rest)
        if not self.calls and self._space:  # an answer of text only keeps its whitespace
            text, self._space = text + self._space, ""
        return text, []
