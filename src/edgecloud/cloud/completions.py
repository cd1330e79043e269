"""The legacy text-completion shapes served on ``POST /v1/completions``.

This module owns :class:`CompletionRequest` (validated like
:class:`~edgecloud.types.ChatRequest`: a bad field raises
:class:`~edgecloud.errors.InvalidRequestError` naming it), :class:`Completion` and
:class:`CompletionChunk`, mirroring the ``openai`` client's ``Completion`` type. The prompt
is raw text (no chat template), one prompt per request; options the engine does not
implement (``n``/``best_of`` > 1, ``echo``, ``logprobs``, ``suffix``, penalties) are refused
with a 400 that says so rather than silently ignored.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field, field_validator, model_validator

from ..types import FinishReason, RouteInfo, StreamOptions, Text, Usage, SEED_MIN, SEED_MAX, _Validated, check_stop, check_text

__all__ = [
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionRequest",
    "CompletionsBackend",
    "new_text_completion_id",
]

#: OpenAI's default ``max_tokens`` for /v1/completions.
DEFAULT_COMPLETION_TOKENS = 16


class CompletionRequest(_Validated):
    """A text completion request (``prompt`` is continued as is)."""

    model: Text | None = None
    prompt: str | list[str]
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_TOKENS, gt=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: Text | None = None
    #: vLLM's extension: keep generating past end-of-generation tokens.
    ignore_eos: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise ValueError("send exactly one prompt string per request (lists of prompts or token ids are not supported)")
            return [check_text(prompt[0])]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt must not be empty")
        return check_text(prompt)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: Any) -> Any:
        return check_stop(stop)

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        unsupported = {
            "n": self.n not in (None, 1),
            "best_of": self.best_of not in (None, 1),
            "echo": self.echo,
            "logprobs": self.logprobs is not None,
            "suffix": self.suffix is not None,
            "presence_penalty": bool(self.presence_penalty),
            "frequency_penalty": bool(self.frequency_penalty),
        }
        for field, bad in unsupported.items():
            if bad:
                from ..errors import InvalidRequestError

                raise InvalidRequestError(f"'{field}' is not supported by this server; leave it out", param=field)
        return self

    @property
    def text(self) -> str:
        """The prompt text."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def stop_sequences(self) -> list[str]:
        """``stop`` as a list (possibly empty)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str = ""
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    route: RouteInfo | None = None


#: Streamed pieces have the same shape as the whole answer (as OpenAI sends them).
CompletionChunk = Completion


def new_text_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


@runtime_checkable
class CompletionsBackend(Protocol):
    """A backend that also continues raw text (``POST /v1/completions``): the torch engine does."""

    def astream_completion(self, request: CompletionRequest) -> AsyncIterator[Completion]:
        """The prompt continued as is, as ``text_completion`` chunks."""
        ...
