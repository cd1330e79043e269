"""CloudBackend against the real edgecloud server (uvicorn on loopback, llama.cpp + SmolLM2),
and against a raw scripted HTTP server for fault injection only (429, 503, broken streams).

Greedy answers are compared with what the same backend says when called directly.
"""

from __future__ import annotations

import asyncio
import email.utils
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from edgecloud.remote.client import CloudBackend
from edgecloud.serving.server import create_app
from edgecloud.edge.llamacpp import LlamaCppBackend
from edgecloud.errors import (
    AuthenticationError,
    BackendError,
    BackendUnavailableError,
    ContextOverflowError,
    EdgeCloudError,
    InvalidRequestError,
    ModelNotFoundError,
    RateLimitedError,
)
from edgecloud.types import ChatCompletionChunk, ChatRequest, collect_chunks
from faults import USAGE, free_port, ScriptedServer, event, hang_up, json_reply, sse_reply

MODEL = "smollm2-test"
KEY = "sk-test-key"
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
STORY_TOKENS = 120
GREEDY = ChatRequest(messages=QUESTION, max_tokens=16, temperature=0)


def _drain(backend: CloudBackend, request: ChatRequest, mode: str) -> tuple[list[ChatCompletionChunk], Exception | None]:
    """All chunks of one stream (sync or async path) and the error that ended it, if any."""
    got: list[ChatCompletionChunk] = []
    if mode == "sync":
        with backend:
            try:
                got.extend(backend.stream(request))
            except EdgeCloudError as exc:
                return got, exc
        return got, None

    async def main() -> Exception | None:
        try:
            async for chunk in backend.astream(request):
                got.append(chunk)
        except EdgeCloudError as exc:
            return exc
        finally:
            await backend.aclose()
        return None

    return got, asyncio.run(main())


# ------------------------------------------------------------------ the real server


@pytest.fixture(scope="module")
def edge_backend(smollm2_path: Path) -> Iterator[LlamaCppBackend]:
    backend = LlamaCppBackend(smollm2_path, n_ctx=1024, n_threads=2, flash_attn=False)
    backend.load()
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def server_url(edge_backend: LlamaCppBackend) -> Iterator[str]:
    """``edgecloud serve``'s app on a real uvicorn (bare URL, no /v1)."""
    app = create_app(edge_backend, model_name=MODEL, api_key=KEY)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture()
def cloud(server_url: str) -> Iterator[CloudBackend]:
    with CloudBackend(server_url, MODEL, api_key=KEY) as backend:
        yield backend


@pytest.fixture(scope="module")
def direct(edge_backend: LlamaCppBackend) -> Any:
    """The greedy answer of the backend behind the server, asked directly."""
    return edge_backend.complete(GREEDY)


def test_base_url_rule() -> None:
    # a bare host gets /v1; a URL with a path is the API root as given
    for given, root in [
        ("http://h:1", "http://h:1/v1"),
        ("http://h:1/", "http://h:1/v1"),
        ("http://h:1/v1/", "http://h:1/v1"),
        ("https://proxy.example/openai/v1", "https://proxy.example/openai/v1"),
    ]:
        with CloudBackend(given, "m") as cloud:
            assert cloud.base_url == root


@pytest.mark.parametrize("suffix", ["", "/v1/"])
def test_stream_matches_the_backend_greedy_answer(server_url: str, direct: Any, suffix: str) -> None:
    with CloudBackend(server_url + suffix, MODEL, api_key=KEY) as cloud:
        chunks = list(cloud.stream(GREEDY))
    assert "".join(c.text for c in chunks) == direct.text and direct.text
    last = chunks[-1]
    assert last.choices[0].finish_reason == direct.choices[0].finish_reason
    assert last.usage is not None
    assert last.usage.completion_tokens == direct.usage.completion_tokens
    assert last.usage.prompt_tokens == direct.usage.prompt_tokens
    assert [c.usage is None for c in chunks[:-1]] == [True] * (len(chunks) - 1)
    for stamped in (chunks[0], last):
        assert stamped.route is not None and stamped.route.target == "cloud" and stamped.route.backend == "openai-http"
    assert "llamacpp" in last.route.reason  # type: ignore[union-attr]  # the server's own route, passed on


def test_complete_matches_the_backend(cloud: CloudBackend, direct: Any) -> None:
    answer = cloud.complete(GREEDY)
    assert answer.text == direct.text
    assert answer.usage.completion_tokens == direct.usage.completion_tokens
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert answer.route is not None and answer.route.target == "cloud"


