"""The bridge's wire protocol: JSON-RPC 2.0, one JSON object per line, as pydantic models.

Every message a host app sends or receives has a model here, and :func:`schema` turns them
into one JSON Schema document (``edgecloud bridge schema``) that Swift / Kotlin code can be
generated from. The protocol, version :data:`PROTOCOL_VERSION`:

Methods (request ``params`` → ``result``):

- ``initialize`` :class:`InitializeParams` → :class:`InitializeResult` (versions,
  capabilities, the client's configuration). Optional: other methods work without it.
- ``chat.create`` :class:`ChatCreateParams` (the ChatRequest fields; ``stream`` defaults to
  true here, ``tools`` / ``tool_choice`` and tool results included) → :class:`ChatResult`
  (with ``tool_calls`` when the model called tools). While it runs, ``chat.delta`` notifications carry the
  request's id and each text delta, in order (``index`` 0, 1, ...).
- ``chat.cancel`` :class:`CancelParams` ``{id}`` → :class:`CancelResult`. The cancelled
  ``chat.create`` stops generating and answers with error ``-32800`` (request cancelled,
  LSP's code), ``data.text`` holding the text streamed so far. An id that is not an
  in-flight ``chat.create`` answers ``-32602`` (``data.param == "id"``); nothing else changes.
  Sent as a notification (no id of its own) it cancels just the same, with no reply.
- ``models.list`` → :class:`ModelsListResult`; ``models.pull`` :class:`PullParams` →
  :class:`PullResult`, with ``models.pull.progress`` notifications (bytes done / total; a
  model already in the cache reports done at once).
- ``plan`` :class:`PlanParams` → :class:`PlanResult` (the memory planner's answer).
- ``session.save`` :class:`SessionParams` ``{session}`` → :class:`SessionResult`: the edge's live KV
  is written to disk under that name now (call it when the app goes to the background: a
  killed app's next turn then loads it instead of recomputing the conversation);
  ``session.restore`` ``{session}`` → :class:`SessionResult`: that session's KV is loaded now
  (call it when the app comes back, so the next turn starts at once). ``tokens`` says how many
  were saved / restored (0: nothing to save, none saved, or an edge runtime without KV files).
  ``initialize``'s ``session`` makes every ``chat.create`` without a ``prompt_cache_key``
  continue that session.
- ``shutdown`` → ``{}``: in-flight requests are cancelled, later ones refused (``-32600``);
  over stdio the process then exits 0.

Errors (:class:`ErrorCode`): ``-32700`` malformed JSON or not UTF-8; ``-32600`` not a
JSON-RPC request (also: a batch array, a line over the size limit, an id already in flight,
a request after ``shutdown``); ``-32601`` unknown method; ``-32602`` invalid params,
``data.param`` naming the field; ``-32000`` an edgecloud error while serving, ``data.type``
its OpenAI-style type and ``data.error`` its class; ``-32603`` an unexpected internal
error; ``-32800`` cancelled. A well-formed notification (no ``id``) never gets a reply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING
from enum import IntEnum
from typing import Any, Literal, Optional, Union, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, create_model
from pydantic.json_schema import models_json_schema

from ..edge.memory import MemoryPlan
from ..tools.spec import ToolCall
from ..types import ChatRequest, CostInfo, FinishReason, RouteInfo, Usage, SessionName, _Validated

__all__ = [
    "PROTOCOL_VERSION",
    "ErrorCode",
    "RequestId",
    "Request",
    "Notification",
    "Response",
    "ErrorResponse",
    "ErrorObject",
    "InitializeParams",
    "SessionParams",
    "SessionResult",
    "InitializeResult",
    "ChatCreateParams",
    "ChatResult",
    "ChatDelta",
    "CancelParams",
    "CancelResult",
    "NoParams",
    "EmptyResult",
    "ModelInfo",
    "ModelsListResult",
    "PullParams",
    "PullProgress",
    "PullResult",
    "PlanParams",
    "PlanResult",
    "MethodSpec",
    "METHODS",
    "NOTIFICATIONS",
    "schema",
]

#: Bumped on any change a host must know about (major: incompatible, minor: additions).
PROTOCOL_VERSION = "1.1"

RequestId = Union[StrictInt, StrictStr]


class ErrorCode(IntEnum):
    """JSON-RPC 2.0 error codes, plus LSP's RequestCancelled and one server-error code."""

    PARSE_ERROR = -32700
    INVALID_REQUEST = -32600
    METHOD_NOT_FOUND = -32601
    INVALID_PARAMS = -32602
    INTERNAL_ERROR = -32603
    SERVER_ERROR = -32000
    REQUEST_CANCELLED = -32800


