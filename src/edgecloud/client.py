"""EdgeCloud / AsyncEdgeCloud: the OpenAI-shaped client app developers use.

``client.chat.completions.create(messages=..., stream=..., route=..., privacy=..., collab=...)`` validates
the request (bad input raises :class:`~edgecloud.errors.InvalidRequestError` before any
backend runs), then :class:`~edgecloud.hybrid.Hybrid` routes it to the device or the cloud,
falls back between them (also mid-stream), and prices it. Answers have the ``openai``
client's shapes plus ``route`` (target, backend, reason, score, fallbacks) and ``cost``; in a
stream every chunk carries the current ``route`` and the last one ``usage`` and ``cost``.

``EdgeCloud(session="name")`` makes every request continue that conversation's saved KV
(``prompt_cache_key``), in this process or the next: a restarted app's next turn does not
recompute its history (``usage.prompt_tokens_details.cached_tokens`` says how much it reused).

Configuration comes from the arguments, then ``EDGECLOUD_*`` environment variables, then
``edgecloud.toml`` (see :mod:`edgecloud.config`)::

    with EdgeCloud(cloud_base_url="http://127.0.0.1:8000", cloud_model="qwen2.5-coder-1.5b-instruct-q4") as client:
        answer = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}])
        print(answer.text, answer.route.target, answer.cost.usd)
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from .backend import Backend, aclose_stream, close_stream
from .config import EdgeCloudSettings
from .hybrid import Hybrid, settings_from
from .observability.client_metrics import ClientMetrics
from .router.policy import RoutePolicy
from .store.catalogue import DEFAULT_EDGE_MODEL
from .errors import InvalidRequestError
from .types import ChatCompletion, ChatCompletionChunk, ChatMessage, ChatRequest, check_session_name, collect_chunks

__all__ = ["AsyncChatStream", "AsyncEdgeCloud", "ChatStream", "DEFAULT_EDGE_MODEL", "EdgeCloud"]

_UNSET: Any = object()


class _BaseEdgeCloud:
    """Everything without I/O: settings, request building, the hybrid engine."""

    def __init__(
        self,
        edge_model: str | os.PathLike[str] | None = _UNSET,
        *,
        cloud_base_url: str | Sequence[str] | None = None,
        cloud_model: str | None = None,
        cloud_api_key: str | None = None,
        config: str | os.PathLike[str] | Mapping[str, Any] | EdgeCloudSettings | None = None,
        edge_backend: Backend | None = None,
        cloud_backends: Sequence[Backend] | None = None,
        policy: RoutePolicy | None = None,
        metrics: ClientMetrics | None = None,
        tracer_provider: Any = None,
        n_ctx: int | None = None,
        device: str = "this",
        edge_runtime: str | None = None,
        collab: str | None = None,
        session: str | None = None,
        edge_speculate: str | None = None,
        edge_draft_model: str | os.PathLike[str] | None = None,
    ) -> None:
        overrides: dict[str, Any] = {
            "cloud_base_url": [cloud_base_url] if isinstance(cloud_base_url, str) else cloud_base_url,
            "cloud_model": cloud_model,
            "cloud_api_key": cloud_api_key,
            "n_ctx": n_ctx,
            "edge_runtime": edge_runtime,
            "edge_speculate": edge_speculate,
            "edge_draft_model": None if edge_draft_model is None else str(edge_draft_model),
        }
        if collab is not None:
            overrides["collab"] = {"mode": collab}
        settings = settings_from(config, **overrides)
        if edge_model is not _UNSET:  # None is meaningful here: no edge model at all
            settings = settings.model_copy(update={"edge_model": None if edge_model is None else str(edge_model)})
        self.settings = settings
        if session is not None:
            try:
                check_session_name(session)
            except ValueError as exc:
                raise InvalidRequestError(f"invalid 'session': {exc}", param="session") from None
        #: The conversation every request continues unless it names its own ``prompt_cache_key``:
        #: its KV is saved (RAM, disk) after each answer and found again, also after a restart.
        self.session = session
        self.hybrid = Hybrid(settings, edge_backend=edge_backend, cloud_backends=cloud_backends, policy=policy,
                             metrics=metrics, tracer_provider=tracer_provider, device=device)

    @property
    def edge(self) -> Backend | None:
        """The on-device backend (loaded on first use), None without an edge model."""
        return self.hybrid.edge

    @property
    def metrics(self) -> ClientMetrics:
        """This client's Prometheus series (serve them with ``start_metrics_server(metrics=...)``)."""
        return self.hybrid.metrics

    def stats(self) -> dict[str, Any]:
        """Requests per side, fallbacks, cost, cloud-equivalent cost and the saving, since start."""
        return self.hybrid.stats()

    def _build(self, messages: Sequence[ChatMessage | Mapping[str, Any]], **params: Any) -> ChatRequest:
        fields = {k: v for k, v in params.items() if v is not None}
        if self.session is not None:
            fields.setdefault("prompt_cache_key", self.session)
        request = ChatRequest(messages=[m if isinstance(m, ChatMessage) else dict(m) for m in messages], **fields)
        self.hybrid.check(request)
        return request


