"""A cloud backend seen through a PII redaction: placeholders out, the originals back in.

This module owns :class:`RedactedBackend`, what the hybrid puts in front of every cloud attempt
when the router's ``pii="redact"`` policy replaced personal data with placeholders: the cloud
sees the redacted conversation (and a partial answer being continued, redacted the same way),
and the caller gets the original values back while the answer streams
(:class:`~edgecloud.router.pii.StreamingRestore`). The edge always sees the original.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import ClassVar, Literal

from .backend import Backend
from .router.pii import Redaction, StreamingRestore
from .types import ChatCompletionChunk, ChatMessage, ChatRequest

__all__ = ["RedactedBackend"]


class RedactedBackend(Backend):
    """``inner`` (a cloud backend) given redacted conversations (see the module docstring)."""

    target: ClassVar[Literal["edge", "cloud"]] = "cloud"

    def __init__(self, inner: Backend, redaction: Redaction, messages: list[dict[str, str]]) -> None:
        self.inner, self.redaction, self.messages = inner, redaction, messages
        self.name = inner.name  # type: ignore[misc]
        self.model_name, self.n_ctx, self.base_url = inner.model_name, inner.n_ctx, inner.base_url
        self.supports_logprobs = inner.supports_logprobs  # type: ignore[misc]
        self.capabilities = inner.capabilities

    @property
    def supports_continuation(self) -> bool:  # type: ignore[override]
        return self.inner.supports_continuation

    def _redacted(self, request: ChatRequest) -> ChatRequest:
        redacted = [ChatMessage(role=m["role"], content=m["content"]) for m in self.messages]
        extra = request.messages[len(self.messages):]  # a partial answer being continued
        if extra:
            originals = {v: k for k, v in self.redaction.mapping.items()}
            for message in extra:
                text = message.content
                for value, placeholder in originals.items():
                    text = text.replace(value, placeholder)
                redacted.append(ChatMessage(role=message.role, content=text))
        return request.model_copy(update={"messages": redacted})

    @staticmethod
    def _restore(chunk: ChatCompletionChunk, restore: StreamingRestore) -> ChatCompletionChunk:
        for choice in chunk.choices:
            if choice.delta.content:
                choice.delta.content = restore.push(choice.delta.content)
            if choice.finish_reason is not None:
                choice.delta.content = (choice.delta.content or "") + restore.flush()
        return chunk

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        restore = StreamingRestore(self.redaction)
        for chunk in self.inner.stream(self._redacted(request)):
            yield self._restore(chunk, restore)

    async def astream(self, request: ChatRequest) -> AsyncIterator[ChatCompletionChunk]:
        restore = StreamingRestore(self.redaction)
        async for chunk in self.inner.astream(self._redacted(request)):
            yield self._restore(chunk, restore)