def test_async_stream_and_complete(server_url: str, direct: Any) -> None:
    async def main() -> tuple[str, Any]:
        async with CloudBackend(f"{server_url}/v1", MODEL, api_key=KEY) as cloud:
            text = "".join([c.text async for c in cloud.astream(GREEDY)])
            return text, await cloud.acomplete(GREEDY)

    text, answer = asyncio.run(main())
    assert text == answer.text == direct.text
    assert answer.usage.completion_tokens == direct.usage.completion_tokens
    assert answer.route is not None and answer.route.target == "cloud"


def test_context_overflow(cloud: CloudBackend) -> None:
    long = ChatRequest(messages=[{"role": "user", "content": "word " * 3000}], max_tokens=4)
    with pytest.raises(ContextOverflowError) as info:
        cloud.complete(long)
    assert info.value.context_tokens == 1024 and info.value.prompt_tokens > 1024
    assert "context window is 1024 tokens" in str(info.value)  # the server's own message


def test_wrong_api_key(server_url: str) -> None:
    with CloudBackend(server_url, MODEL, api_key="sk-wrong") as cloud:
        with pytest.raises(AuthenticationError, match="incorrect API key"):
            cloud.complete(GREEDY)
        with pytest.raises(AuthenticationError):
            cloud.load()


def test_unknown_model(server_url: str) -> None:
    with CloudBackend(server_url, "gpt-17", api_key=KEY) as cloud:
        with pytest.raises(ModelNotFoundError, match="gpt-17"):
            list(cloud.stream(GREEDY))
        with pytest.raises(ModelNotFoundError, match=MODEL):  # load names what the server has
            cloud.load()


def test_load_checks_the_endpoint(cloud: CloudBackend) -> None:
    cloud.load()
    down = CloudBackend(f"http://127.0.0.1:{free_port()}", MODEL)  # constructing never connects
    with down, pytest.raises(BackendUnavailableError, match="cannot connect"):
        down.load()


def test_closed_backend_refuses(server_url: str) -> None:
    cloud = CloudBackend(server_url, MODEL, api_key=KEY)
    cloud.close()
    cloud.close()
    with pytest.raises(BackendUnavailableError, match="closed"):
        cloud.complete(GREEDY)


@pytest.fixture(scope="module")
def story_tokens(edge_backend: LlamaCppBackend) -> int:
    full = edge_backend.complete(ChatRequest(messages=STORY, max_tokens=STORY_TOKENS, temperature=0))
    assert full.usage.completion_tokens > STORY_TOKENS // 2
    return full.usage.completion_tokens


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_closing_the_stream_stops_generation(
    cloud: CloudBackend, edge_backend: LlamaCppBackend, story_tokens: int, mode: str
) -> None:
    story = ChatRequest(messages=STORY, max_tokens=STORY_TOKENS, temperature=0)
    before = edge_backend.stats.completion_tokens
    if mode == "sync":
        stream = cloud.stream(story)
        assert next(stream).choices and next(stream).text
        stream.close()
    else:

        async def main() -> None:
            stream = cloud.astream(story)
            assert (await stream.__anext__()).choices and (await stream.__anext__()).text
            await stream.aclose()

        asyncio.run(main())
    # the next request waits for the serial backend, so the abandoned one must have stopped
    small = cloud.complete(ChatRequest(messages=QUESTION, max_tokens=4, temperature=0))
    abandoned = edge_backend.stats.completion_tokens - before - small.usage.completion_tokens
    assert abandoned < story_tokens // 2


# ------------------------------------------------------------------ fault injection

DONE = "data: [DONE]\n\n"
ANSWER = (event(), event("Hel"), event("lo"), event(finish="stop", text=""), USAGE, DONE)
ERROR = {"error": {"message": "the engine is warming up", "type": "server_error", "param": None, "code": None}}


@pytest.fixture(scope="module")
def scripted() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    yield server
    server.close()


def fast(url: str, **options: Any) -> CloudBackend:
    return CloudBackend(url, "m", **{"backoff": 0.01, **options})


