"""Bridge test fixtures: one real smollm2 client for the session, a fresh Bridge per test, and a
host that records every line the bridge emits and waits for messages by request id."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edgecloud import EdgeCloud
from edgecloud.bridge import Bridge

WAIT_S = 120.0


class Host:
    """The host side, in-process: ``send`` lines into a Bridge, read back what it emitted."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge
        self.messages: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._next_id = 0

    def emit(self, line: str) -> None:
        assert "\n" not in line, "one JSON object per line"
        with self._cond:
            self.messages.append(json.loads(line))
            self._cond.notify_all()

    def send(self, line: str | bytes | dict[str, Any]) -> None:
        self.bridge.handle(line if isinstance(line, (str, bytes)) else json.dumps(line), self.emit)

    def request(self, method: str, params: dict[str, Any] | None = None) -> int:
        self._next_id += 1
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": self._next_id, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        return self._next_id

    def wait_for(self, found: Callable[[dict[str, Any]], bool], timeout: float = WAIT_S) -> dict[str, Any]:
        """The first message ``found`` accepts, waiting for it to be emitted."""
        with self._cond:
            assert self._cond.wait_for(lambda: any(found(m) for m in self.messages), timeout), "timed out"
            return next(m for m in self.messages if found(m))

    def response(self, rid: Any, timeout: float = WAIT_S) -> dict[str, Any]:
        return self.wait_for(lambda m: "method" not in m and m.get("id") == rid, timeout)

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.response(self.request(method, params))

    def notes(self, rid: Any, method: str = "chat.delta") -> list[dict[str, Any]]:
        with self._cond:
            return [m["params"] for m in self.messages if m.get("method") == method and m["params"]["id"] == rid]

    def position(self, rid: Any) -> int:
        """Where the response to ``rid`` is in the order of emitted lines."""
        with self._cond:
            return next(i for i, m in enumerate(self.messages) if "method" not in m and m.get("id") == rid)


@pytest.fixture(scope="session")
def smollm2_client(smollm2_path: Path) -> Iterator[EdgeCloud]:
    pytest.importorskip("llama_cpp")
    with EdgeCloud(edge_model=smollm2_path) as client:
        yield client


@pytest.fixture()
def bridge(smollm2_client: EdgeCloud) -> Iterator[Bridge]:
    with Bridge(smollm2_client, progress_interval_s=0.01) as served:
        yield served


@pytest.fixture()
def host(bridge: Bridge) -> Host:
    return Host(bridge)


def long_chat(max_tokens: int = 200) -> dict[str, Any]:
    """Params of a chat that would run ``max_tokens`` tokens unless stopped."""
    return {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": max_tokens,
            "ignore_eos": True}


@pytest.fixture()
def long_chat_params() -> Callable[..., dict[str, Any]]:
    return long_chat


@pytest.fixture()
def host_for() -> Callable[[Bridge], Host]:
    """A :class:`Host` for a Bridge a test builds itself."""
    return Host
