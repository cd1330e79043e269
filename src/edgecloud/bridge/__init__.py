"""The bridge: edgecloud for host apps (Swift, Kotlin, ...) over JSON-RPC 2.0, one object per line.

- :mod:`.protocol`: every message as a pydantic model, the method table, :func:`schema`.
- :mod:`.server`: :class:`Bridge`, ``handle(line, emit)`` for hosts that embed Python.
- :mod:`.stdio`: :func:`serve_stdio`, the same over stdin/stdout (``edgecloud bridge --stdio``).
"""

from __future__ import annotations

from .protocol import PROTOCOL_VERSION, ErrorCode, schema
from .server import Bridge
from .stdio import serve_stdio

__all__ = ["Bridge", "ErrorCode", "PROTOCOL_VERSION", "schema", "serve_stdio"]
