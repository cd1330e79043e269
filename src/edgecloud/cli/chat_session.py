"""``edgecloud chat --session NAME``: a conversation that survives closing the CLI.

This module owns where a named chat's history is kept (``<edgecloud cache>/chats/``, one JSON
file per session, written atomically after every turn) and reading it back. The KV of the
conversation is the edge runtime's business: the client runs with ``session=NAME`` so each
answer's KV goes to the disk tier and the next turn, in a new process, loads it instead of
recomputing the history.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import ConfigError
from ..store.cache import home_dir
from ..types import ChatMessage, check_session_name

__all__ = ["history_file", "load_history", "save_history"]


def history_file(name: str) -> Path:
    """The file session ``name``'s history is kept in."""
    return home_dir() / "chats" / (hashlib.sha256(name.encode()).hexdigest()[:24] + ".json")


def check_name(name: str) -> str:
    """``name`` if it may name a session (ConfigError saying what to change otherwise)."""
    try:
        return check_session_name(name)
    except ValueError as exc:
        raise ConfigError(f"invalid --session {name!r}: {exc}") from None


def load_history(name: str) -> list[ChatMessage]:
    """The messages of session ``name`` so far (empty for a new session)."""
    path = history_file(check_name(name))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise ConfigError(f"the history of session {name!r} ({path}) cannot be read ({exc}); "
                          "delete the file or pick another --session") from exc
    if not isinstance(data, dict) or data.get("session") != name or not isinstance(data.get("messages"), list):
        raise ConfigError(f"{path} is not the history of session {name!r}; delete it or pick another --session")
    return [ChatMessage.model_validate(m) for m in data["messages"]]


def save_history(name: str, messages: list[ChatMessage]) -> None:
    """Write session ``name``'s messages (atomically: a crash leaves the old file or the new one)."""
    path = history_file(check_name(name))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    body = {"session": name, "messages": [m.model_dump(mode="json", exclude_none=True) for m in messages]}
    tmp.write_text(json.dumps(body, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
