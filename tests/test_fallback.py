"""Failover parts without models: the circuit breaker, error causes, stream stitching, PII restore
while streaming, and assistant-prefill prompts (the real-process tests are in tests/integration)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from edgecloud.backend import Backend
from edgecloud.runtime.chat_template import ChatTemplate
from edgecloud.errors import (
    AuthenticationError,
    BackendError,
    BackendUnavailableError,
    ContextOverflowError,
    InvalidRequestError,
    ModelNotFoundError,
    RateLimitedError,
)
from edgecloud.fallback import Attempt, CircuitBreaker, FailoverStream, can_fall_back, cause_of
from edgecloud.router.pii import StreamingRestore, redact
from edgecloud.types import ChatCompletionChunk, ChatRequest, ChoiceDelta, ChunkChoice, RouteInfo, Usage

REQUEST = ChatRequest(messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=20)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Scripted(Backend):
    """Fault injection: yields the given pieces, then raises ``fail`` (or finishes)."""

    def __init__(self, name: str, pieces: list[str], fail: Exception | None = None) -> None:
        self.name, self.pieces, self.fail = name, pieces, fail  # type: ignore[misc]
        self.requests: list[ChatRequest] = []

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        self.requests.append(request)
        yield _chunk(self.name, ChoiceDelta(role="assistant", content=""))
        for piece in self.pieces:
            yield _chunk(self.name, ChoiceDelta(content=piece))
        if self.fail is not None:
            raise self.fail
        usage = Usage(prompt_tokens=7, completion_tokens=len(self.pieces), total_tokens=7 + len(self.pieces))
        yield _chunk(self.name, ChoiceDelta(), finish="stop", usage=usage)


def _chunk(name: str, delta: ChoiceDelta, finish: str | None = None, usage: Usage | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=f"id-{name}", created=1, model=name,
                               choices=[ChunkChoice(delta=delta, finish_reason=finish)], usage=usage)


def _attempt(side: str, backend: Backend, threshold: int = 3) -> Attempt:
    return Attempt(side, backend, CircuitBreaker(backend.name, failure_threshold=threshold), backend.name)  # type: ignore[arg-type]


# ------------------------------------------------------------------ breaker


def test_breaker_opens_half_opens_and_closes() -> None:
    clock = Clock()
    breaker = CircuitBreaker("cloud", failure_threshold=2, cooldown_s=10, clock=clock)
    assert breaker.allow() and breaker.state == "closed"
    breaker.failure()
    assert breaker.state == "closed"  # one failure is not enough
    breaker.failure()
    assert breaker.state == "open" and not breaker.allow() and not breaker.available()
    clock.now = 10.0
    assert breaker.state == "half_open" and breaker.available()
    assert breaker.allow() and not breaker.allow()  # one trial at a time
    breaker.failure()  # the trial failed: open again, cooldown restarts
    assert breaker.state == "open"
    clock.now = 20.0
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()


def test_breaker_released_trial_can_be_taken_again() -> None:
    clock = Clock()
    breaker = CircuitBreaker("edge", failure_threshold=1, cooldown_s=1, clock=clock)
    breaker.failure()
    clock.now = 1.0
    assert breaker.allow() and not breaker.allow()
    breaker.release()  # the caller stopped reading: no verdict
    assert breaker.allow()


# ------------------------------------------------------------------ causes


def test_cause_is_read_from_the_type_never_the_text() -> None:
    # the words CloudBackend once used for these causes now mean nothing without the typed field
    for text in ("cannot connect to http://x: refused", "http://x did not answer (read_timeout)",
                 "sent a malformed stream", "the stream broke after 3 chunks", "dropped the connection"):
        assert cause_of(BackendError(text), "cloud") == "unknown"
    assert cause_of(BackendError("anything", cause="timeout"), "cloud") == "timeout"
    assert cause_of(RateLimitedError("slow down"), "cloud") == "rate_limited"
    assert cause_of(ContextOverflowError(9000, 2048), "edge") == "context_overflow"
    assert cause_of(ModelNotFoundError("no file"), "edge") == "load_error"
    assert cause_of(MemoryError(), "edge") == "out_of_memory"
    assert cause_of(RuntimeError("ggml"), "edge") == "unknown"
    with pytest.raises(ValueError, match="unknown failure cause"):
        BackendError("x", cause="gremlins")  # type: ignore[arg-type]


def test_what_falls_back() -> None:
    assert can_fall_back(BackendError("x"), "cloud") and can_fall_back(RuntimeError("x"), "edge")
    assert can_fall_back(ContextOverflowError(9000, 2048), "edge")
    assert can_fall_back(ModelNotFoundError("no file"), "edge")
    assert not can_fall_back(ModelNotFoundError("model gpt-x not served"), "cloud")
    assert not can_fall_back(AuthenticationError("bad key"), "cloud")
    assert not can_fall_back(InvalidRequestError("bad temperature"), "edge")


# ------------------------------------------------------------------ stitching


def test_failure_before_text_starts_the_next_backend_fresh() -> None:
    dead = Scripted("cloud-a", [], BackendUnavailableError("refused", cause="connect"))
    edge = Scripted("edge", ["Once", " upon"])
    route = RouteInfo(target="cloud", backend="")
    chunks = list(FailoverStream([_attempt("cloud", dead), _attempt("edge", edge)], REQUEST, route))
    assert "".join(c.text for c in chunks) == "Once upon"
    assert edge.requests[0] is REQUEST  # nothing delivered: the original request
    assert route.target == "edge" and route.fallbacks[0]["cause"] == "connect" and route.fallbacks[0]["at_chars"] == 0
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1


def test_failure_mid_stream_continues_with_the_partial_answer() -> None:
    cloud = Scripted("cloud", ["Once", " upon"], BackendError("cut off", cause="disconnected"))
    edge = Scripted("edge", [" a time."])
    route = RouteInfo(target="cloud", backend="")
    seen: list[tuple[str, str, str, int]] = []
    stream = FailoverStream([_attempt("cloud", cloud), _attempt("edge", edge)], REQUEST, route,
                            on_fallback=lambda *a: seen.append(a))
    chunks = list(stream)
    assert "".join(c.text for c in chunks) == "Once upon a time."
    cont = edge.requests[0]
    assert cont.continue_final_message and cont.messages[-1].role == "assistant"
    assert cont.messages[-1].content == "Once upon" and cont.max_tokens == 18
    assert seen == [("cloud", "edge", "disconnected", 9)]
    assert route.fallbacks[0]["at_tokens"] == 2
    assert {c.id for c in chunks} == {"id-cloud"}  # one stream id throughout
    final = chunks[-1]
    assert final.usage is not None and final.usage.completion_tokens == 3
    assert [p.side for p in stream.parts] == ["cloud", "edge"] and stream.parts[1].ok


def test_each_chunk_keeps_the_route_it_was_produced_with() -> None:
    cloud = Scripted("cloud", ["Once", " upon"], BackendError("cut off", cause="disconnected"))
    edge = Scripted("edge", [" a time."])
    route = RouteInfo(target="cloud", backend="")
    held: list[tuple[ChatCompletionChunk, str, int]] = []
    for chunk in FailoverStream([_attempt("cloud", cloud), _attempt("edge", edge)], REQUEST, route):
        assert chunk.route is not None
        held.append((chunk, chunk.route.target, len(chunk.route.fallbacks)))
    # nothing a chunk carried changed after it was handed out
    assert all(c.route.target == target and len(c.route.fallbacks) == n for c, target, n in held)
    by_text = {c.text: c.route for c, _, _ in held if c.text}
    assert by_text["Once"].target == "cloud" and by_text["Once"].fallbacks == []
    assert by_text[" a time."].target == "edge" and by_text[" a time."].fallbacks[0]["cause"] == "disconnected"
    final = held[-1][0]
    assert final.choices[0].finish_reason == "stop" and final.route.fallbacks[0].get("resume_s") is not None
    assert final.route is not route  # a copy: the stream's own record stays its own


def test_async_iteration_switches_like_the_sync_one() -> None:
    import asyncio

    cloud = Scripted("cloud", ["Once", " upon"], BackendError("cut off", cause="disconnected"))
    edge = Scripted("edge", [" a time."])
    route = RouteInfo(target="cloud", backend="")

    async def run() -> list[ChatCompletionChunk]:
        return [c async for c in FailoverStream([_attempt("cloud", cloud), _attempt("edge", edge)], REQUEST, route)]

    chunks = asyncio.run(run())
    assert "".join(c.text for c in chunks) == "Once upon a time."
    assert edge.requests[0].messages[-1].content == "Once upon"
    assert route.target == "edge" and route.fallbacks[0]["cause"] == "disconnected"


def test_no_fallback_mid_stream_when_disabled_and_typed_errors() -> None:
    cloud = Scripted("cloud", ["Once"], BackendError("the stream broke", cause="disconnected"))
    edge = Scripted("edge", ["x"])
    with pytest.raises(BackendError, match="broke"):
        list(FailoverStream([_attempt("cloud", cloud), _attempt("edge", edge)], REQUEST,
                            RouteInfo(target="cloud", backend=""), mid_stream=False))
    assert edge.requests == []
    crash = Scripted("edge", [], RuntimeError("segfault-ish"))
    with pytest.raises(BackendError, match="RuntimeError: segfault-ish"):  # raw errors come out typed
        list(FailoverStream([_attempt("edge", crash)], REQUEST, RouteInfo(target="edge", backend="")))
    auth = Scripted("cloud", [], AuthenticationError("bad key"))
    with pytest.raises(AuthenticationError):
        list(FailoverStream([_attempt("cloud", auth), _attempt("edge", edge)], REQUEST,
                            RouteInfo(target="cloud", backend="")))
    assert edge.requests == []


def test_mid_stream_skips_a_backend_that_cannot_continue() -> None:
    class Restarts(Scripted):
        supports_continuation = False

    cloud = Scripted("cloud", ["Once"], BackendError("cut off", cause="disconnected"))
    fresh_only = Restarts("edge-a", ["Once upon a time."])
    edge = Scripted("edge-b", [" upon a time."])
    route = RouteInfo(target="cloud", backend="")
    stream = FailoverStream([_attempt("cloud", cloud), _attempt("edge", fresh_only), _attempt("edge", edge)],
                            REQUEST, route)
    assert "".join(c.text for c in stream) == "Once upon a time."
    assert fresh_only.requests == [] and stream.skipped == ["edge-a: cannot continue a partial answer"]
    # before any text it is a fine first choice
    dead = Scripted("cloud", [], BackendError("refused", cause="connect"))
    assert "".join(c.text for c in FailoverStream([_attempt("cloud", dead), _attempt("edge", fresh_only)], REQUEST,
                                                  RouteInfo(target="cloud", backend=""))) == "Once upon a time."


def test_open_circuit_is_skipped_and_all_skipped_is_a_clear_error() -> None:
    edge = Scripted("edge", ["ok"])
    dead = _attempt("cloud", Scripted("cloud", [], BackendUnavailableError("cannot connect")), threshold=1)
    dead.breaker.failure()
    chunks = list(FailoverStream([dead, _attempt("edge", edge)], REQUEST, RouteInfo(target="cloud", backend="")))
    assert "".join(c.text for c in chunks) == "ok"
    with pytest.raises(BackendUnavailableError, match="circuit open"):
        list(FailoverStream([dead], REQUEST, RouteInfo(target="cloud", backend="")))


# ------------------------------------------------------------------ PII and prefill


def test_streaming_restore_handles_placeholders_split_across_chunks() -> None:
    texts, redaction = redact(["Mail ann@example.com and bob@example.org, card 4111 1111 1111 1111."])
    assert "ann@example.com" not in texts[0]
    answer = "Sent to [EMAIL_1] and [EMAIL_2]; [CARD_1] charged. [note]"
    for size in (1, 2, 3, 7):
        restore = StreamingRestore(redaction)
        pieces = [answer[i : i + size] for i in range(0, len(answer), size)]
        out = "".join(restore.push(p) for p in pieces) + restore.flush()
        assert out == redaction.restore(answer)
        assert "ann@example.com" in out and "[note]" in out


def test_continue_final_message_prompt_and_validation() -> None:
    template = ChatTemplate(None)  # ChatML
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, wor"}]
    prompt = template.prompt(messages, continue_final=True)
    assert prompt.endswith("<|im_start|>assistant\nHello, wor")
    assert template.prompt(messages[:1]).endswith("<|im_start|>assistant\n")
    with pytest.raises(InvalidRequestError, match="assistant message last"):
        template.prompt(messages[:1], continue_final=True)
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        ChatRequest(messages=messages[:1], continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):
        ChatRequest(messages=messages, continue_final_message=True, add_generation_prompt=True)