# ---------------------------------------------------------------------------- envelopes


class Request(BaseModel):
    """A call that gets exactly one response with the same ``id``."""

    jsonrpc: Literal["2.0"]
    id: RequestId
    method: StrictStr
    params: Optional[dict[str, Any]] = None


class Notification(BaseModel):
    """A message without ``id``: host → bridge (never answered) or bridge → host."""

    jsonrpc: Literal["2.0"] = "2.0"
    method: StrictStr
    params: Optional[dict[str, Any]] = None


class Response(BaseModel):
    jsonrpc: Literal["2.0"] = "2.0"
    id: RequestId
    result: Any


class ErrorObject(BaseModel):
    code: int
    message: str
    #: ``param`` (-32602), ``type`` and ``error`` (-32000), ``text`` (-32800), ``limit`` (an over-long line).
    data: Optional[dict[str, Any]] = None


class ErrorResponse(BaseModel):
    """``id`` is null when the request's id could not be read (malformed or over-long line)."""

    jsonrpc: Literal["2.0"] = "2.0"
    id: Optional[RequestId]
    error: ErrorObject


# ---------------------------------------------------------------------------- params and results


class NoParams(_Validated):
    """Params of a method that takes none (``{}`` or omitted)."""


class EmptyResult(BaseModel):
    """``{}``."""


class InitializeParams(_Validated):
    client_name: Optional[str] = None
    client_version: Optional[str] = None
    #: The protocol version the host was written for (informational).
    protocol_version: Optional[str] = None
    #: The conversation every ``chat.create`` continues unless it names its own ``prompt_cache_key``.
    session: Optional[SessionName] = None


class Capabilities(BaseModel):
    methods: list[str]
    notifications: list[str]
    streaming: bool = True
    cancel: bool = True


class BridgeConfig(BaseModel):
    edge_model: Optional[str]
    cloud: bool
    cloud_model: Optional[str] = None
    cloud_base_url: list[str] = Field(default_factory=list)


class InitializeResult(BaseModel):
    protocol_version: str = PROTOCOL_VERSION
    edgecloud_version: str
    capabilities: Capabilities
    config: BridgeConfig


class ChatCreateParams(ChatRequest):
    """The ChatRequest fields. ``stream`` defaults to true: ``false`` sends no ``chat.delta``."""

    stream: bool = True


class SessionParams(_Validated):
    #: The session (default: ``initialize``'s ``session``).
    session: Optional[SessionName] = None


class SessionResult(BaseModel):
    session: Optional[str]
    #: Tokens of KV saved / restored (0: none).
    tokens: int


class ChatResult(BaseModel):
    #: The completion id (``chatcmpl-...``), not the JSON-RPC id.
    completion_id: str
    model: str
    text: str
    #: The calls the model made (``finish_reason`` ``tool_calls``); None when it made none.
    tool_calls: Optional[list[ToolCall]] = None
    finish_reason: Optional[FinishReason]
    usage: Usage
    route: Optional[RouteInfo] = None
    cost: Optional[CostInfo] = None


class ChatDelta(BaseModel):
    """``chat.delta``: the next piece of text of the ``chat.create`` request ``id``."""

    id: RequestId
    delta: str
    index: int


class CancelParams(_Validated):
    #: The id of the ``chat.create`` request to cancel.
    id: RequestId


class CancelResult(BaseModel):
    cancelled: bool = True


