"""OpenAI-shaped requests (messages, ``ChatRequest`` and its options) and their validation.

Requests are validated on construction; a bad field raises
:class:`~edgecloud.errors.InvalidRequestError` whose message and ``param`` name the field
(``messages[0].content``), never a bare pydantic ``ValidationError``. The answers' shapes
(usage, route, cost, completions and chunks) are :mod:`edgecloud.completion`'s, re-exported
here so ``from edgecloud.types import ChatCompletion`` keeps working.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from .completion import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    CostInfo,
    Envelope,
    FallbackEvent,
    FinishReason,
    NoteCode,
    PromptTokensDetails,
    RouteInfo,
    RouteNote,
    Side,
    TokenLogprob,
    TopLogprob,
    Usage,
    collect_chunks,
    new_completion_id,
    now,
)
from .errors import InvalidRequestError
from .tools.spec import ToolCall, ToolChoice, ToolSpec, check_tool_history, resolve_tool_choice

__all__ = [
    "Role",
    "ChatMessage",
    "ChatRequest",
    "CollabMode",
    "CollabOptions",
    "Usage",
    "PromptTokensDetails",
    "RouteInfo",
    "RouteNote",
    "FallbackEvent",
    "NoteCode",
    "Side",
    "TopLogprob",
    "TokenLogprob",
    "ChoiceLogprobs",
    "AssistantMessage",
    "Choice",
    "ChatCompletion",
    "Envelope",
    "ChoiceDelta",
    "ChunkChoice",
    "ChatCompletionChunk",
    "FinishReason",
    "collect_chunks",
    "new_completion_id",
    "CostInfo",
    "now",
]

Role = Literal["system", "developer", "user", "assistant", "tool"]
_ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")


def _field_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not path:
            path = str(part)
        else:
            path += f".{part}"
    return path


def _translate(exc: ValidationError) -> InvalidRequestError:
    """Turn the first pydantic error into a message that names the field to change."""
    first = exc.errors()[0]
    # Union members add their type name to ``loc``; drop those so the path stays a field path.
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "list"))))
    param = _field_path(loc) or "request"
    msg = first["msg"].removeprefix("Value error, ")
    inner = (first.get("ctx") or {}).get("error")
    if isinstance(inner, InvalidRequestError) and not loc:
        return inner
    if isinstance(inner, InvalidRequestError) and inner.param:
        # A nested model (ChatMessage) already translated its own error: join the paths.
        return InvalidRequestError(
            str(inner).replace(f"'{inner.param}'", f"'{param}.{inner.param}'", 1), param=f"{param}.{inner.param}"
        )
    if first["type"] == "extra_forbidden":
        msg = "unknown field; remove it or check its spelling"
    elif first["type"] == "missing":
        msg = "field required"
    return InvalidRequestError(f"invalid '{param}': {msg}", param=param)


#: Seeds are 64-bit signed integers (what OpenAI documents and torch's generators take);
#: llama.cpp uses the low 32 bits of the same value. Outside this range a seed is refused.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: JSON request bodies may nest at most this deep (a chat request needs 4 levels; JSON schemas
#: for tools need more); deeper bodies are refused before any model sees them.
MAX_JSON_DEPTH = 64


def check_text(text: str) -> str:
    """``text`` if it is valid Unicode text (ValueError for a lone surrogate, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains a lone surrogate ({text[exc.start:exc.end]!r} at character {exc.start}); "
            "send valid UTF-8 text (pair the surrogates or drop them)"
        ) from None
    return text


def check_session_name(name: str) -> str:
    """A session name or ``prompt_cache_key``: 1..128 printable characters, none of them a path
    separator (ValueError otherwise; names become state files)."""
    if not 1 <= len(name) <= MAX_SESSION_NAME:
        raise ValueError(f"must be 1 to {MAX_SESSION_NAME} characters, got {len(name)}")
    bad = sorted({c for c in name if c in "/\\" or not c.isprintable()})
    if bad or name in (".", ".."):
        shown = ", ".join(repr(c) for c in bad) or repr(name)
        raise ValueError(f"{shown} may not appear in a session name (no path separators or control characters); "
                         "use letters, digits and -_.:@")
    return check_text(name)


def check_stop(stop: Any) -> Any:
    """OpenAI's ``stop``: ``None``, a non-empty string, or a list of up to 4 non-empty strings (ValueError otherwise)."""
    if stop is None or (isinstance(stop, str) and stop):
        return stop if stop is None else check_text(stop)
    if isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        return [check_text(s) for s in stop]
    raise ValueError("stop must be a non-empty string or a list of up to 4 non-empty strings")


