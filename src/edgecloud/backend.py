"""The Backend interface: every runtime (edge or cloud) turns a ChatRequest into chunks.

One abstract method, :meth:`Backend.stream`. Everything else is derived: ``complete`` is the
stream collected; ``astream`` / ``acomplete`` run the sync stream on one bounded, process-wide
pool of worker threads (:data:`SYNC_WORKERS` at most, whatever the number of concurrent
requests; closing the async iterator stops generation); a backend with its own async I/O (the
HTTP cloud client) overrides them; ``close`` / ``aclose`` release resources.

What callers need to know about a backend is declared here, not found with ``getattr``:
``model_name``, ``n_ctx`` (when known: after loading for a local model), ``base_url`` (remote
backends), and capabilities as class attributes (``supports_logprobs``,
``supports_continuation`` ...) that the hybrid consults before it asks for something.
Capabilities beyond chat are :class:`typing.Protocol` classes checked once, where a
collaboration mode is set up (a :class:`~edgecloud.errors.ConfigError` says which is missing):
:class:`ChatTokenizer` (the prompt's token ids), :class:`Drafter` (an edge runtime that drafts
token ids: verified mode) and :class:`Verifier` (an endpoint that scores a continuation).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar, runtime_checkable

from .capabilities import Capabilities
from .errors import BackendError, BackendUnavailableError, ConfigError

from .types import ChatCompletion, ChatCompletionChunk, ChatRequest, collect_chunks

if TYPE_CHECKING:
    from .config import CacheSettings
    from .runtime.coupling import Coupling, Picker
    from .runtime.held import HeldGrammar, HeldPicker
    from .runtime.scoring import Scored, TokenScore, TokenSession

__all__ = [
    "SYNC_WORKERS", "Backend", "ChatTokenizer", "Drafter", "SerialBackend", "SessionBackend", "TemplatedBackend",
    "GeneratedTokens", "Opener", "TokenScorer", "Verifier",
    "aclose_stream",
    "close_stream", "iterate_in_worker", "refuse_speculation",
]

T = TypeVar("T")
_DONE = object()
#: Threads that run synchronous backends' streams for async callers, process-wide. A local
#: runtime serves one request at a time anyway (:class:`SerialBackend`): more threads would
#: only wait on its lock.
SYNC_WORKERS = 8
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _sync_executor() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=SYNC_WORKERS, thread_name_prefix="edgecloud-sync")
        return _executor


def close_stream(stream: Iterator[Any] | None) -> None:
    """Stop a stream early: a generator's cleanup (closing its HTTP response, freeing a slot) runs now."""
    if isinstance(stream, Generator):
        stream.close()


async def aclose_stream(stream: AsyncIterator[Any] | None) -> None:
    """Async twin of :func:`close_stream`."""
    if isinstance(stream, AsyncGenerator):
        await stream.aclose()


async def iterate_in_worker(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Items of the synchronous iterator ``make()``, produced on the shared worker pool (at most
    :data:`SYNC_WORKERS` at once) and handed to the event loop one at a time; closing this
    iterator stops the producer at its next item."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    stop = threading.Event()

    def worker() -> None:
        if stop.is_set():  # the caller gave up while this waited for a free worker
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)
            return
        gen: Any = None
        try:
            gen = make()
            for item in gen:
                if stop.is_set():
                    break
                loop.call_soon_threadsafe(queue.put_nowait, item)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            close_stream(gen)
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)

    future = loop.run_in_executor(_sync_executor(), worker)
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
        await asyncio.shield(future)


def refuse_speculation(runtime: str, speculate: str | None) -> None:
    """Raise :class:`~edgecloud.errors.ConfigError` when ``edge_speculate`` asks a runtime that
    decodes plainly for drafts (``None``, ``"auto"`` and ``"off"`` are fine: auto means "where the
    runtime can")."""
    if speculate not in (None, "auto", "off"):
        raise ConfigError(f"edge_speculate {speculate!r} needs an edge runtime that speculates (llama.cpp, or torch for "
                          f"prompt lookup); {runtime} decodes plainly (use auto or off)")


