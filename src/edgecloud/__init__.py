"""edgecloud: edge-cloud hybrid LLM inference behind one OpenAI-shaped chat API.

Public API only: the clients, the request/response types and the exception tree.
"""

from __future__ import annotations

from .backend import Backend
from .client import AsyncEdgeCloud, EdgeCloud
from .errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    ContextOverflowError,
    EdgeCloudError,
    GenerationCancelled,
    InvalidRequestError,
    ModelError,
    ModelFetchError,
    ModelIntegrityError,
    ModelNotFoundError,
)
from .types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessage,
    ChatRequest,
    RouteInfo,
    Usage,
)

from ._version import __version__

__all__ = [
    "EdgeCloud",
    "AsyncEdgeCloud",
    "Backend",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatMessage",
    "ChatRequest",
    "RouteInfo",
    "Usage",
    "EdgeCloudError",
    "InvalidRequestError",
    "ContextOverflowError",
    "ModelError",
    "ModelNotFoundError",
    "ModelIntegrityError",
    "ModelFetchError",
    "BackendError",
    "BackendUnavailableError",
    "GenerationCancelled",
    "ConfigError",
    "__version__",
]