def load_json(body: bytes | str, *, what: str = "request body", max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a request's JSON text; InvalidRequestError when it is not JSON or nests deeper than ``max_depth``.

    Python's JSON parser recurses per level and gives up around a thousand; a body near that
    limit would also make every later walk of it recurse as deep. So nesting is bounded here,
    at the edge, before any model or handler sees the data.
    """
    try:
        data = json.loads(body)
    except RecursionError:
        raise InvalidRequestError(f"{what} nests deeper than {max_depth} levels; flatten it") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"{what} is not valid JSON: {exc}") from exc
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:  # iterative: the check itself must not recurse
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise InvalidRequestError(f"{what} nests deeper than {max_depth} levels; flatten it")
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return data


#: A text field: any string that is valid Unicode.
Text = Annotated[str, AfterValidator(check_text)]
#: A session name / ``prompt_cache_key`` (:func:`check_session_name`).
SessionName = Annotated[str, AfterValidator(check_session_name)]


class _Validated(BaseModel):
    """Base for request models: pydantic errors become InvalidRequestError.

    Strict, as OpenAI's own API is: an integer field takes an integer (not ``"4"``, ``4.0`` or
    ``true``), a boolean takes ``true`` / ``false`` (not ``"yes"`` or ``0``); a float field
    still takes an integer.
    """

    model_config = ConfigDict(extra="forbid", frozen=False, strict=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _translate(exc) from exc

    @classmethod
    def parse(cls, data: Any) -> Any:
        """Validate a plain dict (e.g. a JSON body); bad input raises InvalidRequestError."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise InvalidRequestError(f"expected a JSON object for {cls.__name__}, got {type(data).__name__}")
        return cls(**data)


class ChatMessage(_Validated):
    """One message of a conversation. ``content`` is text (OpenAI text parts are joined); an
    assistant message that made tool calls carries them in ``tool_calls`` (its ``content`` may
    then be null, read as ""), a ``tool`` message the result of one, named by ``tool_call_id``."""

    model_config = ConfigDict(extra="ignore")

    role: str = Field(json_schema_extra={"enum": list(_ROLES)})
    content: Text
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_content(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("content") is None:
            if data.get("role") == "assistant" and data.get("tool_calls"):
                return {**data, "content": ""}  # null or left out: OpenAI allows both here
            if "content" not in data:
                return data  # "field required"
            raise InvalidRequestError("invalid 'content': content may be null only in an assistant message with "
                                      "'tool_calls'; send the text", param="content")
        return data

    @model_validator(mode="after")
    def _calls_from_assistant(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise InvalidRequestError(f"invalid 'tool_calls': only assistant messages make tool calls, this one is "
                                      f"{self.role!r}", param="tool_calls")
        return self

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in _ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {', '.join(_ROLES)}")
        return role

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, content: Any) -> str:
        if isinstance(content, str):
            return content
        if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
        ):
            return "".join(p["text"] for p in content)
        if isinstance(content, list):
            kinds = sorted({str(p.get("type")) for p in content if isinstance(p, dict) and p.get("type") != "text"})
            if kinds:
                raise ValueError(f"these models read text only: content parts of type {', '.join(kinds)} are not "
                                 "supported; send the text as {'type': 'text', 'text': ...} parts or a string")
        raise ValueError(
            f"content must be a string (or a list of {{'type': 'text', 'text': ...}} parts), "
            f"got {type(content).__name__}"
        )


class StreamOptions(_Validated):
    include_usage: bool = False


class SpeculativeOptions(_Validated):
    """A request's limits on speculative decoding (an ``edgecloud serve`` extension): ``mode``
    picks a proposer the server runs, or ``"off"``; ``k_max`` caps the draft length."""

    mode: Literal["auto", "draft", "ngram", "off"] | None = None
    k_max: int | None = Field(default=None, ge=1, le=32)


#: Most tokens one request may bias (OpenAI's own limit is 300).
MAX_LOGIT_BIAS = 300
#: OpenAI request fields that mean nothing for these models or this server: accepted, ignored.
IGNORED_FIELDS = ("store", "metadata", "service_tier", "reasoning_effort", "safety_identifier")
#: Longest session name / ``prompt_cache_key`` accepted.
MAX_SESSION_NAME = 128
def check_bias(bias: dict[str, float] | None) -> dict[str, float] | None:
    """A ``logit_bias`` map's keys (token ids as strings) and values (-100..100), checked; a
    ValueError says what is wrong (a request model's field validator)."""
    if bias is None:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(bias)}")
    for token, value in bias.items():
        if not token.isdigit():
            raise ValueError(f"keys are token ids written as strings (\"1234\"), got {token!r}")
        if not -100.0 <= value <= 100.0:
            raise ValueError(f"bias for token {token} is {value}; biases are in -100..100")
    return bias


