"""CloudBackend: a :class:`~edgecloud.backend.Backend` for any OpenAI-compatible HTTP endpoint.

This module owns the HTTP side of the cloud: the request body sent to
``/chat/completions``, the retry policy, and what each endpoint accepts beyond plain chat (its
:class:`~edgecloud.capabilities.Capabilities`, learned from refusals and one-token probes). Reading
server-sent events into :class:`~edgecloud.types.ChatCompletionChunk` and translating HTTP failures
into the :mod:`edgecloud.errors` tree (the table below) are :mod:`edgecloud.remote.wire`'s. It
talks to ``edgecloud serve``, vLLM, SGLang, llama.cpp's server and OpenAI alike, sync
(:class:`httpx.Client`) and async (:class:`httpx.AsyncClient`).

Rules:

* ``base_url``: a bare ``scheme://host[:port]`` gets ``/v1`` appended; a URL with any path is
  taken as the API root as given (``http://host:8000/v1``, ``https://proxy/openai/v1``).
  Requests go to ``{root}/chat/completions``; :meth:`CloudBackend.load` reads ``{root}/models``.
* Every request streams (``stream: true``, ``stream_options.include_usage``): ``complete`` is
  the stream collected, so both share retries and error mapping. Only the fields the caller
  set are sent; edgecloud's extensions (``route``, ``privacy``) never are, and ``model`` is
  always the backend's own (``request.model`` is ignored, as by every Backend).
* Retries: connect errors, connections dropped before any answer (a stale keep-alive), 429,
  502, 503 and 504 are retried up to ``max_retries`` times (a 500 is not: a server bug answers
  the same again), waiting the server's ``Retry-After`` (seconds or HTTP-date; OpenAI's ``retry-after-ms`` first) when it
  sends one, else ``backoff * 2**attempt`` with ±50 % jitter. A hint longer than
  ``max_retry_wait`` is not waited out: the error is raised at once so a fallback can go
  elsewhere. Nothing is retried once the status line was 2xx: text may have been delivered.
* Chunks: the first and the last carry ``route`` (target ``cloud``); usage (from the
  usage-only chunk) is merged into the last, which holds the finish reason. Finish reasons
  outside edgecloud's set (``tool_calls``, ``content_filter``) are reported as ``stop``.
  Closing the iterator closes the HTTP response, so the server stops generating.

Errors (the server's own message is always part of the raised one; ``cause`` is the typed
reason fallback and metrics read):

================================================  ===================================
answer                                             raised
================================================  ===================================
400 with ``code: context_length_exceeded`` (or     ContextOverflowError (counts parsed
"maximum context length" in the message)           from the message, else 0)
400, 413, 422, other 4xx                           InvalidRequestError (``param`` kept)
401, 403                                           AuthenticationError
404                                                ModelNotFoundError
429 (after retries)                                RateLimitedError (``retry_after``)
502, 503, 504 (after retries)                      BackendUnavailableError, server_error
500, other 5xx                                     BackendError, server_error
connect error / connect timeout (after retries)    BackendUnavailableError, connect
dropped before any answer (after retries)          BackendUnavailableError, disconnected
read timeout (before or during the stream)         BackendError, timeout
stream cut off, or ended without a finish          BackendError, disconnected
bytes that are not SSE JSON chunks                 BackendError, malformed_stream
``{"error": ...}`` event inside the stream         as its ``code``/``type`` says, else
                                                   BackendError, server_error
================================================  ===================================
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal
from urllib.parse import urlsplit

import httpx

from ..backend import Backend
from ..capabilities import Capabilities, Capability
from .retry import (
    DEFAULT_BACKOFF_S,
    DEFAULT_MAX_RETRIES,
    DEFAULT_MAX_RETRY_WAIT,
    RETRYABLE_STATUS,
    Failure as _Failure,
    RetryPolicy,
)
from ..errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    ContextOverflowError,
    ContinuationUnsupportedError,
    EdgeCloudError,
    ExtensionUnsupportedError,
    InvalidRequestError,
    ModelNotFoundError,
    ScoringUnsupportedError,
    SessionExpiredError,
)
from ..runtime.coupling import SCHEME, Coupling
from ..runtime.coupling import WIRE_FIELDS as COUPLED_FIELDS
from ..runtime.held import WIRE_FIELDS as HELD_FIELDS
from ..runtime.held import HeldGrammar
from ..runtime.scoring import Scored, TokenScore, TokenSession
from .opening import TokenStream
from .scored import read_scored
from .wire import EventReader, error_fields, translate, wait_hint
from ..types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    RouteInfo,
    collect_chunks,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DEFAULT_MAX_RETRY_WAIT", "CloudBackend", "RetryPolicy"]

# Set on the request by the sender, never copied from the caller's request.
_NOT_FORWARDED = {"route", "privacy", "collab", "model", "stream", "stream_options", "max_completion_tokens",
                  "store", "metadata", "service_tier", "reasoning_effort", "safety_identifier"}
_STREAM_HEADERS = {"Accept": "text/event-stream"}
#: The body fields of each chat extension an endpoint may refuse (what a refused request is tried
#: again without, to learn which one it refused), most often refused first.
_EXTENSION_FIELDS: dict[Capability, tuple[str, ...]] = {
    "continue": ("continue_final_message", "add_generation_prompt"),
    "json_schema": ("response_format",),
    "tools": ("tools", "tool_choice", "parallel_tool_calls"),
    "logprobs": ("logprobs", "top_logprobs"),
}




def _extensions(body: dict[str, Any]) -> list[Capability]:
    """The extensions a chat request body asks for."""
    present: list[Capability] = []
    if body.get("continue_final_message"):
        present.append("continue")
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") != "text":
        present.append("json_schema")
    if body.get("tools"):
        present.append("tools")
    if body.get("logprobs"):
        present.append("logprobs")
    return present


def _without(body: dict[str, Any], names: list[Capability]) -> dict[str, Any]:
    """``body`` without the fields of ``names``, for one token: the cheap request that tells
    whether the endpoint refused those extensions or the request itself."""
    dropped = {f for name in names for f in _EXTENSION_FIELDS[name]}
    return {**{k: v for k, v in body.items() if k not in dropped}, "max_tokens": 1}


def _unsupported(name: Capability, said: str) -> ExtensionUnsupportedError:
    if name == "continue":
        return ContinuationUnsupportedError(
            f"{said}; this endpoint does not continue a partial assistant message (continue_final_message)")
    return ExtensionUnsupportedError(f"{said}; this endpoint does not take {name!r}", extension=name)


def _api_root(base_url: str) -> str:
    """``http://host:port`` -> ``http://host:port/v1``; a URL with a path is kept (no trailing /)."""
    url = base_url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {base_url!r}")
    return url if parts.path else f"{url}/v1"


