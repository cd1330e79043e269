"""Token-level collaboration end to end: a real llama.cpp edge and a real ``edgecloud serve`` cloud.

Token mode (spans where the gate fires, pinned by the gate's threshold: 0 hands every token to
the cloud, 1 none), verified mode (the greedy text is the cloud's, also when the drafts are
wrong), privacy pins, span faults (a stalled cloud, 429, 401), an edge failing mid-answer, the
latency proxy, metrics, and the request's bad values.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from edgecloud import AsyncEdgeCloud, EdgeCloud
from edgecloud.backend import Backend
from edgecloud.errors import BackendError, ConfigError, InvalidRequestError
from edgecloud.testing import LatencyProxy
from edgecloud.types import ChatCompletionChunk, ChatRequest
from faults import ScriptedServer, ServeProcess, json_reply, sse_reply

KEY = "sk-test"
MODEL = "smollm2-135m-instruct-q4"  # the name the integration server serves
QUESTION = [{"role": "user", "content": "List three colours of the rainbow, one per line."}]


@pytest.fixture(scope="module")
def edge(smollm2_path: Path) -> Iterator[Backend]:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(smollm2_path), n_ctx=1024) as backend:
        yield backend


def client(edge: Backend, url: str, model: str, **collab: Any) -> EdgeCloud:
    config = {"collab": collab, "fallback": {"max_retries": 0, "timeout_s": 20}}
    return EdgeCloud(edge_backend=edge, cloud_base_url=url, cloud_model=model, cloud_api_key=KEY, config=config)


def run(c: EdgeCloud, **params: Any) -> tuple[str, list[ChatCompletionChunk]]:
    chunks = list(c.chat.completions.create(messages=params.pop("messages", QUESTION), max_tokens=params.pop("max_tokens", 40),
                                            temperature=0, stream=True, **params))
    return "".join(ch.text for ch in chunks), chunks


def sides(chunks: list[ChatCompletionChunk]) -> set[str]:
    return {ch.route.target for ch in chunks if ch.text and ch.route is not None}


def test_gate_that_never_fires_leaves_the_answer_to_the_edge(edge: Backend, server: ServeProcess) -> None:
    with client(edge, server.url, MODEL, mode="token", gate=1.0) as c:
        text, chunks = run(c)
        alone, _ = run(c, route="edge", collab="off")
    final = chunks[-1]
    assert text == alone
    assert final.route.tokens == {"edge": final.usage.completion_tokens, "cloud": 0}
    assert final.route.cloud_calls == 0 and final.route.collab == "token"
    assert sides(chunks) == {"edge"}


def test_gate_that_always_fires_hands_spans_to_the_cloud(edge: Backend, server: ServeProcess) -> None:
    with client(edge, server.url, MODEL, mode="token", gate=0.0, span_stop="tokens", span_tokens=3) as c:
        text, chunks = run(c)
        stats = c.stats()
        metrics = c.metrics.render().decode()
    final = chunks[-1]
    assert text.strip()
    tokens = final.route.tokens
    assert tokens["cloud"] > 0 and tokens["edge"] + tokens["cloud"] == final.usage.completion_tokens
    assert final.route.cloud_calls >= 1
    assert "cloud" in sides(chunks)
    # each span is bounded: no more cloud tokens than 3 per call
    assert tokens["cloud"] <= 3 * final.route.cloud_calls
    assert final.cost is not None and final.cost.cloud_output_tokens > 0
    assert stats["cloud_answer_tokens"] == tokens["cloud"] and 0 < stats["cloud_token_share"] <= 1
    assert 'edgecloud:collab_spans_total{mode="token"' in metrics
    assert f'edgecloud:collab_tokens_total{{side="cloud"}} {float(tokens["cloud"])}' in metrics


def test_line_spans_end_with_the_line(edge: Backend, server: ServeProcess) -> None:
    # the gate fires on every edge token, so the cloud writes the whole answer, span by span
    with client(edge, server.url, MODEL, mode="token", gate=0.0, span_stop="line", span_tokens=64) as c:
        by_line, _ = run(c, max_tokens=60)
        calls_by_line = c.chat.completions.create(messages=QUESTION, max_tokens=60, temperature=0).route.cloud_calls
    with client(edge, server.url, MODEL, mode="token", gate=0.0, span_stop="tokens", span_tokens=64) as c:
        whole = c.chat.completions.create(messages=QUESTION, max_tokens=60, temperature=0)
    assert by_line.count("\n") >= 2
    # one span per line (the last one may end the answer instead), against one span for it all
    assert 2 <= calls_by_line <= by_line.count("\n") + 1
    assert whole.route.cloud_calls == 1
    # the first span is the same request either way; later line spans re-read the lines before
    # them as prompt, whose rounding in llama.cpp differs from decoding them one by one (its
    # kernels are not batch-invariant), so a 135M model's greedy text may drift after line one
    assert whole.text.split("\n")[0] == by_line.split("\n")[0]


def test_route_tokens_on_every_answer(edge: Backend, server: ServeProcess) -> None:
    with client(edge, server.url, MODEL) as c:
        for route in ("edge", "cloud"):
            answer = c.chat.completions.create(messages=QUESTION, max_tokens=12, route=route, collab="off")
            assert answer.route.tokens[route] == answer.usage.completion_tokens
            assert answer.route.tokens["cloud" if route == "edge" else "edge"] == 0
            assert answer.route.cloud_calls == (1 if route == "cloud" else 0)
        default = c.chat.completions.create(messages=QUESTION, max_tokens=12)
        assert sum(default.route.tokens.values()) == default.usage.completion_tokens
        assert default.route.collab == "verified"  # auto, and the edge started


def test_privacy_pins_never_send_a_span(edge: Backend, server: ServeProcess) -> None:
    with client(edge, server.url, MODEL, mode="token", gate=0.0) as c:
        local = c.chat.completions.create(messages=QUESTION, max_tokens=16, privacy="local_only")
        pii = c.chat.completions.create(
            messages=[{"role": "user", "content": "Write one line to jane.doe@example.com about colours."}], max_tokens=16)
    for answer in (local, pii):
        assert answer.route.cloud_calls == 0 and answer.route.tokens["cloud"] == 0
        assert answer.route.collab == "off"


class Recording(Backend):
    """A real cloud backend whose requests are kept, to see what left the device."""

    target = "cloud"
    supports_logprobs = True

    def __init__(self, inner: Backend) -> None:
        self.inner, self.sent = inner, []
        self.name, self.model_name, self.base_url = inner.name, inner.model_name, inner.base_url  # type: ignore[misc]

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        self.sent.append(request)
        return self.inner.stream(request)


def test_redacted_spans_carry_placeholders_and_restore_the_text(edge: Backend, server: ServeProcess) -> None:
    from edgecloud.remote.client import CloudBackend

    with CloudBackend(server.url, MODEL, api_key=KEY) as real:
        cloud = Recording(real)
        config = {"collab": {"mode": "token", "gate": 0.0, "span_stop": "tokens", "span_tokens": 2},
                  "router": {"pii": "redact"}}
        with EdgeCloud(edge_backend=edge, cloud_backends=[cloud], cloud_model=MODEL, config=config) as c:
            text, chunks = run(c, messages=[{"role": "user", "content": "Repeat this address: jane.doe@example.com"}],
                               max_tokens=24)
    assert cloud.sent, "no span was sent"
    for request in cloud.sent:
        assert all("jane.doe@example.com" not in m.content for m in request.messages)
    assert chunks[-1].route.tokens["cloud"] > 0


def test_verified_text_is_the_clouds_greedy_text_even_with_wrong_drafts(edge: Backend, server: ServeProcess) -> None:
    class WrongDrafts:
        """Fault injection: every third drafted token is replaced by another one."""

        def __init__(self, inner: Any) -> None:
            self.inner, self.calls = inner, 0

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def draft(self, tokens: list[int], k: int, picker: Any = None, **kw: Any) -> list[int]:
            out = self.inner.draft(tokens, k, picker, **kw)
            return [t if (i + 1) % 3 else (t + 1) % 1000 for i, t in enumerate(out)]

    with client(edge, server.url, MODEL) as c:
        cloud_text, _ = run(c, route="cloud", collab="off", max_tokens=32)
        verified_text, chunks = run(c, collab="verified", max_tokens=32)
        c.hybrid._edge = WrongDrafts(edge)  # type: ignore[assignment]
        corrected_text, corrected = run(c, collab="verified", max_tokens=32)
        c.hybrid._edge = edge
    assert verified_text == cloud_text
    assert corrected_text == cloud_text
    final = corrected[-1]
    assert final.route.collab == "verified" and final.route.cloud_calls >= 1
    assert final.route.tokens["cloud"] > 0  # the corrections
    assert final.route.tokens["edge"] + final.route.tokens["cloud"] == final.usage.completion_tokens
    assert chunks[-1].route.cloud_calls < chunks[-1].usage.completion_tokens  # several tokens per cloud pass


def test_verified_against_an_endpoint_that_cannot_score_is_a_config_error(edge: Backend) -> None:
    fake = ScriptedServer()
    try:
        fake.script(json_reply(400, {"error": {"message": "echo is not supported", "type": "invalid_request_error",
                                               "param": "echo", "code": None}}))
        with client(edge, fake.url, "m") as c, pytest.raises(ConfigError, match="cannot score"):
            run(c, collab="verified")
    finally:
        fake.close()


def test_verified_refuses_a_cloud_with_another_tokenizer(edge: Backend, qwen05_path: Path) -> None:
    from faults import serving

    with serving("llamacpp", qwen05_path, n_ctx=256, api_key=KEY) as (url, _):
        with client(edge, url, "m") as c, pytest.raises(ConfigError, match="one tokenizer"):
            run(c, collab="verified")


@pytest.mark.parametrize("reply, cause", [
    (sse_reply(stall=30.0), "timeout"),
    (json_reply(429, {"error": {"message": "slow down", "type": "rate_limit", "param": None, "code": None}}),
     "rate_limited"),
])
def test_a_failing_span_leaves_the_edge_to_write_on(edge: Backend, reply: Any, cause: str) -> None:
    fake = ScriptedServer()
    try:
        fake.script(reply)
        with client(edge, fake.url, "m", mode="token", gate=0.0, span_timeout_s=1.0) as c:
            text, chunks = run(c, max_tokens=16)
            alone, _ = run(c, route="edge", collab="off", max_tokens=16)
    finally:
        fake.close()
    final = chunks[-1]
    assert text == alone  # the edge wrote every token itself
    assert final.route.tokens["cloud"] == 0
    spans = [f for f in final.route.fallbacks if f.get("during") == "span"]
    assert spans and all(f["cause"] == cause and f["from"] == "cloud" for f in spans)


@pytest.mark.parametrize("key, model", [("sk-wrong", MODEL), (KEY, "no-such-model")])  # 401, 404
def test_a_span_refused_for_the_key_or_the_model_is_raised(edge: Backend, server: ServeProcess, key: str,
                                                           model: str) -> None:
    with EdgeCloud(edge_backend=edge, cloud_base_url=server.url, cloud_model=model,
                   cloud_api_key=key, config={"collab": {"mode": "token", "gate": 0.0}}) as c:
        with pytest.raises(ConfigError, match="refused"):
            run(c)


def test_the_edge_failing_mid_answer_hands_the_rest_to_the_cloud(edge: Backend, server: ServeProcess) -> None:
    class Breaks(Backend):
        """Fault injection: the real edge stream raises after three content chunks."""

        supports_logprobs = True

        def __init__(self, inner: Backend) -> None:
            self.inner, self.name, self.model_name = inner, inner.name, inner.model_name  # type: ignore[misc]

        def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
            seen = 0
            for chunk in self.inner.stream(request):
                seen += bool(chunk.text)
                if seen > 3:
                    raise RuntimeError("the device ran out of something")
                yield chunk

    with EdgeCloud(edge_backend=Breaks(edge), cloud_base_url=server.url, cloud_model=MODEL,
                   cloud_api_key=KEY, config={"collab": {"mode": "token", "gate": 1.0}}) as c:
        text, chunks = run(c)
    final = chunks[-1]
    assert final.route.tokens["edge"] == 3 and final.route.tokens["cloud"] > 0
    assert any(f["from"] == "edge" and f["to"] == "cloud" for f in final.route.fallbacks)
    assert final.choices[0].finish_reason in ("stop", "length") and len(text) > 3


def test_token_mode_through_a_slow_network(edge: Backend, server: ServeProcess) -> None:
    with LatencyProxy(("127.0.0.1", server.port), rtt_s=0.05, jitter_s=0.01) as proxy:
        with client(edge, proxy.url, MODEL, mode="token", gate=0.0, span_stop="tokens", span_tokens=4) as c:
            text, chunks = run(c, max_tokens=24)
        assert proxy.connections >= 1
    assert text.strip() and chunks[-1].route.tokens["cloud"] > 0
    assert not chunks[-1].route.fallbacks


def test_async_token_mode(edge: Backend, server: ServeProcess) -> None:
    async def go() -> list[ChatCompletionChunk]:
        async with AsyncEdgeCloud(edge_backend=edge, cloud_base_url=server.url, cloud_model=MODEL,
                                  cloud_api_key=KEY, config={"collab": {"mode": "token", "gate": 0.0}}) as c:
            stream = await c.chat.completions.create(messages=QUESTION, max_tokens=16, temperature=0, stream=True)
            return [chunk async for chunk in stream]

    chunks = asyncio.run(go())
    assert chunks[-1].route.tokens["cloud"] > 0 and "cloud" in sides(chunks)


def test_bad_collab_values_name_the_field(edge: Backend, server: ServeProcess) -> None:
    with client(edge, server.url, MODEL) as c:
        with pytest.raises(InvalidRequestError) as info:
            c.chat.completions.create(messages=QUESTION, collab="sometimes")
    assert info.value.param == "collab"
    with pytest.raises(ConfigError, match="collab.mode"):
        EdgeCloud(edge_backend=edge, cloud_base_url=server.url, cloud_model="m", collab="always")


def test_the_edge_failing_with_no_cloud_to_finish_is_raised(edge: Backend) -> None:
    fake = ScriptedServer()
    try:
        fake.script(json_reply(503, {"error": {"message": "down", "type": "server_error", "param": None, "code": None}}))

        class Broken(Backend):
            supports_logprobs = True
            name = "broken"

            def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
                raise RuntimeError("no device")

        with EdgeCloud(edge_backend=Broken(), cloud_base_url=fake.url, cloud_model="m",
                       config={"collab": {"mode": "token"}, "fallback": {"max_retries": 0}}) as c:
            with pytest.raises(BackendError):
                run(c)
    finally:
        fake.close()


def test_structured_answers_are_written_by_one_side(edge: Backend, server: ServeProcess) -> None:
    import json

    with client(edge, server.url, MODEL, mode="token", gate=0.0) as c:
        answer = c.chat.completions.create(
            messages=[{"role": "user", "content": "Reply with a JSON object with one key, colour."}], max_tokens=60,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": {
                "type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
                "required": ["colour"], "additionalProperties": False}}})
    assert answer.route.collab == "off" and min(answer.route.tokens.values()) == 0  # one side wrote it all
    assert answer.choices[0].finish_reason == "stop" and json.loads(answer.text)["colour"] in ("red", "green", "blue")