class ModelInfo(BaseModel):
    name: str
    description: str
    parameters: str
    quantization: str
    size_bytes: int
    installed: bool
    fetchable_here: bool
    path: Optional[str] = None


class ModelsListResult(BaseModel):
    models: list[ModelInfo]


class PullParams(_Validated):
    name: StrictStr
    force: bool = False


class PullProgress(BaseModel):
    """``models.pull.progress``: bytes of the model assembled so far."""

    id: RequestId
    done: int
    total: int


class PullResult(BaseModel):
    name: str
    path: str


class PlanParams(_Validated):
    model: StrictStr
    device: StrictStr = "this"
    ctx: Optional[int] = Field(default=None, gt=0)
    kv_cache_type: Optional[str] = None


def _plan_result_model() -> type[BaseModel]:
    """PlanResult has MemoryPlan's fields (those ``to_dict`` keeps), so the wire follows the planner."""
    hints = get_type_hints(MemoryPlan)
    fields: dict[str, Any] = {
        f.name: (hints[f.name], ... if f.default is MISSING else f.default)
        for f in dataclasses.fields(MemoryPlan) if f.name != "spec"
    }
    fields["n_ubatch"] = (int, ...)
    return create_model("PlanResult", __doc__=":meth:`edgecloud.edge.memory.MemoryPlan.to_dict`.", **fields)


PlanResult = _plan_result_model()


# ---------------------------------------------------------------------------- the method table


class MethodSpec(BaseModel):
    """What a method takes, what it answers, and the notifications it sends while it runs."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    params: type[_Validated]
    result: type[BaseModel]
    notifications: tuple[str, ...] = ()


METHODS: dict[str, MethodSpec] = {
    "initialize": MethodSpec(params=InitializeParams, result=InitializeResult),
    "chat.create": MethodSpec(params=ChatCreateParams, result=ChatResult, notifications=("chat.delta",)),
    "chat.cancel": MethodSpec(params=CancelParams, result=CancelResult),
    "models.list": MethodSpec(params=NoParams, result=ModelsListResult),
    "models.pull": MethodSpec(params=PullParams, result=PullResult, notifications=("models.pull.progress",)),
    "plan": MethodSpec(params=PlanParams, result=PlanResult),
    "session.save": MethodSpec(params=SessionParams, result=SessionResult),
    "session.restore": MethodSpec(params=SessionParams, result=SessionResult),
    "shutdown": MethodSpec(params=NoParams, result=EmptyResult),
}

#: Notifications the bridge sends, by method name.
NOTIFICATIONS: dict[str, type[BaseModel]] = {"chat.delta": ChatDelta, "models.pull.progress": PullProgress}

_ENVELOPES: tuple[type[BaseModel], ...] = (Request, Notification, Response, ErrorResponse)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/$defs/{model.__name__}"}


def schema() -> dict[str, Any]:
    """One JSON Schema (2020-12) document: every envelope, params, result and notification.

    The document validates any single line (``anyOf`` the four envelopes); ``x-methods`` and
    ``x-notifications`` say which params/result definition belongs to which method.
    """
    models: list[type[BaseModel]] = [*_ENVELOPES, ErrorObject, *NOTIFICATIONS.values()]
    for spec in METHODS.values():
        models += [spec.params, spec.result]
    unique = list(dict.fromkeys(models))
    _, defs = models_json_schema([(m, "validation") for m in unique], ref_template="#/$defs/{model}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "edgecloud bridge protocol",
        "description": "JSON-RPC 2.0, one JSON object per line (see edgecloud.bridge.protocol).",
        "x-protocol-version": PROTOCOL_VERSION,
        "anyOf": [_ref(m) for m in _ENVELOPES],
        "x-methods": {
            name: {"params": _ref(s.params), "result": _ref(s.result), "notifications": list(s.notifications)}
            for name, s in METHODS.items()
        },
        "x-notifications": {name: {"params": _ref(model)} for name, model in NOTIFICATIONS.items()},
        "x-error-codes": {str(int(code)): code.name for code in ErrorCode},
        "$defs": defs["$defs"],
    }
