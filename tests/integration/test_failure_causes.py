"""Each real failure, driven for real, is recorded with its typed cause.

The cloud side is a real :class:`~edgecloud.remote.client.CloudBackend` talking over loopback
sockets to a port nobody listens on, or to a raw scripted server that stalls, answers 429 /
500 / 503, cuts the stream or sends a truncated line. The edge side is a real llama.cpp backend
pointed at a missing file, and backends that raise what a runtime raises (MemoryError). The
cause comes from where the failure happened (the error's ``cause``), never from its text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")

from edgecloud.backend import Backend
from edgecloud.remote.client import CloudBackend
from edgecloud.errors import BackendError
from edgecloud.fallback import Attempt, CircuitBreaker, FailoverStream
from edgecloud.types import ChatCompletionChunk, ChatRequest, ChoiceDelta, ChunkChoice, RouteInfo, Usage
from faults import ScriptedServer, event, free_port, json_reply, sse_reply

REQUEST = ChatRequest(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
ERROR = {"error": {"message": "busy", "type": "server_error", "param": None, "code": None}}


class Finishes(Backend):
    """Where the request lands after the fault: answers 'fine.' (the side under test is the other)."""

    name = "rescue"

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        yield ChatCompletionChunk(id="r", created=1, model="r", choices=[ChunkChoice(delta=ChoiceDelta(content="fine."))])
        yield ChatCompletionChunk(id="r", created=1, model="r", choices=[ChunkChoice(delta=ChoiceDelta(), finish_reason="stop")],
                                  usage=Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4))


class Raises(Backend):
    """A runtime that raises ``error`` when asked (fault injection)."""

    name = "faulty"

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        raise self.error
        yield  # pragma: no cover - a generator


def _run(failing: Backend, side: str) -> RouteInfo:
    other = "edge" if side == "cloud" else "cloud"
    route = RouteInfo(target=side, backend="")  # type: ignore[arg-type]
    attempts = [Attempt(side, failing, CircuitBreaker("a"), "a"), Attempt(other, Finishes(), CircuitBreaker("b"), "b")]  # type: ignore[arg-type]
    chunks = list(FailoverStream(attempts, REQUEST, route))
    assert "fine." in "".join(c.text for c in chunks)
    return route


@pytest.fixture(scope="module")
def scripted() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    yield server
    server.close()


def _cloud(url: str, **options: Any) -> CloudBackend:
    return CloudBackend(url, "m", **{"backoff": 0.01, "max_retries": 0, **options})


SCRIPTS: dict[str, tuple[Callable[[], Any], dict[str, Any], str]] = {
    "429": (lambda: json_reply(429, ERROR), {}, "rate_limited"),
    "500": (lambda: json_reply(500, ERROR), {}, "server_error"),
    "503": (lambda: json_reply(503, ERROR), {}, "server_error"),
    "stall": (lambda: sse_reply(event(), stall=3), {"read_timeout": 0.3}, "timeout"),
    "cut": (lambda: sse_reply(event(), event("Hel"), cut=True), {}, "disconnected"),
    "truncated-line": (lambda: sse_reply(event(), event("Hel")[:40] + "\n\n"), {}, "malformed_stream"),
    "no-finish": (lambda: sse_reply(event(), event("Hel")), {}, "disconnected"),
}


@pytest.mark.parametrize("case", list(SCRIPTS))
def test_cloud_failures_record_their_cause(scripted: ScriptedServer, case: str) -> None:
    reply, options, cause = SCRIPTS[case]
    scripted.script(reply())
    with _cloud(scripted.url, **options) as cloud:
        route = _run(cloud, "cloud")
    assert route.fallbacks[0]["cause"] == cause, route.fallbacks[0]


def test_refused_port_is_connect() -> None:
    with _cloud(f"http://127.0.0.1:{free_port()}") as cloud:
        route = _run(cloud, "cloud")
    assert route.fallbacks[0]["cause"] == "connect"


def test_missing_model_file_is_load_error(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(tmp_path / "gone.gguf") as edge:
        route = _run(edge, "edge")
    assert route.fallbacks[0]["cause"] == "load_error"


@pytest.mark.parametrize(("error", "cause"), [(MemoryError(), "out_of_memory"), (RuntimeError("ggml abort"), "unknown")])
def test_edge_runtime_errors(error: BaseException, cause: str) -> None:
    assert _run(Raises(error), "edge").fallbacks[0]["cause"] == cause


def test_final_failure_carries_the_typed_cause(scripted: ScriptedServer) -> None:
    scripted.script(json_reply(500, ERROR))
    route = RouteInfo(target="cloud", backend="")
    with _cloud(scripted.url) as cloud, pytest.raises(BackendError) as info:
        list(FailoverStream([Attempt("cloud", cloud, CircuitBreaker("a"), "a")], REQUEST, route))
    assert info.value.cause == "server_error"
    with pytest.raises(BackendError) as raw:
        list(FailoverStream([Attempt("edge", Raises(RuntimeError("x")), CircuitBreaker("e"), "e")], REQUEST, route))
    assert raw.value.cause == "unknown" and "RuntimeError" in str(raw.value)