#: OpenAI request fields edgecloud does not implement (yet): refused with a 400 that says so.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "functions": "the legacy 'functions' field is not supported; send the functions as 'tools' "
                 "([{'type': 'function', 'function': {...}}])",
    "function_call": "the legacy 'function_call' field is not supported; use 'tool_choice'",
    "audio": "these models produce text only; leave 'audio' out",
    "prediction": "predicted outputs are not supported; leave 'prediction' out",
    "web_search_options": "web search is not available here; leave 'web_search_options' out",
}


#: How the edge and the cloud share one answer (see :mod:`edgecloud.collab`).
CollabMode = Literal["auto", "off", "token", "checked", "verified", "cascade", "probe", "lead"]


class CollabOptions(_Validated):
    """A request's own collaboration settings (``collab={"mode": "checked", "max_calls": 3}``); what
    it leaves out comes from the client's ``collab`` settings."""

    mode: CollabMode | None = None
    #: Checked mode: the edge writes a token without the cloud when its probability is at least this.
    trust: float | None = Field(default=None, ge=0.0, le=1.0)
    #: Most cloud calls (spans or checks) for this answer; 0: the edge writes alone.
    max_calls: int | None = Field(default=None, ge=0)
    #: Fewest tokens a check sends the cloud (a round trip must be worth it).
    draft_min: int | None = Field(default=None, ge=1, le=64)
    #: Most tokens a check sends the cloud.
    draft_max: int | None = Field(default=None, ge=1, le=64)
    #: Verified mode, greedy, the sides taking turns: a block ends after a drafted token the edge is less sure of
    #: than this.
    draft_confidence: float | None = Field(default=None, ge=0.0, le=1.0)
    #: Verified mode: the edge drafts on while a check is in flight (false: strict rounds).
    pipeline: bool | None = None
    #: Verified mode, pipelined: the edge drafts while a check is computed (unset: unless the cloud shares the CPUs).
    overlap: bool | None = None
    #: Verified mode, the edge drafting while checks are computed: checks out at once (2: the line past a check too).
    checks_in_flight: int | None = Field(default=None, ge=1, le=2)
    #: Verified mode, the sides taking turns: the cloud writes the answer's first this-many tokens itself.
    opening_tokens: int | None = Field(default=None, ge=1, le=64)
    #: Verified mode, the edge drafting while checks are out: the cloud streams the answer's first
    #: this-many tokens itself (0: off).
    stream_opening: int | None = Field(default=None, ge=0, le=64)


