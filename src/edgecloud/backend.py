"""The Backend interface: every runtime (edge or cloud) turns a ChatRequest into chunks.

One abstract method, :meth:`Backend.stream`. Everything else is derived: ``complete`` is the
stream collected, ``astream`` / ``acomplete`` run the sync stream on a worker thread (closing
the async iterator stops generation), ``close`` / ``aclose`` release resources. Capabilities
are class attributes so routers and fallbacks can ask without trying.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar, Literal

from .types import ChatCompletion, ChatCompletionChunk, ChatRequest, collect_chunks

__all__ = ["Backend"]

_DONE = object()


class Backend(ABC):
    """Base of every runtime. Subclasses implement :meth:`stream` only."""

    #: Registry name ("llamacpp", "onnx", "openai-http" ...).
    name: ClassVar[str] = "backend"
    #: Which side of the hybrid this backend is.
    target: ClassVar[Literal["edge", "cloud"]] = "edge"
    can_stream: ClassVar[bool] = True
    supports_logprobs: ClassVar[bool] = False
    supports_seed: ClassVar[bool] = False
    supports_stop: ClassVar[bool] = True

    @abstractmethod
    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        """Yield chunks for ``request``; closing the iterator stops generation."""

    def complete(self, request: ChatRequest) -> ChatCompletion:
        """The whole answer: the stream collected."""
        stream = self.stream(request)
        try:
            return collect_chunks(stream)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    async def astream(self, request: ChatRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Async twin of :meth:`stream`: runs it on a worker thread, one chunk at a time."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stop = threading.Event()

        def worker() -> None:
            gen = self.stream(request)
            try:
                for chunk in gen:
                    if stop.is_set():
                        break
                    loop.call_soon_threadsafe(queue.put_nowait, chunk)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                close = getattr(gen, "close", None)
                if close is not None:
                    close()
                loop.call_soon_threadsafe(queue.put_nowait, _DONE)

        thread = threading.Thread(target=worker, name=f"{self.name}-astream", daemon=True)
        thread.start()
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            await asyncio.to_thread(thread.join)

    async def acomplete(self, request: ChatRequest) -> ChatCompletion:
        """Async twin of :meth:`complete`."""
        return collect_chunks([chunk async for chunk in self.astream(request)])

    def load(self) -> None:
        """Do the expensive set-up now (fetch, load, warm) instead of on the first request."""

    def close(self) -> None:
        """Release the runtime's resources. Safe to call twice."""

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> "Backend":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
