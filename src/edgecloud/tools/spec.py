"""The shapes of function tools in a chat request and answer, and their validation.

This module owns :class:`ToolSpec` (an entry of ``tools``), :class:`ToolCall` (an entry of an
assistant message's ``tool_calls``, in a request or an answer), :class:`ToolCallDelta` (a
streamed piece of one), :func:`resolve_tool_choice` (OpenAI's ``tool_choice`` forms as one
:class:`ToolChoice`) and :func:`check_tool_history` (every ``tool`` message answers a call an
assistant message made). Errors are ``ValueError`` / :class:`~edgecloud.errors.InvalidRequestError`
whose message names the field and says what to change; the request model turns them into
``invalid 'tools[0].function.parameters': ...``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, field_validator, model_serializer

from ..errors import InvalidRequestError

__all__ = [
    "CalledFunction",
    "FunctionSpec",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFunctionDelta",
    "ToolChoice",
    "ToolSpec",
    "check_tool_history",
    "new_call_id",
    "resolve_tool_choice",
]

#: OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: Most tools one request may declare (OpenAI's limit).
MAX_TOOLS = 128


def new_call_id() -> str:
    """A fresh tool-call id (``call_`` and 24 hex digits, as OpenAI's)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def check_parameters_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` if it is a JSON Schema for an object (ValueError saying what is wrong otherwise)."""
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top level"
        raise ValueError(f"is not a valid JSON schema ({exc.message} at {where})") from None
    kind = schema.get("type", "object")
    if kind != "object":
        raise ValueError(f"must describe a JSON object (type 'object'), got type {kind!r}: a function takes named arguments")
    return schema


class FunctionSpec(BaseModel):
    """A function the model may call: its name, what it does, the JSON Schema of its arguments."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(f"function names are 1-64 letters, digits, '_' or '-', got {name!r}")
        return name

    @field_validator("parameters")
    @classmethod
    def _schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if schema is None else check_parameters_schema(schema)

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """The schema the arguments must match (no ``parameters``: an object with no fields)."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ToolSpec(BaseModel):
    """One entry of a request's ``tools``: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionSpec


class CalledFunction(BaseModel):
    """The function a call names and its arguments, a JSON text (as OpenAI sends them)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str = "{}"

    def arguments_object(self) -> Any:
        """The arguments parsed (the text itself when it is not JSON)."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


class ToolCall(BaseModel):
    """One call an assistant made: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class _Sparse(BaseModel):
    """Serialized without its unset (None) fields, as OpenAI streams call pieces: a piece that
    only adds arguments has no ``id``, ``type`` or ``name`` (clients that merge deltas key by key
    would otherwise overwrite those with null)."""

    @model_serializer(mode="wrap")
    def _without_nones(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallFunctionDelta(_Sparse):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Sparse):
    """A streamed piece of a tool call, as the ``openai`` SDK assembles them (by ``index``)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionDelta | None = None

    @classmethod
    def gather(cls, held: dict[int, "ToolCallDelta"], piece: "ToolCallDelta") -> None:
        """Add a streamed ``piece`` to the call of its ``index`` in ``held`` (name and arguments
        arrive as text to append, the id once), as the ``openai`` SDK assembles them."""
        call = held.setdefault(piece.index, cls(index=piece.index, type="function",
                                                function=ToolCallFunctionDelta(name="", arguments="")))
        call.id = piece.id or call.id
        if piece.function is not None and call.function is not None:
            call.function.name = (call.function.name or "") + (piece.function.name or "")
            call.function.arguments = (call.function.arguments or "") + (piece.function.arguments or "")

    def call(self) -> ToolCall:
        """The assembled call."""
        function = self.function or ToolCallFunctionDelta()
        return ToolCall(id=self.id or "", function=CalledFunction(name=function.name or "",
                                                                 arguments=function.arguments or "{}"))

    @classmethod
    def whole(cls, index: int, call: ToolCall) -> "ToolCallDelta":
        """A whole call in one delta (edgecloud never splits one)."""
        return cls(index=index, id=call.id, type="function",
                   function=ToolCallFunctionDelta(name=call.function.name, arguments=call.function.arguments))


@dataclass(frozen=True)
class ToolChoice:
    """What a request lets the model do with its tools.

    ``mode``: ``none`` (answer in text), ``auto`` (text or calls), ``required`` (at least one
    call); ``name``: the one function it must call (with ``required``). ``parallel``: whether
    one answer may hold several calls.
    """

    mode: Literal["none", "auto", "required"]
    name: str | None = None
    parallel: bool = True

    def allowed(self, tools: Sequence[ToolSpec]) -> list[ToolSpec]:
        """The tools a call may name."""
        return [t for t in tools if self.name is None or t.function.name == self.name]


def resolve_tool_choice(tools: Sequence[ToolSpec] | None, choice: Any, parallel: bool | None) -> ToolChoice:
    """The request's ``tool_choice`` (``"auto"``, ``"none"``, ``"required"`` or
    ``{"type": "function", "function": {"name": ...}}``) checked against its ``tools``."""
    tools = list(tools or [])
    if choice is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel is not False)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"invalid 'tool_choice': unknown value {choice!r}; use 'none', 'auto', "
                                      "'required' or {'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if choice != "none" and not tools:
            raise InvalidRequestError(f"invalid 'tool_choice': {choice!r} needs 'tools' to choose from", param="tool_choice")
        return ToolChoice(choice, parallel=parallel is not False)  # type: ignore[arg-type]
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError("invalid 'tool_choice': a named choice is {'type': 'function', 'function': "
                                  "{'name': ...}}", param="tool_choice")
    known = [t.function.name for t in tools]
    if name not in known:
        raise InvalidRequestError(f"invalid 'tool_choice': no tool named {name!r} in 'tools' (declared: "
                                  f"{', '.join(known) or 'none'})", param="tool_choice.function.name")
    return ToolChoice("required", name=name, parallel=False)


class _Message(Protocol):
    """What :func:`check_tool_history` reads of a chat message (:class:`~edgecloud.types.ChatMessage`)."""

    role: str
    tool_calls: list[ToolCall] | None
    tool_call_id: str | None


def check_tool_history(messages: Sequence[_Message]) -> None:
    """Every ``tool`` message carries the id of a call an earlier assistant message made."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.tool_calls or []:
            called.add(call.id)
        if message.role != "tool":
            continue
        call_id = message.tool_call_id
        if not call_id:
            raise InvalidRequestError(f"invalid 'messages[{i}].tool_call_id': a tool message needs the id of the call "
                                      "it answers", param=f"messages[{i}].tool_call_id")
        if call_id not in called:
            raise InvalidRequestError(f"invalid 'messages[{i}].tool_call_id': no earlier assistant message made a call "
                                      f"with id {call_id!r}; send the assistant message with its 'tool_calls' first",
                                      param=f"messages[{i}].tool_call_id")
