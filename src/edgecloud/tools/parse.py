"""The model's tool calls, read from its streamed text.

This module owns :class:`ToolCallParser`: text deltas in, answer text and
:class:`~edgecloud.tools.spec.ToolCall` objects (or their streamed pieces) out. A call is written
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes / Qwen2.5's format, and the
one :mod:`edgecloud.tools.prompt` teaches templates without tools); ``"parameters"`` is read as
``"arguments"`` (Llama 3's spelling). Text that might be the start of a tag is held back until it
is known not to be; text inside a tag is never shown as answer text. A tag whose body is not a
call (not JSON, no name) is handed back as text, as written: nothing is dropped. A call cut off
by the token budget is a call only if what was written parses; otherwise it is text too.

With ``stream`` (runtimes that hold calls to their grammar), each call's arguments stream as they
are written, the way OpenAI sends them: a first delta with the call's index, id, type and name,
then the arguments object's text in pieces (:meth:`ToolCallParser.deltas`); the pieces join into
the call's JSON. A streamed call cut off by the token budget stays a call, its arguments as far as
they got, as OpenAI's do (the answer's ``finish_reason`` is ``length``).
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
from .spec import CalledFunction, ToolCall, ToolCallDelta, ToolCallFunctionDelta, new_call_id

__all__ = ["ToolCallParser", "parse_call"]

#: How a call opens when it can stream: its name first, then its arguments object.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
#: A slipped doubled opening brace before a call's own.
_SLIP = re.compile(r"\s*\{(?=\s*\{)")


class _Streamed:
    """One call whose arguments stream as they are written (:meth:`feed` the call's text so far):
    a first piece with the call's index, id, type and name once ``{"name": N, "arguments": {`` is
    read, then the arguments object's text in pieces until it closes. A call that opens otherwise
    (another key order, arguments as a JSON text, a name nobody declared) is not streamed
    (:attr:`off`): it comes out whole when it ends, as without streaming."""

    def __init__(self, index: int, names: set[str]) -> None:
        self.index, self.names = index, names
        self.id, self.name = new_call_id(), ""
        self.started = self.done = self.off = False
        self._start = self._sent = self._end = 0
        self._depth, self._string, self._escape = 0, False, False

    def _open(self, body: str) -> ToolCallDelta | None:
        """The first piece, once ``body`` shows the call's name and the start of its arguments."""
        slip = _SLIP.match(body)
        head = _HEAD.match(body, slip.end() if slip else 0)
        if head is None:
            squeezed = re.sub(r"\s+", "", body).lstrip("{")
            self.off = not ('"name"'.startswith(squeezed[:6]) and (len(squeezed) < 7 or squeezed[6] == ":"))
            return None
        following = body[head.end():head.end() + 1]
        if not following:
            return None  # the arguments have not opened yet
        if following != "{" or (self.names and head.group(1) not in self.names):
            self.off = True
            return None
        self.started, self.name = True, head.group(1)
        self._start = self._sent = head.end()
        return ToolCallDelta(index=self.index, id=self.id, type="function",
                             function=ToolCallFunctionDelta(name=self.name, arguments=""))

    def feed(self, body: str) -> list[ToolCallDelta]:
        """The pieces ``body`` (the call's text so far) adds."""
        if self.off or self.done:
            return []
        out: list[ToolCallDelta] = []
        if not self.started:
            first = self._open(body)
            if first is None:
                return out
            out.append(first)
        scan = max(self._sent, self._start)
        for i in range(scan, len(body)):
            char = body[i]
            if self._string:
                self._string = self._escape or char != '"'
                self._escape = not self._escape and char == "\\"
            elif char == '"':
                self._string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.done, self._end = True, i + 1
                    break
        upto = self._end if self.done else len(body)
        if upto > self._sent:
            out.append(ToolCallDelta(index=self.index,
                                     function=ToolCallFunctionDelta(arguments=body[self._sent:upto])))
            self._sent = upto
        return out

    def call(self, body: str) -> ToolCall:
        """The whole call, its arguments as streamed (``body``: its whole text, already fed)."""
        return ToolCall(id=self.id, function=CalledFunction(name=self.name, arguments=body[self._start:self._sent]))


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

    def __init__(self, names: Iterable[str] = (), *, stream: bool = False) -> None:
        self._names = set(names)
        self._stream = stream
        self._live: _Streamed | None = None  # the call being streamed
        self._pieces: list[ToolCallDelta] = []
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

    def _feed(self, body: str) -> None:
        """With streaming on: feed ``body`` (the current call's text so far) to its streamed call,
        keeping the pieces for :meth:`deltas`."""
        if self._stream:
            if self._live is None:
                self._live = _Streamed(len(self.calls), self._names)
            self._pieces.extend(self._live.feed(body))

    def _ended(self, body: str, call: ToolCall | None) -> list[ToolCall] | None:
        """The call whose text was ``body`` (``call``: as parsed), recorded: the whole calls to send
        (none when it streamed: its pieces went out), or None when ``body`` was no call."""
        live, self._live = self._live, None
        if live is not None and live.started:
            self._pieces.extend(live.feed(body))
            self.calls.append(live.call(body))
            return []
        if call is None:
            return None
        self.calls.append(call)
        return [call]

    def deltas(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        """The ``tool_calls`` deltas to send now: the streamed pieces written since the last time,
        then ``calls`` (whole ones, from :meth:`push` or :meth:`flush`) each in one delta."""
        out, self._pieces = self._pieces, []
        index = {id(c): i for i, c in enumerate(self.calls)}
        return out + [ToolCallDelta.whole(index[id(c)], c) for c in calls]

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Answer text to emit now, and the calls completed by ``delta`` (whole ones; with
        ``stream``, a call that streamed comes out in pieces through :meth:`deltas` instead)."""
        self._buffer += delta
        if self._opening != "no":
            self._opening = _bare_state(self._buffer)
            if self._opening != "no" and OPEN not in self._buffer:
                if self._opening == "yes":
                    self._feed(self._buffer[_FENCE.match(self._buffer).end():])  # type: ignore[union-attr]
                return "", []  # held: the answer may be a bare call
            self._opening = "no"
        text: list[str] = []
        found: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    self._feed(self._buffer)
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._in_call = False
                sent = self._ended(body, parse_call(body))
                if sent is None:
                    text.append(self._text(OPEN + body + CLOSE))
                else:
                    self._space, self._after_call = "", True
                    found.extend(sent)
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
            body = rest[_FENCE.match(rest).end():]  # type: ignore[union-attr]
            sent = self._ended(body, bare[0] if bare is not None else None)
            if sent is not None:
                return (bare[1] if bare is not None else ""), sent
        if self._in_call:
            self._in_call = False
            sent = self._ended(rest, parse_call(rest))
            if sent is not None:
                self._space = ""
                return "", sent
            return self._text(OPEN + rest), []
        text = self._text(rest)
        if not self.calls and self._space:  # an answer of text only keeps its whitespace
            text, self._space = text + self._space, ""
        return text, []
