"""EdgeCloud / AsyncEdgeCloud: the OpenAI-shaped client app developers use.

``client.chat.completions.create(messages=..., stream=...)`` builds a validated
:class:`~edgecloud.types.ChatRequest`, picks a backend and returns the same shapes as the
``openai`` client plus ``route``. This first version knows one side, the on-device
llama.cpp runtime; the router, the cloud backend and fallback plug in behind the same
``create`` (the ``_pick`` step) without changing its signature.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from .backend import Backend
from .errors import BackendUnavailableError
from .types import ChatCompletion, ChatCompletionChunk, ChatMessage, ChatRequest, RouteInfo, collect_chunks

__all__ = ["EdgeCloud", "AsyncEdgeCloud", "DEFAULT_EDGE_MODEL"]

DEFAULT_EDGE_MODEL = "qwen2.5-coder-0.5b-instruct-q4"


class _BaseEdgeCloud:
    """Everything without I/O: request building, backend choice, route stamping."""

    def __init__(
        self,
        edge_model: str | os.PathLike[str] | None = DEFAULT_EDGE_MODEL,
        *,
        edge_backend: Backend | None = None,
        n_ctx: int | None = None,
        device: str = "this",
    ) -> None:
        self._edge_model = edge_model
        self._edge_options: dict[str, Any] = {"n_ctx": n_ctx, "device": device}
        self._edge: Backend | None = edge_backend

    @property
    def edge(self) -> Backend:
        """The on-device backend (loaded on first use)."""
        if self._edge is None:
            if self._edge_model is None:
                raise BackendUnavailableError("no edge model configured; pass edge_model=NAME_OR_PATH")
            from .edge.llamacpp import LlamaCppBackend

            self._edge = LlamaCppBackend(self._edge_model, **self._edge_options)
        return self._edge

    def _build(self, messages: Sequence[ChatMessage | Mapping[str, Any]], **params: Any) -> ChatRequest:
        fields = {k: v for k, v in params.items() if v is not None}
        return ChatRequest(messages=[m if isinstance(m, ChatMessage) else dict(m) for m in messages], **fields)

    def _pick(self, request: ChatRequest) -> tuple[Backend, RouteInfo]:
        if request.route == "cloud":
            raise BackendUnavailableError(
                "route='cloud' was asked but no cloud endpoint is configured; use route='auto' or 'edge'"
            )
        reason = "edge only: no cloud endpoint configured"
        if request.privacy == "local_only":
            reason = "privacy=local_only pins the request to the device"
        elif request.route == "edge":
            reason = "route='edge' requested"
        backend = self.edge
        return backend, RouteInfo(target="edge", backend=backend.name, reason=reason)


def _stamp(chunk: ChatCompletionChunk, route: RouteInfo) -> ChatCompletionChunk:
    chunk.route = route
    return chunk


class _Completions:
    def __init__(self, client: "EdgeCloud") -> None:
        self._client = client

    def create(
        self, *, messages: Sequence[ChatMessage | Mapping[str, Any]], stream: bool = False, **params: Any
    ) -> ChatCompletion | Iterator[ChatCompletionChunk]:
        """OpenAI-shaped chat completion; ``stream=True`` returns an iterator of chunks."""
        request = self._client._build(messages, stream=stream, **params)
        backend, route = self._client._pick(request)
        chunks = (_stamp(c, route) for c in backend.stream(request))
        if stream:
            return chunks
        return collect_chunks(chunks)


class _AsyncCompletions:
    def __init__(self, client: "AsyncEdgeCloud") -> None:
        self._client = client

    async def create(
        self, *, messages: Sequence[ChatMessage | Mapping[str, Any]], stream: bool = False, **params: Any
    ) -> ChatCompletion | AsyncIterator[ChatCompletionChunk]:
        """Async twin of ``EdgeCloud.chat.completions.create``."""
        request = self._client._build(messages, stream=stream, **params)
        backend, route = self._client._pick(request)

        async def chunks() -> AsyncIterator[ChatCompletionChunk]:
            async for chunk in backend.astream(request):
                yield _stamp(chunk, route)

        if stream:
            return chunks()
        return collect_chunks([c async for c in chunks()])


class _Chat:
    def __init__(self, completions: Any) -> None:
        self.completions = completions


class EdgeCloud(_BaseEdgeCloud):
    """Synchronous client: ``EdgeCloud().chat.completions.create(messages=[...])``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat = _Chat(_Completions(self))

    def close(self) -> None:
        if self._edge is not None:
            self._edge.close()

    def __enter__(self) -> "EdgeCloud":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEdgeCloud(_BaseEdgeCloud):
    """Asynchronous client: ``await AsyncEdgeCloud().chat.completions.create(...)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat = _Chat(_AsyncCompletions(self))

    async def aclose(self) -> None:
        if self._edge is not None:
            await self._edge.aclose()

    async def __aenter__(self) -> "AsyncEdgeCloud":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