class CloudBackend(Backend):
    """Any OpenAI-compatible ``/chat/completions`` endpoint as a cloud Backend.

    ``model`` is the name the server serves; ``api_key`` is sent as a bearer token;
    ``headers`` are added to every request. See the module docstring for the URL rule, the
    retry policy and the error mapping. Safe to share between threads; the async side
    belongs to one event loop (use ``async with`` or :meth:`aclose` in it).

    The HTTP clients can be injected: ``transport`` / ``async_transport`` (an
    ``httpx.MockTransport`` in tests, a proxy or custom TLS) go into the clients this backend
    makes; ``http_client`` / ``async_http_client`` are used as given (their owner closes them;
    this backend adds its headers and timeouts per request).
    """

    name: ClassVar[str] = "openai-http"
    target: ClassVar[Literal["edge", "cloud"]] = "cloud"
    supports_logprobs: ClassVar[bool] = True
    supports_seed: ClassVar[bool] = True
    supports_stop: ClassVar[bool] = True

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_retries: int = DEFAULT_MAX_RETRIES,
        backoff: float = DEFAULT_BACKOFF_S,
        headers: dict[str, str] | None = None,
        max_retry_wait: float = DEFAULT_MAX_RETRY_WAIT,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
        http_client: httpx.Client | None = None,
        async_http_client: httpx.AsyncClient | None = None,
    ) -> None:
        if not model:
            raise ConfigError("model must name the model the endpoint serves")
        if connect_timeout <= 0 or read_timeout <= 0:
            raise ConfigError(f"timeouts must be > 0 seconds, got connect={connect_timeout}, read={read_timeout}")
        if max_retries < 0 or backoff < 0 or max_retry_wait < 0:
            raise ConfigError("max_retries, backoff and max_retry_wait must be >= 0")
        self._base_url = _api_root(base_url)
        self.model = self._model_name = model
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.retry = RetryPolicy(max_retries, backoff, max_retry_wait)
        self._chat_url = f"{self._base_url}/chat/completions"
        sent = dict(headers or {})
        if api_key:
            sent["Authorization"] = f"Bearer {api_key}"
        self._headers = sent
        self._timeout = httpx.Timeout(read_timeout, connect=connect_timeout)
        self._owns_client = http_client is None
        self._owns_async_client = async_http_client is None
        self._client = http_client or httpx.Client(headers=sent, timeout=self._timeout, transport=transport)
        self._async_transport = async_transport
        self._async_client: httpx.AsyncClient | None = async_http_client
        self._closed = False
        self._route = RouteInfo(
            target="cloud", backend=self.name, reason=f"OpenAI-compatible endpoint {self._base_url} ({model})"
        )
        self.capabilities: Capabilities = Capabilities(self._base_url, model, prober=self._probe)

    @property
    def supports_continuation(self) -> bool:  # type: ignore[override]
        """Whether it continues a partial answer (asked once, with two one-token requests, the first
        time a failover needs to know; an endpoint that cannot be asked is given the benefit)."""
        return self.capabilities.find("continue")

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def base_url(self) -> str:
        """The API root requests go to (``http://host:port/v1``)."""
        return self._base_url

    def __repr__(self) -> str:
        return f"CloudBackend({self.base_url!r}, {self.model!r})"

    # ------------------------------------------------------------------ shared, no I/O

    def _body(self, request: ChatRequest) -> dict[str, Any]:
        body = request.model_dump(mode="json", exclude_unset=True, exclude_none=True, exclude=_NOT_FORWARDED)
        for message in body.get("messages", []):
            if message.get("role") == "developer":  # not every server's chat template knows it
                message["role"] = "system"
        body.update(model=self.model, stream=True, stream_options={"include_usage": True})
        if request.continue_final_message:  # vLLM (and edgecloud serve) want both flags
            body["add_generation_prompt"] = False
        return body

    def _refuse_known(self, body: dict[str, Any]) -> None:
        """Raise the typed refusal, without sending, for an extension the endpoint refused before."""
        for name in _extensions(body):
            if not self.capabilities.may(name):
                raise _unsupported(name, f"{self._chat_url} refused it earlier: {self.capabilities.why(name)}")

    def _learned(self, body: dict[str, Any]) -> None:
        """The endpoint took ``body``'s extensions. Taking ``continue_final_message`` is not honouring
        it (some servers answer a new turn): only :meth:`_probe_continue` says that one works."""
        for name in _extensions(body):
            if name != "continue":
                self.capabilities.allow(name)

    def _refusal(self, body: dict[str, Any], exc: EdgeCloudError) -> list[Capability] | None:
        """The extensions to test when ``body`` was refused with ``exc`` (None: nothing to test): a
        4xx, or a 500 (some servers' answer to a body they cannot take); never an outage."""
        if isinstance(exc, (ContextOverflowError, SessionExpiredError, BackendUnavailableError)):
            return None
        if isinstance(exc, BackendError) and exc.cause != "server_error":
            return None
        return _extensions(body) or None

    def _refused_as(self, names: list[Capability], exc: EdgeCloudError) -> ExtensionUnsupportedError:
        for name in names:
            self.capabilities.refuse(name, str(exc))
        return _unsupported(names[0], str(exc))

    def _reader(self) -> EventReader:
        if self._closed:
            raise BackendUnavailableError(
                f"this {self.name} backend ({self.base_url}) is closed; create a new one", cause="closed"
            )
        return EventReader(self._chat_url, self._route, self.model)

    def _build(self, client: httpx.Client | httpx.AsyncClient, body: dict[str, Any], url: str | None = None) -> httpx.Request:
        headers = {**self._headers, **_STREAM_HEADERS} if url is None else self._headers
        return client.build_request("POST", url or self._chat_url, json=body, headers=headers, timeout=self._timeout)

    def _transport_failure(self, exc: httpx.TransportError, attempt: int, url: str) -> _Failure:
        tries = f" after {attempt + 1} attempts" if attempt else ""
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            message = f"cannot connect to {url}{tries}: {reason}; is the server running and base_url right?"
            return _Failure(BackendUnavailableError(message, cause="connect"), retryable=True, cause=exc)
        if isinstance(exc, httpx.TimeoutException):
            message = f"{url} did not answer within {self.read_timeout:g} s (read_timeout): {reason}"
            return _Failure(BackendError(message, cause="timeout"), cause=exc)
        # Dropped before any answer: most often a pooled keep-alive connection the server had
        # already closed; the request was not processed, so it is retried like a connect error.
        message = f"{url} dropped the connection before answering{tries}: {reason}"
        return _Failure(BackendUnavailableError(message, cause="disconnected"), retryable=True, cause=exc)

    def _status_failure(self, response: httpx.Response, attempt: int) -> _Failure:
        try:
            text = response.text
        except httpx.StreamError:  # the error body itself was cut off
            text = ""
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        status, retry_after = response.status_code, wait_hint(response.headers)
        message, param, code, kind = error_fields(body, text)
        tries = f" after {attempt + 1} attempts" if attempt else ""
        said = f"{response.request.url} answered {status}{tries}: {message}"
        error = translate(status, message, param, code, said, retry_after, kind)
        return _Failure(error, retryable=status in RETRYABLE_STATUS, retry_after=retry_after)

    def _broken(self, exc: httpx.HTTPError, reader: EventReader) -> BackendError:
        if isinstance(exc, httpx.TimeoutException):
            return BackendError(
                f"{self._chat_url} sent nothing for {self.read_timeout:g} s (read_timeout) after "
                f"{reader.delivered} chunks; the server is stuck or overloaded",
                cause="timeout",
            )
        return BackendError(
            f"the stream from {self._chat_url} broke after {reader.delivered} chunks: {exc or type(exc).__name__}; "
            "not retried once the server has answered 200",
            cause="disconnected",
        )

    # ------------------------------------------------------------------ sync

    def _post(self, body: dict[str, Any], url: str | None = None) -> httpx.Response:
        """POST the request, retrying as :attr:`retry` allows; a 2xx response, still streaming."""
        attempt = 0
        while True:
            try:
                response = self._client.send(self._build(self._client, body, url), stream=True)
            except httpx.TransportError as exc:
                failure = self._transport_failure(exc, attempt, url or self._chat_url)
            else:
                if response.is_success:
                    return response
                with contextlib.suppress(httpx.HTTPError):
                    response.read()
                response.close()
                failure = self._status_failure(response, attempt)
            time.sleep(self.retry.wait(failure, attempt))
            attempt += 1

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        """Stream the answer; closing the iterator closes the response (the server stops).

        A request whose extension the endpoint refuses (now, or earlier in this backend's life)
        raises :class:`~edgecloud.errors.ExtensionUnsupportedError` naming it (see
        :mod:`edgecloud.capabilities`)."""
        reader = self._reader()
        body = self._body(request)
        self._refuse_known(body)
        try:
            response = self._post(body)
        except (InvalidRequestError, BackendError) as exc:
            refused = self._which_refused(body, exc)
            if refused is None:
                raise
            raise refused from exc
        self._learned(body)
        try:
            try:
                for line in response.iter_lines():
                    yield from reader.feed(line)
                    if reader.done:
                        return
                yield from reader.end()
            except httpx.HTTPError as exc:
                raise self._broken(exc, reader) from exc
        finally:
            response.close()

    def _chats_but_fails(self, exc: BackendError) -> bool:
        """Whether a 500 (some servers' answer to a request body they cannot take) came from an
        endpoint that answers a plain one-token chat right after: then the request was what failed,
        not the server (a 502/503/504, a timeout or a broken connection is an outage: never)."""
        if exc.cause != "server_error" or isinstance(exc, BackendUnavailableError):
            return False
        hello = {"model": self.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": True}
        try:
            return self._accepts(hello)
        except EdgeCloudError:
            return False

    def _accepts(self, body: dict[str, Any]) -> bool:
        """Whether the endpoint takes ``body`` (a one-token request; outages are raised)."""
        try:
            self._post(body).close()
        except InvalidRequestError:
            return False
        return True

    def _refused_pick(self, body: dict[str, Any], exc: EdgeCloudError) -> Capability | None:
        """After the scoring request ``body`` was refused with ``exc``: the pick extension it
        refused (``grammar``, ``coupling``: the same request without its fields, outside any
        session, is taken), or None (it refuses scoring itself)."""
        if not isinstance(exc, InvalidRequestError):
            return None
        for name, fields in (("grammar", HELD_FIELDS), ("coupling", COUPLED_FIELDS)):
            if not any(f in body for f in fields):
                continue
            plain = {k: v for k, v in body.items() if k not in fields and k != "session"}
            if name == "coupling":
                plain["temperature"] = 0
            try:
                self._post(plain, f"{self.base_url}/completions").close()
            except (InvalidRequestError, ModelNotFoundError, BackendError):
                continue
            return name  # type: ignore[return-value]
        return None

    def _which_refused(self, body: dict[str, Any], exc: EdgeCloudError) -> ExtensionUnsupportedError | None:
        """After ``body`` was refused: the extension the endpoint refused (learned by trying the
        request without it, one token long), or None when it refuses the request itself."""
        present = self._refusal(body, exc)
        if present is None or not self._accepts(_without(body, present)):
            return None
        if len(present) > 1:
            present = [n for n in present if self._accepts(_without(body, [n]))][:1] or present
        return self._refused_as(present, exc)

    def _scoring(self, tokens: list[int], start: int, top_n: int, as_ids: bool,
                 session: TokenSession | None = None, coupling: Coupling | None = None,
                 grammar: HeldGrammar | None = None, keep: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """One scoring request (see :meth:`score`): the response's ``logprobs`` object (its arrays
        aligned with ``tokens`` plus the next token, ``None`` where a position was not sent), and
        the whole response. In a ``session`` only the tokens the server does not hold are sent;
        ``keep``: it holds afterwards only what it verified (``session.keep_verified``)."""
        self._reader()  # raises when closed
        url = f"{self.base_url}/completions"
        if not self.capabilities.may("score"):
            raise ScoringUnsupportedError(f"{url} refused scoring earlier: {self.capabilities.why('score')}")
        base = session.base(start) if session is not None else 0
        if session is not None and base >= len(tokens) and not session.resumes:
            base = len(tokens) - 1  # a check without drafts: the last token again, for a server that needs one
        body: dict[str, Any] = {"model": self.model, "prompt": tokens[base:], "max_tokens": 1, "temperature": 0,
                                "echo": True, "logprobs": max(1, top_n), "return_tokens_as_token_ids": as_ids,
                                "score_from": start}
        if session is not None:
            body["session"] = {"id": session.id, "base": base, **({"keep_verified": True} if keep else {})}
        asked: list[Capability] = [n for n, on in (("coupling", coupling), ("grammar", grammar)) if on is not None]
        if coupling is not None:
            if not self.capabilities.may("coupling"):
                raise ExtensionUnsupportedError(f"{url} does not sample in step with the edge: "
                                                f"{self.capabilities.why('coupling')}", extension="coupling")
            body.update(coupling.wire())
        if grammar is not None:
            if not self.capabilities.may("grammar"):
                raise ExtensionUnsupportedError(f"{url} does not check under a grammar: "
                                                f"{self.capabilities.why('grammar')}", extension="grammar")
            body.update(grammar.wire())
        try:
            response = self._post(body, url)
        except SessionExpiredError:
            assert session is not None
            if not session.resend:
                raise
            session.lost()
            return self._scoring(tokens, start, top_n, as_ids, session, coupling, grammar, keep)
        except (InvalidRequestError, ModelNotFoundError, BackendError) as exc:
            if isinstance(exc, ContextOverflowError) or (isinstance(exc, BackendError) and not self._chats_but_fails(exc)):
                raise
            refused = self._refused_pick(body, exc)
            if refused is not None:
                self.capabilities.refuse(refused, str(exc))
                raise ExtensionUnsupportedError(f"{url} refused a check with {refused!r}: {exc}",
                                                extension=refused) from exc
            self.capabilities.refuse("score", str(exc))
            raise ScoringUnsupportedError(
                f"{url} cannot score a continuation (echo + logprobs on /completions): {exc}; use collab='token', or "
                "serve the cloud model with edgecloud serve --engine llamacpp or vLLM") from exc
        try:
            try:
                answer = json.loads(response.read())
                logprobs = answer["choices"][0]["logprobs"]
                held = answer.get("session") if session is not None else None
                if session is not None:
                    session.supported = isinstance(held, dict)
                    if session.supported:
                        self.capabilities.allow("sessions")
                    else:
                        self.capabilities.refuse("sessions", f"{url} answers without holding a token session: "
                                                             "every check sends the whole context")
                    session.held = int(held["tokens"]) if isinstance(held, dict) else 0
                    session.resumes = isinstance(held, dict) and held.get("resumes") is True
                    # a server that holds sessions echoes only what was sent: align with ``tokens``
                    logprobs = {**logprobs, **{key: [None] * base + list(logprobs[key])
                                               for key in ("tokens", "token_logprobs", "top_logprobs")}}
                # each extension asked for is named in the answer beside the picks (a server that
                # ignores the fields answers greedy and unconstrained, without them)
                picks = logprobs.get("picks")
                named = {"coupling": answer.get("coupling") == SCHEME, "grammar": answer.get("grammar") is True}
                ignored = [n for n in asked if not (named[n] and isinstance(picks, list))]
                if asked and not ignored:
                    logprobs["picks"] = [None] * base + list(picks)
                if len(logprobs["tokens"]) < len(tokens) + 1 or len(logprobs["top_logprobs"]) < len(tokens) + 1:
                    said = f"{url} did not return the echoed prompt and the greedy next token (max_tokens=1 with echo)"
                    self.capabilities.refuse("score", said)
                    raise ScoringUnsupportedError(said)
                self.capabilities.allow("score")
            except EdgeCloudError:
                raise  # typed where it happened (a refusal), not a malformed answer
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise BackendError(f"{url} answered a scoring request without token logprobs",
                                   cause="malformed_stream") from exc
            finally:
                response.close()
        except httpx.HTTPError as exc:
            raise BackendError(f"the scoring answer from {url} broke: {exc}", cause="disconnected") from exc
        for name in asked:
            if name in ignored:
                said = f"{url} answered a check without its picks under {name!r} (it ignores the fields)"
                self.capabilities.refuse(name, said)
                raise ExtensionUnsupportedError(said, extension=name)
            self.capabilities.allow(name)
        return logprobs, answer

    def score(self, tokens: list[int], *, start: int, top_n: int = 1) -> tuple[list[TokenScore], TokenScore]:
        """How the endpoint's model scores ``tokens[start:]``, and its greedy next token.

        One ``POST {root}/completions`` with the token ids as the prompt, ``echo``, ``logprobs``,
        ``max_tokens=1`` and ``return_tokens_as_token_ids`` (as vLLM accepts it; ``score_from``
        lets ``edgecloud serve`` reuse its prefix cache). Raises
        :class:`~edgecloud.errors.ConfigError` when the endpoint cannot score a continuation.
        """
        scored = self.score_in(None, tokens, start=start, top_n=top_n)
        return scored.scores, scored.next

    def score_in(self, session: TokenSession | None, tokens: list[int], *, start: int, top_n: int = 1,
                 coupling: Coupling | None = None, grammar: HeldGrammar | None = None,
                 keep_verified: bool = False) -> Scored:
        """:meth:`score` in a token ``session``: only what the server does not hold is sent (the
        whole context when it holds nothing, or lost the session); with what the round cost.
        ``coupling``: the server picks each position's token with that sampler (its next token is
        its pick); ``grammar``: each pick is held to it. An endpoint that does neither raises
        ExtensionUnsupportedError (``coupling``, ``grammar``). ``keep_verified``: the request is a
        check of ``tokens[start:]``; a server that can (``edgecloud serve``) then holds only the
        drafts it agrees with and its own token after them (``Scored.verified``), so that token is
        not sent back; ``session.held`` says what it holds."""
        logprobs, answer = self._scoring(tokens, start, top_n, True, session, coupling, grammar,
                                         keep_verified and session is not None)
        sampled = coupling is not None or grammar is not None
        return read_scored(logprobs, answer, tokens, start=start, top_n=top_n, picked=sampled,
                           session=session, capabilities=self.capabilities, url=str(self.base_url))

    def generate_in(self, session: TokenSession | None, tokens: list[int], max_tokens: int) -> TokenStream:
        """The cloud's greedy continuation of ``tokens`` by token id, streamed, in a token
        ``session`` (see :mod:`edgecloud.remote.opening`): iterate it for the ids."""
        self._reader()  # raises when closed
        return TokenStream(self._post, self.capabilities, self.model, f"{self.base_url}/completions", session,
                           tokens, max_tokens)

    def _probe(self, name: Capability) -> None:
        """Learn ``name`` with one cheap request (a few tokens in, one out); what a real request
        would have learned is learned the same way (see :mod:`edgecloud.capabilities`)."""
        if name in ("score", "token_ids", "sessions", "coupling"):
            with contextlib.suppress(ExtensionUnsupportedError):
                self.score_in(TokenSession(), [0, 1, 2], start=1, top_n=1,
                              coupling=Coupling(seed=0) if name == "coupling" else None)
            return
        if name == "stream_ids":
            with contextlib.suppress(ExtensionUnsupportedError):
                list(self.generate_in(None, [0, 1, 2], 1))
            return
        hello = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello"}]
        body: dict[str, Any] = {"model": self.model, "messages": hello, "max_tokens": 1, "stream": True}
        if name == "continue":
            self._probe_continue(body)
            return
        if name == "logprobs":
            body.update(logprobs=True, top_logprobs=2)
        else:
            return  # tools and json_schema are learned from the caller's own requests
        try:
            self._post(body).close()
        except (InvalidRequestError, BackendError) as exc:
            self._which_refused(body, exc)
        else:
            self._learned(body)

    def _prompt_tokens(self, body: dict[str, Any]) -> int | None:
        """``usage.prompt_tokens`` of a one-token answer to ``body`` (None: the server reports none)."""
        response = self._post({**body, "stream": False})
        try:
            answer = json.loads(response.read())
        except (ValueError, httpx.HTTPError):
            return None
        finally:
            response.close()
        usage = answer.get("usage") if isinstance(answer, dict) else None
        count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return count if isinstance(count, int) else None

    def _probe_continue(self, body: dict[str, Any]) -> None:
        """Whether the endpoint continues an assistant message: it must take the flag, and honour it.
        Some servers take any field and answer a new turn (llama-cpp-python's, Ollama's); that shows
        in the prompt it counted: a continued message has no end-of-turn and no new assistant header,
        so it counts fewer prompt tokens than the same messages sent as a new turn."""
        flagged = {**body, "continue_final_message": True, "add_generation_prompt": False}
        try:
            continued = self._prompt_tokens(flagged)
        except (InvalidRequestError, BackendError) as exc:
            self._which_refused(flagged, exc)
            return
        new_turn = self._prompt_tokens(body)
        if continued is None or new_turn is None:
            return  # no usage to tell by: the first real continuation will say
        if continued < new_turn:
            self.capabilities.allow("continue")
        else:
            self.capabilities.refuse("continue", f"{self._chat_url} takes continue_final_message but answers a new "
                                                  f"turn ({continued} prompt tokens with it, {new_turn} without)")

    def discover(self) -> Capabilities:
        """Probe every capability not known yet (a few one-token requests; ``edgecloud plan``)."""
        for name in ("score", "continue", "logprobs"):
            self.capabilities.find(name)  # type: ignore[arg-type]
        if self.capabilities.known("score"):
            self.capabilities.find("coupling")
            self.capabilities.find("stream_ids")
        return self.capabilities

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt token ids the endpoint evaluates for ``messages`` (and ``tools``): vLLM's
        ``POST /tokenize`` at the server's root. An endpoint without it raises
        ExtensionUnsupportedError (``tokenize``, remembered); an outage is raised as such."""
        url = f"{self.base_url.removesuffix('/v1')}/tokenize"
        if not self.capabilities.may("tokenize"):
            raise ExtensionUnsupportedError(f"{url}: {self.capabilities.why('tokenize')}", extension="tokenize")
        body: dict[str, Any] = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        if tools:
            body["tools"] = tools
        try:
            response = self._post(body, url)
        except (InvalidRequestError, ModelNotFoundError) as exc:
            self.capabilities.refuse("tokenize", str(exc))
            raise ExtensionUnsupportedError(f"{url} does not tokenize a chat: {exc}", extension="tokenize") from exc
        try:
            tokens = json.loads(response.read())["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise TypeError("tokens is not a list of token ids")
        except (ValueError, KeyError, TypeError) as exc:
            self.capabilities.refuse("tokenize", f"{url} answered without token ids")
            raise ExtensionUnsupportedError(f"{url} answered /tokenize without token ids", extension="tokenize") from exc
        finally:
            response.close()
        self.capabilities.allow("tokenize")
        return tokens

    def token_texts(self, tokens: list[int]) -> list[str]:
        """What the endpoint's tokenizer calls each of ``tokens`` (one scoring request that scores
        nothing but the next token): compared with the edge's own, it tells whether two models
        share a vocabulary."""
        return [str(t) for t in self._scoring(tokens, len(tokens), 1, as_ids=False)[0]["tokens"][: len(tokens)]]

    def load(self) -> None:
        """Check the endpoint now: ``GET {root}/models`` answers and lists ``model``.

        Raises BackendUnavailableError (unreachable), AuthenticationError, or
        ModelNotFoundError (not listed). A server without ``/models`` (404) passes.
        """
        self._reader()  # raises when closed
        url = f"{self.base_url}/models"
        try:
            response = self._client.get(url, headers=self._headers, timeout=self._timeout)
        except httpx.TransportError as exc:
            raise self._transport_failure(exc, 0, url).error from exc
        if response.status_code == 404:
            return
        if not response.is_success:
            raise self._status_failure(response, 0).error
        try:
            listing = response.json()
            cards = listing.get("data", []) if isinstance(listing, dict) else None
            if not isinstance(cards, list) or not all(isinstance(card, dict) for card in cards):
                raise ValueError("not an OpenAI model list")
            ids = [str(card.get("id")) for card in cards]
        except ValueError as exc:
            raise BackendError(
                f"{url} answered something that is not a model list: {response.text[:200]!r}", cause="malformed_stream"
            ) from exc
        if ids and self.model not in ids:
            raise ModelNotFoundError(f"{url} does not list the model {self.model!r}; it serves: {', '.join(ids)}")

    def close(self) -> None:
        """Close the sync HTTP client it made (``aclose`` closes the async one too). Safe to call twice."""
        self._closed = True
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> Self:
        return self

    # ------------------------------------------------------------------ async

    def _aclient(self) -> httpx.AsyncClient:
        if self._async_client is None:
            self._async_client = httpx.AsyncClient(
                headers=self._headers, timeout=self._timeout, transport=self._async_transport
            )
        return self._async_client

    async def _apost(self, body: dict[str, Any]) -> httpx.Response:
        """Async twin of :meth:`_post`."""
        client, attempt = self._aclient(), 0
        while True:
            try:
                response = await client.send(self._build(client, body), stream=True)
            except httpx.TransportError as exc:
                failure = self._transport_failure(exc, attempt, self._chat_url)
            else:
                if response.is_success:
                    return response
                with contextlib.suppress(httpx.HTTPError):
                    await response.aread()
                await response.aclose()
                failure = self._status_failure(response, attempt)
            await asyncio.sleep(self.retry.wait(failure, attempt))
            attempt += 1

    async def astream(self, request: ChatRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Async twin of :meth:`stream` on httpx.AsyncClient (no worker thread)."""
        reader = self._reader()
        body = self._body(request)
        self._refuse_known(body)
        try:
            response = await self._apost(body)
        except (InvalidRequestError, BackendError) as exc:
            refused = await self._awhich_refused(body, exc)
            if refused is None:
                raise
            raise refused from exc
        self._learned(body)
        try:
            try:
                async for line in response.aiter_lines():
                    for chunk in reader.feed(line):
                        yield chunk
                    if reader.done:
                        return
                for chunk in reader.end():
                    yield chunk
            except httpx.HTTPError as exc:
                raise self._broken(exc, reader) from exc
        finally:
            await response.aclose()

    async def _aaccepts(self, body: dict[str, Any]) -> bool:
        """Async twin of :meth:`_accepts`."""
        try:
            await (await self._apost(body)).aclose()
        except InvalidRequestError:
            return False
        return True

    async def _awhich_refused(self, body: dict[str, Any], exc: EdgeCloudError) -> ExtensionUnsupportedError | None:
        """Async twin of :meth:`_which_refused`."""
        present = self._refusal(body, exc)
        if present is None or not await self._aaccepts(_without(body, present)):
            return None
        if len(present) > 1:
            present = [n for n in present if await self._aaccepts(_without(body, [n]))][:1] or present
        return self._refused_as(present, exc)

    async def acomplete(self, request: ChatRequest) -> ChatCompletion:
        """The whole answer: :meth:`astream` collected (and closed on error)."""
        chunks = self.astream(request)
        try:
            return collect_chunks([chunk async for chunk in chunks])
        finally:
            await chunks.aclose()

    async def aclose(self) -> None:
        """Close the HTTP clients it made. Safe to call twice."""
        self._closed = True
        if self._async_client is not None and self._owns_async_client:
            await self._async_client.aclose()
        if self._owns_client:
            self._client.close()

    async def __aenter__(self) -> Self:
        return self