def _split_usage(chunk: ChatCompletionChunk) -> tuple[ChatCompletionChunk, ChatCompletionChunk | None]:
    """``chunk`` without its usage, and the usage-only chunk OpenAI sends last (None: no usage)."""
    if chunk.usage is None:
        return chunk, None
    tail = chunk.model_copy(update={"choices": [], "route": None, "cost": None})
    return chunk.model_copy(update={"usage": None}), tail


def _usage_last(chunks: Iterator[ChatCompletionChunk]) -> Iterator[ChatCompletionChunk]:
    """OpenAI's ``include_usage`` shape: usage only on a last chunk with no choices."""
    tail = None
    for chunk in chunks:
        out, got = _split_usage(chunk)
        tail = got or tail
        yield out
    if tail is not None:
        yield tail


class ChatStream(Iterator[ChatCompletionChunk]):
    """A streamed answer, as the ``openai`` SDK's ``Stream``: iterate it, or use it as a context
    manager (``with client.chat.completions.create(..., stream=True) as stream:``); leaving the
    block or :meth:`close` stops generation. With ``stream_options={"include_usage": True}`` the
    usage comes on a last chunk with no choices (and nowhere else), as OpenAI sends it;
    otherwise it rides on the finish chunk with ``route`` and ``cost``."""

    def __init__(self, chunks: Iterator[ChatCompletionChunk], include_usage: bool = False) -> None:
        self._source = chunks
        self._chunks = _usage_last(chunks) if include_usage else chunks

    def __iter__(self) -> ChatStream:
        return self

    def __next__(self) -> ChatCompletionChunk:
        return next(self._chunks)

    def close(self) -> None:
        """Stop reading: the backends stop generating."""
        for it in (self._chunks, self._source):
            close_stream(it)

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _ausage_last(chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[ChatCompletionChunk]:
    tail = None
    async for chunk in chunks:
        out, got = _split_usage(chunk)
        tail = got or tail
        yield out
    if tail is not None:
        yield tail


class AsyncChatStream(AsyncIterator[ChatCompletionChunk]):
    """Async twin of :class:`ChatStream` (``async with`` / ``async for`` / :meth:`aclose`)."""

    def __init__(self, chunks: AsyncIterator[ChatCompletionChunk], include_usage: bool = False) -> None:
        self._source = chunks
        self._chunks = _ausage_last(chunks) if include_usage else chunks

    def __aiter__(self) -> AsyncChatStream:
        return self

    async def __anext__(self) -> ChatCompletionChunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        """Stop reading: the backends stop generating."""
        for it in (self._chunks, self._source):
            await aclose_stream(it)

    async def __aenter__(self) -> AsyncChatStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _include_usage(request: ChatRequest) -> bool:
    return bool(request.stream_options and request.stream_options.include_usage)


class _Completions:
    def __init__(self, client: EdgeCloud) -> None:
        self._client = client

    def create(
        self, *, messages: Sequence[ChatMessage | Mapping[str, Any]], stream: bool = False, **params: Any
    ) -> ChatCompletion | ChatStream:
        """OpenAI-shaped chat completion; ``stream=True`` returns an iterator of chunks.

        Besides the OpenAI fields: ``route="auto"|"edge"|"cloud"``,
        ``privacy="default"|"local_only"`` and ``collab="auto"|"off"|"checked"|"token"|"verified"|"cascade"|"lead"|"probe"``
        (how the sides share the answer; default: the client's ``collab`` setting).
        """
        request = self._client._build(messages, stream=stream, **params)
        if stream:
            return ChatStream(self._client.hybrid.stream(request), _include_usage(request))
        return self._client.hybrid.complete(request)


class _AsyncCompletions:
    def __init__(self, client: AsyncEdgeCloud) -> None:
        self._client = client

    async def create(
        self, *, messages: Sequence[ChatMessage | Mapping[str, Any]], stream: bool = False, **params: Any
    ) -> ChatCompletion | AsyncChatStream:
        """Async twin of ``EdgeCloud.chat.completions.create``."""
        request = self._client._build(messages, stream=stream, **params)
        if stream:
            return AsyncChatStream(self._client.hybrid.astream(request), _include_usage(request))
        return collect_chunks([c async for c in self._client.hybrid.astream(request)])


class _Chat:
    def __init__(self, completions: Any) -> None:
        self.completions = completions


class EdgeCloud(_BaseEdgeCloud):
    """Synchronous client: ``EdgeCloud().chat.completions.create(messages=[...])``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat = _Chat(_Completions(self))

    def close(self) -> None:
        """Unload the edge model and close the cloud connections."""
        self.hybrid.close()

    def __enter__(self) -> EdgeCloud:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEdgeCloud(_BaseEdgeCloud):
    """Asynchronous client: ``await AsyncEdgeCloud().chat.completions.create(...)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat = _Chat(_AsyncCompletions(self))

    async def aclose(self) -> None:
        """Unload the edge model and close the cloud connections."""
        await self.hybrid.aclose()

    async def __aenter__(self) -> AsyncEdgeCloud:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