class Backend(ABC):
    """Base of every runtime. Subclasses implement :meth:`stream` only."""

    #: Registry name ("llamacpp", "onnx", "openai-http" ...).
    name: ClassVar[str] = "backend"
    #: Which side of the hybrid this backend is.
    target: ClassVar[Literal["edge", "cloud"]] = "edge"
    can_stream: ClassVar[bool] = True
    #: Chunks carry token logprobs when the request asks (``logprobs``, ``top_logprobs``).
    supports_logprobs: ClassVar[bool] = False
    supports_seed: ClassVar[bool] = False
    supports_stop: ClassVar[bool] = True
    #: Continues a partial assistant message (``continue_final_message``): what a mid-stream
    #: fallback to this backend needs.
    supports_continuation: ClassVar[bool] = True

    #: The model this backend answers with (a catalogue name, file stem or served name).
    model_name: str = ""
    #: Tokens of prompt + answer it can hold, when known (local runtimes: once loaded).
    n_ctx: int | None = None
    #: The API root of a remote backend (None for local runtimes).
    base_url: str | None = None
    #: The backend's own Prometheus metrics (a serving engine keeps them; None: the server
    #: measures requests itself).
    metrics: Any = None
    #: What a remote endpoint was seen to accept or refuse (None: a local runtime, which does
    #: what its class attributes say).
    capabilities: Capabilities | None = None

    @abstractmethod
    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        """Yield chunks for ``request``; closing the iterator stops generation."""

    @classmethod
    def create(cls, model: str, *, n_ctx: int | None = None, device: str = "this",
               cache: CacheSettings | None = None, kv_events: Callable[[str, str], None] | None = None,
               speculate: str | None = None) -> Backend:
        """Build this backend from the client's settings (``edge_model``, ``n_ctx``, the device
        profile, the ``[cache]`` tiers a runtime that saves KV states honours, where to report
        their events, and ``edge_speculate``): how :func:`edgecloud.registry.make_edge_backend`
        makes an edge runtime. A runtime that does not speculate takes ``"auto"`` and ``"off"``
        and refuses the rest (:func:`refuse_speculation`)."""
        refuse_speculation(cls.name, speculate)
        return cls(model, n_ctx=n_ctx, device=device)  # type: ignore[call-arg]

    def complete(self, request: ChatRequest) -> ChatCompletion:
        """The whole answer: the stream collected."""
        stream = self.stream(request)
        try:
            return collect_chunks(stream)
        finally:
            close_stream(stream)

    async def astream(self, request: ChatRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Async twin of :meth:`stream`: runs it on the shared worker pool, one chunk at a time."""
        async for chunk in iterate_in_worker(lambda: self.stream(request)):
            yield chunk

    async def acomplete(self, request: ChatRequest) -> ChatCompletion:
        """Async twin of :meth:`complete`."""
        return collect_chunks([chunk async for chunk in self.astream(request)])

    def load(self) -> None:
        """Do the expensive set-up now (fetch, load, warm) instead of on the first request."""

    def describe(self) -> str:
        """One line on what this backend serves and how (``edgecloud serve`` prints it once loaded)."""
        return f"{self.name} serving {self.model_name or '?'}"

    def health(self) -> str | None:
        """None when this backend could serve a request now, else why not (what ``/health`` reports)."""
        return None

    def close(self) -> None:
        """Release the runtime's resources. Safe to call twice."""

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(_sync_executor(), self.close)

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> "Backend":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class SerialBackend(Backend):
    """A Backend whose runtime serves one request at a time (a llama.cpp context, one torch
    model without a scheduler).

    Subclasses load the runtime in :meth:`_ensure_loaded` (what :meth:`load` and each request
    call), wrap every use of it in ``with self._serving():`` and free it in :meth:`_free`. A
    second caller waits for the first stream to finish or be closed; a second stream opened in
    the same thread raises BackendError instead of deadlocking; ``close()`` from the thread
    that holds an open stream frees the runtime when that stream ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._closed = False

    def close(self) -> None:
        """Free the runtime. Safe to call twice; from another thread it waits for an open stream."""
        self._closed = True
        self._on_close()
        if self._owner == threading.get_ident():
            return  # freed when this thread's stream ends
        with self._lock:
            self._free()
        self._after_close()

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._owner == me:
            raise BackendError(
                "this backend is already streaming an answer in this thread; "
                "finish or close that stream before starting another"
            )
        with self._lock:
            self._owner = me
            try:
                if self._closed:
                    raise BackendUnavailableError(f"the {self.name} backend is closed; create a new one", cause="closed")
                yield
            finally:
                self._owner = None
                if self._closed:
                    self._free()

    def health(self) -> str | None:
        return f"the {self.name} backend is closed" if self._closed else None

    def load(self) -> None:
        """Load the runtime now (otherwise the first request does it)."""
        with self._serving():
            self._ensure_loaded()

    def _ensure_loaded(self) -> Any:
        """Load the runtime unless it is loaded, and return it (called with the lock held)."""

    def _free(self) -> None:
        """Release the runtime (called with the lock held)."""

    def _on_close(self) -> None:
        """Hook run first in :meth:`close` (e.g. wake background workers)."""

    def _after_close(self) -> None:
        """Hook run last in :meth:`close`, without the lock (e.g. join background workers)."""


class TemplatedBackend(SerialBackend):
    """A :class:`SerialBackend` that renders chats with its model's template and tokenizer itself
    (``_encode_chat``, called with the runtime loaded), and so tells which token ids a
    conversation is (:class:`ChatTokenizer`)."""

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt tokens this backend evaluates for ``messages`` (template + tokenizer; the
        ``tools`` offered rendered as the template does)."""
        with self._serving():
            self._ensure_loaded()
            return self._encode_chat(messages, tools=tools)

    @abstractmethod
    def _encode_chat(self, messages: list[dict[str, Any]], *, continue_final: bool = False,
                     tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's token ids (called with the runtime loaded and the lock held)."""


@runtime_checkable
class SessionBackend(Protocol):
    """A runtime whose KV can be saved to disk and restored by session name (llama.cpp)."""

    def save_session(self, session: str | None = None) -> int:
        """Write the live context's KV under ``session`` now; the tokens saved."""
        ...

    def restore_session(self, session: str) -> int:
        """Load ``session``'s saved KV into the context now; the tokens restored."""
        ...


@runtime_checkable
class ChatTokenizer(Protocol):
    """A backend that says which token ids it evaluates for a conversation."""

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt tokens of ``messages`` (chat template + tokenizer; ``tools`` rendered)."""
        ...


@runtime_checkable
class TokenScorer(ChatTokenizer, Protocol):
    """An edge runtime that scores given text: how likely it finds each token (lead mode's check)."""

    def tokenize_text(self, text: str) -> list[int]:
        """``text`` as token ids (special tokens parsed, no BOS)."""
        ...

    def score(self, tokens: list[int], *, start: int, top_n: int = 1) -> tuple[list[TokenScore], TokenScore]:
        """Scores of ``tokens[start:]`` (each with its ``top_n`` best alternatives) and the greedy next token."""
        ...


@runtime_checkable
class Drafter(ChatTokenizer, Protocol):
    """An edge runtime that drafts greedy token ids (the draft side of verified mode)."""

    def tokenize_text(self, text: str) -> list[int]:
        """``text`` as token ids (special tokens parsed, no BOS)."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes ``token`` stands for in an answer."""
        ...

    def is_end(self, token: int) -> bool:
        """Whether ``token`` ends generation."""
        ...

    def draft(self, tokens: list[int], k: int, picker: Picker | None = None, *, until_below: float = 0.0,
              at_least: int = 1) -> list[int]:
        """The next ``k`` tokens after ``tokens`` (fewer when one ends generation, or after a token
        whose probability is below ``until_below`` once there are ``at_least``): greedy, or
        ``picker``'s picks (:mod:`edgecloud.runtime.coupling`)."""
        ...

    def greedy(self, tokens: list[int], limit: int, picker: Picker | None = None) -> Iterator[tuple[int, float]]:
        """The continuation of ``tokens`` as ``(token, probability of it)``, one at a time: greedy,
        or ``picker``'s picks."""
        ...

    def hold(self, grammar: HeldGrammar, coupling: Coupling | None = None) -> HeldPicker:
        """A picker held to ``grammar`` from the answer's start (fork it to draft ahead)."""
        ...


@runtime_checkable
class Verifier(Protocol):
    """An endpoint that scores a given continuation in one pass (the check side of verified mode)."""

    def score(self, tokens: list[int], *, start: int, top_n: int = 1) -> tuple[list[TokenScore], TokenScore]:
        """Scores of ``tokens[start:]`` and the greedy next token."""
        ...

    def score_in(self, session: TokenSession | None, tokens: list[int], *, start: int, top_n: int = 1,
                 coupling: Coupling | None = None, grammar: HeldGrammar | None = None,
                 keep_verified: bool = False) -> Scored:
        """:meth:`score` in a token session: only what the endpoint does not hold is sent; with
        ``coupling`` or ``grammar``, the endpoint's picks under that sampler, held to that grammar
        (its next token is its pick); ``keep_verified``: a check, after which the endpoint may hold
        only the drafts it agrees with and its own token (``Scored.verified`` says)."""
        ...

    def token_texts(self, tokens: list[int]) -> list[str]:
        """What the endpoint's tokenizer calls each token (to compare vocabularies)."""
        ...

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt token ids the endpoint evaluates for ``messages`` (ExtensionUnsupportedError
        when it cannot say)."""
        ...


class GeneratedTokens(Protocol):
    """A streamed generation by token id (:class:`Opener`): iterate it for the ids; once exhausted,
    ``finish`` says how it ended ("stop": the model ended the answer) and the counts what it cost."""

    finish: str | None
    sent: int
    cached: int
    generated: int

    def __iter__(self) -> Iterator[int]: ...

    def close(self) -> None: ...


@runtime_checkable
class Opener(Protocol):
    """An endpoint that streams its own greedy continuation of token ids, by id, in a token session
    (the cloud opening a verified answer: :mod:`edgecloud.remote.opening`)."""

    def generate_in(self, session: TokenSession | None, tokens: list[int], max_tokens: int) -> GeneratedTokens:
        """The endpoint's greedy continuation of ``tokens``, up to ``max_tokens``, by token id."""
        ...