def test_sse_framing_and_usage_merge(scripted: ScriptedServer) -> None:
    split = event("lo").replace(', "finish_reason"', ',\ndata: "finish_reason"')  # one event, two data lines
    assert split.count("data:") == 2
    scripted.script(
        sse_reply(
            ": keepalive\n\n",
            event().replace("\n", "\r\n"),
            "data:" + event("Hel")[6:],  # no space after the colon
            split,
            "\n",
            event(finish="content_filter", text=""),  # a reason we do not have: read as stop
            USAGE,
            DONE,
            event("after done"),
        )
    )
    with fast(scripted.url) as cloud:
        chunks = list(cloud.stream(GREEDY))
    assert "".join(c.text for c in chunks) == "Hello"
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, None, None, "stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 7 and chunks[-1].usage.cached_tokens == 3
    assert [c.route is not None for c in chunks] == [True, False, False, True]


def test_request_sends_only_the_fields_set(scripted: ScriptedServer) -> None:
    scripted.script(sse_reply(*ANSWER))
    request = ChatRequest(model="ignored", messages=QUESTION, max_tokens=5, route="cloud", privacy="default")
    with fast(scripted.url, api_key="sk-1", headers={"X-Team": "a"}) as cloud:
        assert cloud.complete(request).text == "Hello"
    line, headers, body = scripted.requests[0]
    assert line.startswith("POST /v1/chat/completions ")
    assert headers["authorization"] == "Bearer sk-1" and headers["x-team"] == "a"
    assert body == {
        "model": "m",
        "messages": QUESTION,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize(("hint", "mode"), [("seconds", "sync"), ("http-date", "async")])
def test_429_waits_retry_after_then_succeeds(scripted: ScriptedServer, hint: str, mode: str) -> None:
    # an HTTP-date has whole seconds: 2 s ahead is a wait between 1 and 2 s
    after = "1" if hint == "seconds" else email.utils.formatdate(time.time() + 2, usegmt=True)
    scripted.script(json_reply(429, ERROR, {"Retry-After": after}), sse_reply(*ANSWER))
    chunks, error = _drain(fast(scripted.url, backoff=0.0), GREEDY, mode)
    assert error is None and collect_chunks(chunks).text == "Hello"
    assert len(scripted.hits) == 2
    assert scripted.hits[1] - scripted.hits[0] >= 0.8


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_503_twice_then_succeeds(scripted: ScriptedServer, mode: str) -> None:
    scripted.script(json_reply(503, ERROR), json_reply(503, ERROR), sse_reply(*ANSWER))
    chunks, error = _drain(fast(scripted.url, max_retries=2), GREEDY, mode)
    assert error is None and collect_chunks(chunks).text == "Hello"
    assert len(scripted.hits) == 3


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_always_503_gives_up_after_max_retries(scripted: ScriptedServer, mode: str) -> None:
    scripted.script(json_reply(503, ERROR))
    chunks, error = _drain(fast(scripted.url, max_retries=2), GREEDY, mode)
    assert isinstance(error, BackendUnavailableError) and not chunks
    assert "the engine is warming up" in str(error) and "after 3 attempts" in str(error)
    assert len(scripted.hits) == 3


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_connection_dropped_before_answering_is_retried(scripted: ScriptedServer, mode: str) -> None:
    scripted.script(hang_up(), sse_reply(*ANSWER))
    chunks, error = _drain(fast(scripted.url, max_retries=1), GREEDY, mode)
    assert error is None and collect_chunks(chunks).text == "Hello"
    assert len(scripted.hits) == 2
    scripted.script(hang_up())
    chunks, error = _drain(fast(scripted.url, max_retries=1), GREEDY, mode)
    assert isinstance(error, BackendUnavailableError) and not chunks
    assert "dropped the connection before answering after 2 attempts" in str(error)


def test_429_after_retries_carries_retry_after(scripted: ScriptedServer) -> None:
    scripted.script(json_reply(429, ERROR, {"Retry-After": "0"}))
    with fast(scripted.url, max_retries=1) as cloud, pytest.raises(RateLimitedError) as info:
        cloud.complete(GREEDY)
    assert info.value.retry_after == 0 and info.value.status_code == 429
    assert len(scripted.hits) == 2


def test_retry_after_beyond_the_cap_raises_at_once(scripted: ScriptedServer) -> None:
    scripted.script(json_reply(429, ERROR, {"Retry-After": "3600"}))
    with fast(scripted.url, max_retries=5) as cloud, pytest.raises(RateLimitedError, match="warming up") as info:
        cloud.complete(GREEDY)
    assert info.value.retry_after == 3600
    assert len(scripted.hits) == 1


@pytest.mark.parametrize(
    ("status", "error_class"),
    [
        (401, AuthenticationError),
        (403, AuthenticationError),
        (404, ModelNotFoundError),
        (422, InvalidRequestError),
        (500, BackendError),
    ],
)
def test_status_codes_map_to_the_error_tree(scripted: ScriptedServer, status: int, error_class: type) -> None:
    scripted.script(json_reply(status, ERROR))
    with fast(scripted.url) as cloud, pytest.raises(error_class, match="the engine is warming up"):
        cloud.complete(GREEDY)
    assert len(scripted.hits) == 1  # not retried: the same request would fail the same way


@pytest.mark.parametrize("status", [502, 503, 504])
def test_gateway_and_overload_statuses_are_retried_then_unavailable(scripted: ScriptedServer, status: int) -> None:
    scripted.script(json_reply(status, ERROR))
    with fast(scripted.url, max_retries=2) as cloud, pytest.raises(BackendUnavailableError) as info:
        cloud.complete(GREEDY)
    assert len(scripted.hits) == 3 and info.value.cause == "server_error"


def test_injected_transport_is_used() -> None:
    import httpx

    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(503, json=ERROR)

    with CloudBackend("http://cloud.invalid", "m", api_key=KEY, max_retries=0,
                      transport=httpx.MockTransport(handler)) as cloud, pytest.raises(BackendUnavailableError):
        cloud.complete(GREEDY)
    assert len(seen) == 1 and seen[0].headers["authorization"] == f"Bearer {KEY}"
    assert str(seen[0].url) == "http://cloud.invalid/v1/chat/completions"


def test_400_keeps_the_param(scripted: ScriptedServer) -> None:
    bad = {"error": {"message": "temperature must be <= 2", "type": "invalid_request_error", "param": "temperature"}}
    scripted.script(json_reply(400, bad))
    with fast(scripted.url) as cloud, pytest.raises(InvalidRequestError, match="must be <= 2") as info:
        cloud.complete(GREEDY)
    assert info.value.param == "temperature" and not isinstance(info.value, ContextOverflowError)


def test_vllm_context_overflow_counts_are_parsed(scripted: ScriptedServer) -> None:
    message = (
        "This model's maximum context length is 2048 tokens. However, you requested 3000 tokens "
        "(2990 in the messages, 10 in the completion). Please reduce the length of the messages or completion."
    )
    scripted.script(json_reply(400, {"object": "error", "message": message, "type": "BadRequestError", "code": 400}))
    with fast(scripted.url) as cloud, pytest.raises(ContextOverflowError, match="Please reduce") as info:
        cloud.complete(GREEDY)
    assert (info.value.prompt_tokens, info.value.context_tokens) == (2990, 2048)


@pytest.mark.parametrize(
    ("events", "cut", "message"),
    [
        ((event(), event("Hel")), True, "broke after 2 chunks"),
        ((event(), event("Hel"), "data: {not json\n\n"), False, "malformed"),
        ((event(), event("Hel"), 'data: {"error": {"message": "engine died", "type": "x"}}\n\n'), False, "engine died"),
        ((event(), event("Hel")), False, "without a finish reason"),
    ],
    ids=["cut", "malformed", "in-band-error", "no-done"],
)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failure_after_text_is_not_retried(
    scripted: ScriptedServer, events: tuple[str, ...], cut: bool, message: str, mode: str
) -> None:
    scripted.script(sse_reply(*events, cut=cut), sse_reply(*ANSWER))
    chunks, error = _drain(fast(scripted.url, max_retries=3), GREEDY, mode)
    assert type(error) is BackendError and message in str(error)
    assert "".join(c.text for c in chunks) == "Hel"
    assert len(scripted.hits) == 1


def test_finished_answer_without_done_is_accepted(scripted: ScriptedServer) -> None:
    scripted.script(sse_reply(*ANSWER[:-1]))
    with fast(scripted.url) as cloud:
        answer = cloud.complete(GREEDY)
    assert answer.text == "Hello" and answer.usage.completion_tokens == 2


def test_read_timeout(scripted: ScriptedServer) -> None:
    scripted.script(sse_reply(event(), event("Hel"), stall=5))
    with fast(scripted.url, read_timeout=0.3) as cloud, pytest.raises(BackendError, match="read_timeout") as info:
        list(cloud.stream(GREEDY))
    assert len(scripted.hits) == 1 and not isinstance(info.value, BackendUnavailableError)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_connection_refused(mode: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    chunks, error = _drain(fast(url, max_retries=1), GREEDY, mode)
    assert isinstance(error, BackendUnavailableError) and url in str(error) and "after 2 attempts" in str(error)
    assert not chunks