class ChatRequest(_Validated):
    """A chat completion request: the OpenAI fields edgecloud honours, plus routing hints.

    ``max_completion_tokens`` (OpenAI's newer name) sets ``max_tokens``. The fields in
    :data:`IGNORED_FIELDS` are accepted and ignored; those in :data:`UNSUPPORTED_FIELDS` are
    refused with a message naming the feature (never "unknown field").
    """

    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, gt=0)
    #: OpenAI's newer name for ``max_tokens`` (what LangChain and recent SDKs send).
    max_completion_tokens: int | None = Field(default=None, gt=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    #: vLLM's extension: sample among the k most likely tokens only (0 or -1: all).
    top_k: int | None = Field(default=None, ge=-1)
    #: vLLM's extension: sample among tokens at least this fraction as likely as the top one.
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    n: int | None = None
    user: Text | None = None
    #: Token id (as a string, as OpenAI sends it) -> bias in -100..100 added to its logit.
    logit_bias: dict[str, float] | None = None
    #: ``text``, ``json_object`` or ``json_schema``: the answer is held to the grammar (llama.cpp runtime).
    response_format: dict[str, Any] | None = None
    #: Function tools the model may call (see :mod:`edgecloud.tools`).
    tools: list[ToolSpec] | None = Field(default=None, max_length=128)
    #: ``"auto"`` (default with tools), ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``.
    tool_choice: Union[str, dict[str, Any], None] = None
    #: Whether one answer may hold several calls (default true).
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = None
    # accepted and ignored (IGNORED_FIELDS)
    store: bool | None = None
    metadata: dict[str, Text] | None = None
    service_tier: Text | None = None
    reasoning_effort: Text | None = None
    safety_identifier: Text | None = None
    #: OpenAI's cache routing key; here the session whose saved KV this request continues (the
    #: edge finds it by token prefix anyway; the key finds it first and names its state file).
    prompt_cache_key: SessionName | None = None
    #: vLLM's extension: keep generating past end-of-generation tokens (benchmarks, load tests).
    ignore_eos: bool = False
    #: vLLM's extension: the last message is a partial assistant answer to continue (no new
    #: turn is opened); the fallback uses it to finish a stream another backend started.
    continue_final_message: bool = False
    #: vLLM's companion flag; only ``False`` (with ``continue_final_message``) is meaningful.
    add_generation_prompt: bool = True
    #: edgecloud serve's extension: limits on speculative decoding for this request.
    speculative: SpeculativeOptions | None = None
    # edgecloud extensions
    route: Literal["auto", "edge", "cloud"] = "auto"
    privacy: Literal["default", "local_only"] = "default"
    #: How the edge and the cloud share this answer: a mode name, or :class:`CollabOptions`
    #: (None: the client's ``collab`` settings); see :mod:`edgecloud.collab`.
    collab: Union[CollabMode, CollabOptions, None] = None
    _tool_choice: ToolChoice = PrivateAttr(default_factory=lambda: ToolChoice("none"))

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in UNSUPPORTED_FIELDS.items():
                if data.get(name) is not None:
                    raise InvalidRequestError(f"invalid '{name}': {why}", param=name)
        return data

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        return check_bias(bias)

    @field_validator("response_format")
    @classmethod
    def _format(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        if fmt is None:
            return None
        kind = fmt.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"unknown response_format type {kind!r}; use 'text', 'json_object' or 'json_schema'")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("a json_schema response_format needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return fmt

    @field_validator("messages", mode="before")
    @classmethod
    def _non_empty(cls, messages: Any) -> Any:
        if isinstance(messages, list) and not messages:
            raise ValueError("messages must hold at least one message")
        return messages

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError(f"n={n} is not supported: only n=1 (one choice per request); send several requests instead")
        return n

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: Any) -> Any:
        return check_stop(stop)

    @model_validator(mode="after")
    def _token_limit(self) -> "ChatRequest":
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise InvalidRequestError(f"invalid 'max_completion_tokens': max_tokens ({self.max_tokens}) and "
                                          f"max_completion_tokens ({self.max_completion_tokens}) disagree; send one "
                                          "of them", param="max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        return self

    @field_validator("collab", mode="before")
    @classmethod
    def _collab_options(cls, collab: Any) -> Any:
        # an object is the options (its errors name collab.<field>), a string the mode
        return CollabOptions(**collab) if isinstance(collab, dict) else collab

    @model_validator(mode="after")
    def _collab_budget(self) -> "ChatRequest":
        options = self.collab
        if isinstance(options, CollabOptions) and options.draft_min is not None and self.max_tokens is not None \
                and options.draft_min > self.max_tokens:
            raise InvalidRequestError(f"invalid 'collab.draft_min': {options.draft_min} tokens per check is more than "
                                      f"max_tokens ({self.max_tokens}); lower collab.draft_min", param="collab.draft_min")
        return self

    @property
    def collab_options(self) -> CollabOptions:
        """The request's collaboration settings as :class:`CollabOptions` (a bare mode name too)."""
        if isinstance(self.collab, CollabOptions):
            return self.collab
        return CollabOptions(mode=self.collab)

    @model_validator(mode="after")
    def _tool_rules(self) -> "ChatRequest":
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise InvalidRequestError(f"invalid 'tools': function names must be unique; {', '.join(twice)} "
                                      "declared more than once", param="tools")
        self._tool_choice = resolve_tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)
        check_tool_history(self.messages)
        fmt = (self.response_format or {}).get("type", "text")
        if self._tool_choice.mode != "none" and fmt != "text":
            raise InvalidRequestError(f"invalid 'response_format': {fmt} answers and tool calls cannot be combined "
                                      "(each holds the answer to its own grammar); send tool_choice 'none' or leave "
                                      "response_format out", param="response_format")
        return self

    @property
    def tool_mode(self) -> ToolChoice:
        """What the model may do with ``tools`` (``mode`` ``none`` when it has none to call)."""
        return self._tool_choice

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools a chat template renders (None: no tools to offer, or ``tool_choice`` ``none``)."""
        if self._tool_choice.mode == "none" or not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @model_validator(mode="after")
    def _continuation(self) -> "ChatRequest":
        if self.continue_final_message:
            if self.messages[-1].role != "assistant" or not self.messages[-1].content:
                raise ValueError("continue_final_message needs a non-empty assistant message last")
            if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    @property
    def stop_sequences(self) -> list[str]:
        """``stop`` as a list (possibly empty)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def message_dicts(self) -> list[dict[str, Any]]:
        """The conversation as plain ``{"role", "content"}`` dicts (for chat templates); an
        assistant's ``tool_calls`` come with their arguments as objects (what Hugging Face
        templates render), a tool result with its ``tool_call_id`` (and ``name``)."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            message: dict[str, Any] = {"role": role, "content": m.content}
            if m.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": c.function.arguments_object()}}
                    for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
                if m.name:
                    message["name"] = m.name
            out.append(message)
        return out
