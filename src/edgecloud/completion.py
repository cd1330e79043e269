"""OpenAI-shaped answers: usage, the ``route`` and ``cost`` extensions, completions and chunks.

This module owns what comes back from a chat request (:mod:`edgecloud.types` owns what goes in,
and re-exports these names): :class:`ChatCompletion` and :class:`ChatCompletionChunk` mirror the
``openai`` client's types and add ``route`` (where the answer was written and why, with its
typed :class:`FallbackEvent` and :class:`RouteNote` records) and ``cost``;
:func:`collect_chunks` assembles a stream into the whole answer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    computed_field,
    model_serializer,
)

from .errors import InvalidRequestError
from .tools.spec import ToolCall, ToolCallDelta

__all__ = [
    "AssistantMessage",
    "ChatCompletion",
    "ChatCompletionChunk",
    "Choice",
    "ChoiceDelta",
    "ChoiceLogprobs",
    "ChunkChoice",
    "CostInfo",
    "Envelope",
    "FallbackEvent",
    "FinishReason",
    "NoteCode",
    "PromptTokensDetails",
    "RouteInfo",
    "RouteNote",
    "Side",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "collect_chunks",
    "new_completion_id",
    "now",
]

FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "error"]


class PromptTokensDetails(BaseModel):
    """OpenAI's breakdown of the prompt tokens."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts. Serialized in OpenAI's shape too: ``prompt_tokens_details.cached_tokens``
    (what the ``openai`` client reads) repeats ``cached_tokens``; ``speculative`` is left out
    when the server did not speculate."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    #: Prompt tokens whose KV state was reused from an earlier request (not recomputed).
    cached_tokens: int = 0
    #: Speculative decoding figures (drafts, accepted tokens, k trace) when the server speculated.
    speculative: dict[str, Any] | None = None
    #: edgecloud serve's token sessions: tokens of context the server held for this request (not
    #: sent, not counted in ``prompt_tokens``; left out for requests without a session).
    context_tokens: int | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def prompt_tokens_details(self) -> PromptTokensDetails:
        """OpenAI's place for :attr:`cached_tokens` (``usage.prompt_tokens_details.cached_tokens``)."""
        return PromptTokensDetails(cached_tokens=self.cached_tokens)

    @model_serializer(mode="wrap")
    def _drop_empty_speculative(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for extension in ("speculative", "context_tokens"):
            if data.get(extension, True) is None:
                del data[extension]
        return data


Side = Literal["edge", "cloud"]


class FallbackEvent(BaseModel):
    """One switch of an answer from one backend to another: who failed, why, and where in the answer.

    Serialized with OpenAI-style keys (``from``, ``to`` ...); read fields as attributes
    (``event.cause``) or, like the JSON, by key (``event["cause"]``, ``event.get("resume_s")``).
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, serialize_by_alias=True)

    from_: Side = Field(alias="from")
    from_backend: str = ""
    to: Side
    to_backend: str = ""
    #: The typed failure cause (:data:`edgecloud.errors.FailureCause`, or ``low_confidence``).
    cause: str
    error: str = ""
    #: Characters and answer tokens delivered before the switch.
    at_chars: int = 0
    at_tokens: int = 0
    #: Seconds from the failure to the next backend's first text (set once it wrote).
    resume_s: float | None = None
    #: What the failed request was for, in a collaborative answer (``span``, ``verification``).
    during: str | None = None

    def __getitem__(self, key: str) -> Any:
        name = "from_" if key == "from" else key
        if name not in type(self).model_fields:
            raise KeyError(key)
        return vars(self)[name]

    def get(self, key: str, default: Any = None) -> Any:
        """The field named ``key`` (a JSON key), or ``default`` when it is unset or unknown."""
        try:
            value = self[key]
        except KeyError:
            return default
        return default if value is None else value


#: Why a route looks the way it does, as stable codes (the ``reason`` is their words joined). The
#: first note is the router's decision, coded by the rule that decided (``privacy``, ``pii``,
#: ``pinned``, ``unavailable``, ``context``, ``score``, ``cascade``, ``only_side``); then what the
#: answer's mode added.
NoteCode = Literal[
    "privacy", "pii", "pinned", "unavailable", "context", "score", "cascade", "only_side",
    "structured_one_side", "tools_one_side", "edge_starts", "collab_mode", "pii_no_verify", "cascade_accepted",
    "verified_rounds", "checks_ahead", "cloud_opening", "policy", "budget", "session", "probe", "sampling",
]


class RouteNote(BaseModel):
    """One typed fact about how an answer was routed or shared (``code``), in words (``text``)."""

    model_config = ConfigDict(frozen=True)

    code: NoteCode
    text: str
    value: float | None = None


class RouteInfo(BaseModel):
    """Where a request ran and why (edgecloud's extension to the OpenAI shapes).

    Built by the request's :class:`~edgecloud.answer.AnswerRecorder`: ``reason`` is the
    router's decision followed by the words of each note in ``notes``.
    """

    target: Literal["edge", "cloud"]
    backend: str
    reason: str = ""
    score: float | None = None
    fallbacks: list[FallbackEvent] = Field(default_factory=list)
    #: Typed facts behind ``reason`` (test and branch on these, not on the words).
    notes: list[RouteNote] = Field(default_factory=list)
    #: Answer tokens each side generated (``{"edge": n, "cloud": m}``), on the final chunk.
    tokens: dict[str, int] | None = None
    #: Requests sent to the cloud for this answer (spans, verifications, a whole answer).
    cloud_calls: int | None = None
    #: How the sides shared the answer: ``off``, ``token``, ``verified`` or ``cascade``.
    collab: str | None = None

    def noted(self, code: str) -> RouteNote | None:
        """The last note with ``code``, or None."""
        return next((n for n in reversed(self.notes) if n.code == code), None)


class CostInfo(BaseModel):
    """What a request cost (edgecloud's extension), in US dollars from the configured prices."""

    #: What this request cost where it ran (cloud tokens, edge device seconds).
    usd: float = 0.0
    #: What the same tokens would have cost on the cloud.
    cloud_equivalent_usd: float = 0.0
    #: ``cloud_equivalent_usd - usd``: the saving of running (part of) it on the device.
    saved_usd: float = 0.0
    edge_seconds: float = 0.0
    #: Prompt tokens sent to (and billed by) the cloud, over every request of the answer.
    cloud_input_tokens: int = 0
    #: Of those, tokens the cloud read from its prefix cache (priced at ``cloud_cached_input_share``).
    cloud_cached_tokens: int = 0
    cloud_output_tokens: int = 0
    #: Requests sent to the cloud for the answer.
    cloud_calls: int = 0
    #: The cloud's forward passes for the answer (prefill chunks, decode steps, verification rounds).
    cloud_passes: int = 0
    #: The same answer all-cloud: its prompt and answer tokens (what ``cloud_equivalent_usd`` prices), and
    #: the forward passes it would have taken (its prompt, then one step a token).
    all_cloud_input_tokens: int = 0
    all_cloud_output_tokens: int = 0
    all_cloud_passes: int = 0
    #: ``usd / cloud_equivalent_usd``: the answer's cost against the same answer all-cloud (None: nothing to compare).
    vs_all_cloud: float | None = None
    #: ``cloud_passes / all_cloud_passes``.
    passes_vs_all_cloud: float | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    #: The answer text; null when the answer is only tool calls (as OpenAI sends it).
    content: str | None = ""
    tool_calls: list[ToolCall] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class Envelope(BaseModel):
    """What every answer and streamed chunk carries (chat or text): its id, creation time and model."""

    id: str
    created: int
    model: str


class ChatCompletion(Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[Choice]
    usage: Usage = Field(default_factory=Usage)
    route: RouteInfo | None = None
    cost: CostInfo | None = None

    @property
    def text(self) -> str:
        """The first choice's answer text."""
        return (self.choices[0].message.content or "") if self.choices else ""


class ChoiceDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChoiceDelta = Field(default_factory=ChoiceDelta)
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice] = Field(default_factory=list)
    usage: Usage | None = None
    route: RouteInfo | None = None
    cost: CostInfo | None = None
    #: The token ids this chunk's text came from, where a server engine was asked for them (a text
    #: completion's ``return_token_ids``); never part of a chat chunk's JSON.
    _token_ids: list[int] | None = PrivateAttr(default=None)

    @property
    def text(self) -> str:
        """The text delta of the first choice ('' when none)."""
        if not self.choices:
            return ""
        return self.choices[0].delta.content or ""


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def collect_chunks(chunks: Iterable[ChatCompletionChunk]) -> ChatCompletion:
    """Fold a chunk stream into one ChatCompletion (the non-streaming answer)."""
    text: list[str] = []
    calls: dict[int, ToolCallDelta] = {}
    logprobs: list[TokenLogprob] = []
    saw_logprobs = False
    finish: FinishReason | None = None
    usage = Usage()
    first: ChatCompletionChunk | None = None
    route: RouteInfo | None = None
    cost: CostInfo | None = None
    for chunk in chunks:
        first = first or chunk
        route = chunk.route or route
        cost = chunk.cost or cost
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
            for delta in choice.delta.tool_calls or []:
                ToolCallDelta.gather(calls, delta)
            if choice.logprobs is not None:
                saw_logprobs = True
                logprobs.extend(choice.logprobs.content)
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    if first is None:
        raise InvalidRequestError("cannot collect an empty stream")
    return ChatCompletion(
        id=first.id,
        created=first.created,
        model=first.model,
        choices=[
            Choice(
                message=AssistantMessage(
                    content="".join(text) or (None if calls else ""),
                    tool_calls=[c.call() for _, c in sorted(calls.items())] or None,
                ),
                finish_reason=finish,
                logprobs=ChoiceLogprobs(content=logprobs) if saw_logprobs else None,
            )
        ],
        usage=usage,
        route=route,
        cost=cost,
    )


def now() -> int:
    return int(time.time())
