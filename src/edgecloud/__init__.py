"""edgecloud: edge-cloud hybrid LLM inference behind one OpenAI-shaped chat API.

Public API only: the clients, the request/response types and the exception tree.
"""

from __future__ import annotations

from ._version import __version__
from .backend import Backend
from .client import AsyncEdgeCloud, EdgeCloud
from .errors import (AuthenticationError, BackendError, BackendUnavailableError, ConfigError, ContextOverflowError,
                     EdgeCloudError, GenerationCancelled, InvalidRequestError, ModelError, ModelFetchError,
                     ModelIntegrityError, ModelNotFoundError, PrivacyViolationError, RateLimitedError)
from .types import ChatCompletion, ChatCompletionChunk, ChatMessage, ChatRequest, FallbackEvent, RouteInfo, RouteNote, Usage

__all__ = [
    "AsyncEdgeCloud", "EdgeCloud", "Backend", "__version__",
    # requests and answers
    "ChatCompletion", "ChatCompletionChunk", "ChatMessage", "ChatRequest", "FallbackEvent", "RouteInfo", "RouteNote",
    "Usage",
    # errors (the tree is drawn in edgecloud.errors)
    "AuthenticationError", "BackendError", "BackendUnavailableError", "ConfigError", "ContextOverflowError",
    "EdgeCloudError", "GenerationCancelled", "InvalidRequestError", "ModelError", "ModelFetchError",
    "ModelIntegrityError", "ModelNotFoundError", "PrivacyViolationError", "RateLimitedError",
]
