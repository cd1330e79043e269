"""The hybrid client under faults: real ``edgecloud serve`` processes on 127.0.0.1, the real
llama.cpp edge, and a scripted HTTP server only where a fault cannot be produced otherwise
(stalls, junk events, 503/429 sequences). Fakes appear only to inject an edge failure."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from edgecloud import AsyncEdgeCloud, EdgeCloud
from edgecloud.backend import Backend
from edgecloud.remote.client import CloudBackend
from edgecloud.edge.llamacpp import LlamaCppBackend
from edgecloud.errors import BackendError, EdgeCloudError, InvalidRequestError, PrivacyViolationError
from edgecloud.router.policy import RoutePolicy
from edgecloud.types import ChatCompletionChunk, ChatRequest, collect_chunks
from faults import USAGE, BreaksAfter, ScriptedServer, ServeProcess, event, free_port, json_reply, sse_reply

KEY = "sk-test"
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
HELLO = [{"role": "user", "content": "Say hello."}]
CLOUD_MODEL = "smollm2-135m-instruct-q4"  # the name edgecloud serve gives the file
# plain routing and failover (token mode has its own fault tests: test_collab.py)
FAST = {"fallback": {"max_retries": 0, "timeout_s": 20, "connect_timeout_s": 2}, "collab": {"mode": "off"}}


class Fixed:
    """A scorer that always says the same thing (so a test can choose the first side)."""

    def __init__(self, value: float) -> None:
        self.value, self.name = value, f"fixed-{value}"

    def score(self, request: Any) -> float:
        return self.value


CLOUD_FIRST = Fixed(1.0)
EDGE_FIRST = Fixed(0.0)


@pytest.fixture(scope="module")
def edge(smollm2_path: Path) -> Iterator[LlamaCppBackend]:
    with LlamaCppBackend(str(smollm2_path), n_ctx=1024) as backend:
        yield backend


@pytest.fixture()
def scripted() -> Iterator[ScriptedServer]:
    srv = ScriptedServer()
    yield srv
    srv.close()


def client_for(edge: Backend | None, url: str | list[str], first: Fixed = CLOUD_FIRST, **config: Any) -> EdgeCloud:
    settings = {**FAST, **config}
    return EdgeCloud(edge_model=None, edge_backend=edge, cloud_base_url=url, cloud_model=CLOUD_MODEL, cloud_api_key=KEY,
                     config=settings, policy=RoutePolicy(scorer=first))


def greedy_continuation(backend: Backend, messages: list[dict[str, str]], partial: str, max_tokens: int) -> str:
    request = ChatRequest(messages=[*messages, {"role": "assistant", "content": partial}],
                          continue_final_message=True, max_tokens=max_tokens, temperature=0)
    return backend.complete(request).text


# ------------------------------------------------------------------ mid-stream


def test_cloud_killed_mid_stream_the_edge_continues(edge: LlamaCppBackend, smollm2_path: Path) -> None:
    proc = ServeProcess(str(smollm2_path), api_key=KEY).start()
    try:
        with client_for(edge, proc.url) as client:
            stream = client.chat.completions.create(messages=STORY, stream=True, max_tokens=60, temperature=0)
            chunks: list[ChatCompletionChunk] = []
            for chunk in stream:
                chunks.append(chunk)
                if sum(bool(c.text) for c in chunks) == 8 and proc.proc.poll() is None:
                    proc.kill()
    finally:
        proc.stop()
    text = "".join(c.text for c in chunks)
    last = chunks[-1]
    assert last.route is not None and last.route.target == "edge"
    [switch] = last.route.fallbacks
    assert (switch["from"], switch["to"]) == ("cloud", "edge")
    assert switch["cause"] == "disconnected", switch["error"]
    at = switch["at_chars"]
    assert 0 < at < len(text)
    # what the caller got after the break is exactly the edge's greedy continuation of what it had
    expected = greedy_continuation(edge, STORY, text[:at], 60 - switch["at_tokens"])
    assert text[at:] == expected
    assert sum(c.choices[0].finish_reason is not None for c in chunks if c.choices) == 1
    assert all(c.route is not None for c in chunks)
    assert last.usage is not None and last.usage.completion_tokens > switch["at_tokens"]
    assert last.cost is not None and last.cost.edge_seconds > 0 and last.cost.cloud_output_tokens >= 1
    assert len({c.id for c in chunks}) == 1  # one stream, one id


def test_edge_failing_mid_stream_the_cloud_continues(edge: LlamaCppBackend, server: ServeProcess) -> None:
    with client_for(BreaksAfter(edge, 5), server.url, first=EDGE_FIRST) as client:
        answer = client.chat.completions.create(messages=STORY, max_tokens=40, temperature=0)
    [switch] = answer.route.fallbacks
    assert (switch["from"], switch["to"], switch["cause"]) == ("edge", "cloud", "runtime_error")
    at = switch["at_chars"]
    with CloudBackend(server.url, CLOUD_MODEL, api_key=KEY) as cloud:
        expected = greedy_continuation(cloud, STORY, answer.text[:at], 40 - switch["at_tokens"])
    assert answer.text[at:] == expected and at > 0


# ------------------------------------------------------------------ cloud faults


def test_cloud_down_at_start_the_edge_answers(edge: LlamaCppBackend) -> None:
    with client_for(edge, f"http://127.0.0.1:{free_port()}") as client:
        answer = client.chat.completions.create(messages=HELLO, max_tokens=8, temperature=0)
    assert answer.route.target == "edge" and answer.text
    assert answer.route.fallbacks[0]["cause"] == "connect"


def test_cloud_stalling_past_the_read_timeout(edge: LlamaCppBackend, scripted: ScriptedServer) -> None:
    scripted.script(sse_reply(event(), event("Hello"), stall=6))
    with client_for(edge, scripted.url, fallback={"max_retries": 0, "timeout_s": 1}) as client:
        answer = client.chat.completions.create(messages=HELLO, max_tokens=12, temperature=0)
    assert answer.text.startswith("Hello") and len(answer.text) > len("Hello")
    assert answer.route.fallbacks[0]["cause"] == "timeout" and answer.route.fallbacks[0]["at_chars"] == 5
    assert answer.route.target == "edge"


def test_cloud_503_then_200_is_retried_on_the_cloud(edge: LlamaCppBackend, scripted: ScriptedServer) -> None:
    scripted.script(json_reply(503, {"error": {"message": "warming up"}}), sse_reply(event(), event("Hi!", "stop")))
    with client_for(edge, scripted.url, fallback={"max_retries": 2, "backoff_s": 0.05}) as client:
        answer = client.chat.completions.create(messages=HELLO, max_tokens=8)
    assert answer.text == "Hi!" and answer.route.target == "cloud" and answer.route.fallbacks == []
    assert len(scripted.hits) == 2


def test_cloud_malformed_event_the_edge_answers(edge: LlamaCppBackend, scripted: ScriptedServer) -> None:
    scripted.script(sse_reply(event(), "data: {not json\n\n"))
    with client_for(edge, scripted.url) as client:
        answer = client.chat.completions.create(messages=HELLO, max_tokens=8, temperature=0)
    assert answer.route.target == "edge" and answer.text
    assert answer.route.fallbacks[0]["cause"] == "malformed_stream"


def test_cloud_429_short_wait_is_retried_long_wait_goes_to_the_edge(
    edge: LlamaCppBackend, scripted: ScriptedServer
) -> None:
    scripted.script(json_reply(429, {"error": {"message": "slow down"}}, {"Retry-After": "0.2"}),
                    sse_reply(event(), event("Hi!", "stop")))
    with client_for(edge, scripted.url, fallback={"max_retries": 1}) as client:
        assert client.chat.completions.create(messages=HELLO, max_tokens=8).route.target == "cloud"
        scripted.script(json_reply(429, {"error": {"message": "quota"}}, {"Retry-After": "3600"}))
        answer = client.chat.completions.create(messages=HELLO, max_tokens=8, temperature=0)
    assert answer.route.target == "edge"
    assert answer.route.fallbacks[0]["cause"] == "rate_limited", answer.route.fallbacks


def test_several_cloud_urls_are_tried_in_order(edge: LlamaCppBackend, scripted: ScriptedServer) -> None:
    scripted.script(sse_reply(event(), event("Second!", "stop")))
    with client_for(edge, [f"http://127.0.0.1:{free_port()}", scripted.url]) as client:
        answer = client.chat.completions.create(messages=HELLO, max_tokens=8)
    assert answer.text == "Second!" and answer.route.target == "cloud"
    assert [(f["from"], f["to"], f["cause"]) for f in answer.route.fallbacks] == [("cloud", "cloud", "connect")]


# ------------------------------------------------------------------ edge faults


@pytest.mark.parametrize("broken", ["missing", "corrupt"])
def test_edge_model_missing_or_corrupt_the_cloud_answers(server: ServeProcess, tmp_path: Path, broken: str) -> None:
    path = tmp_path / "model.gguf"
    if broken == "corrupt":
        path.write_bytes(b"GGUF" + b"\x00" * 4096)
    with EdgeCloud(edge_model=str(path), cloud_base_url=server.url, cloud_model=CLOUD_MODEL, cloud_api_key=KEY,
                   config=FAST, policy=RoutePolicy(scorer=EDGE_FIRST)) as client:
        answer = client.chat.completions.create(messages=HELLO, max_tokens=8, temperature=0)
    assert answer.route.target == "cloud" and answer.text
    assert answer.route.fallbacks[0]["from"] == "edge" and answer.route.fallbacks[0]["cause"] == "load_error"


# ------------------------------------------------------------------ health


def test_circuit_opens_skips_the_dead_cloud_and_closes_after_recovery(edge: LlamaCppBackend) -> None:
    port = free_port()
    config = {"fallback": {"max_retries": 0, "failure_threshold": 2, "cooldown_s": 1.0, "connect_timeout_s": 1}}
    with client_for(edge, f"http://127.0.0.1:{port}", **config) as client:
        for _ in range(2):
            answer = client.chat.completions.create(messages=HELLO, max_tokens=4, temperature=0)
            assert answer.route.fallbacks[0]["cause"] == "connect"
        assert client.stats()["circuits"][f"http://127.0.0.1:{port}/v1"] == "open"
        skipped = client.chat.completions.create(messages=HELLO, max_tokens=4, temperature=0)
        assert skipped.route.target == "edge" and skipped.route.fallbacks == []
        assert skipped.route.noted("unavailable") is not None
        revived = ScriptedServer(port=port)
        try:
            revived.script(sse_reply(event(), event("Back!", "stop")))
            time.sleep(1.1)
            answer = client.chat.completions.create(messages=HELLO, max_tokens=4)
        finally:
            revived.close()
        assert answer.text == "Back!" and answer.route.target == "cloud"
        assert client.stats()["circuits"][f"http://127.0.0.1:{port}/v1"] == "closed"


def test_concurrent_requests_with_the_cloud_flapping(edge: LlamaCppBackend, smollm2_path: Path) -> None:
    proc = ServeProcess(str(smollm2_path), api_key=KEY).start()
    outcomes: list[Any] = []

    def flap() -> None:
        for _ in range(2):
            time.sleep(1.5)
            proc.kill()
            time.sleep(1.0)
            proc.start()

    async def one(client: AsyncEdgeCloud, i: int) -> Any:
        messages = [{"role": "user", "content": f"Count from {i} to {i + 5}."}]
        try:
            if i % 2:
                stream = await client.chat.completions.create(messages=messages, max_tokens=16, stream=True)
                chunks = [c async for c in stream]
                finishes = sum(1 for c in chunks for ch in c.choices if ch.finish_reason is not None)
                return ("ok", collect_chunks(chunks), finishes)
            return ("ok", await client.chat.completions.create(messages=messages, max_tokens=16), 1)
        except EdgeCloudError as exc:
            return ("error", exc, 0)

    async def main() -> None:
        settings = {"fallback": {"max_retries": 1, "backoff_s": 0.05, "timeout_s": 30, "failure_threshold": 3,
                                 "cooldown_s": 0.5}}
        async with AsyncEdgeCloud(edge_model=None, edge_backend=edge, cloud_base_url=proc.url, cloud_model=CLOUD_MODEL,
                                  cloud_api_key=KEY, config=settings, policy=RoutePolicy(scorer=CLOUD_FIRST)) as client:
            results = await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), timeout=400)
            outcomes.extend(results)

    flapper = threading.Thread(target=flap)
    flapper.start()
    try:
        asyncio.run(main())
    finally:
        flapper.join()
        proc.stop()
    assert len(outcomes) == 32
    answers = [o for o in outcomes if o[0] == "ok"]
    assert all(o[2] == 1 for o in answers)  # exactly one finish per answer: nobody answered twice
    assert all(o[1].text and o[1].route is not None for o in answers)
    assert len({o[1].id for o in answers}) == len(answers)
    assert all(isinstance(o[1], EdgeCloudError) for o in outcomes if o[0] == "error")
    assert len(answers) >= 30  # the edge covers the cloud's outages


# ------------------------------------------------------------------ conflicts and privacy


def test_conflicting_settings_are_refused_before_any_backend_runs(edge: LlamaCppBackend) -> None:
    with EdgeCloud(edge_model=None, edge_backend=edge) as client:
        with pytest.raises(InvalidRequestError, match="no cloud endpoint"):
            client.chat.completions.create(messages=HELLO, route="cloud")
        with pytest.raises(InvalidRequestError, match="route"):
            client.chat.completions.create(messages=HELLO, route="sideways")
        answer = client.chat.completions.create(messages=HELLO, max_tokens=4)
        assert answer.route.reason == "edge only: no cloud endpoint configured"
    with client_for(edge, f"http://127.0.0.1:{free_port()}") as client:
        with pytest.raises(InvalidRequestError, match="local_only"):
            client.chat.completions.create(messages=HELLO, route="cloud", privacy="local_only")
    with EdgeCloud(edge_model=None, cloud_base_url=f"http://127.0.0.1:{free_port()}", cloud_model="m") as client:
        with pytest.raises(InvalidRequestError, match="no edge model"):
            client.chat.completions.create(messages=HELLO, route="edge")
        with pytest.raises(PrivacyViolationError):
            client.chat.completions.create(messages=HELLO, privacy="local_only")


def test_pii_never_reaches_a_failing_edge_s_cloud(edge: LlamaCppBackend, scripted: ScriptedServer) -> None:
    scripted.script(sse_reply(event(), event("cloud!", "stop")))
    message = [{"role": "user", "content": "Email jane.roe@example.org the invoice."}]
    with client_for(BreaksAfter(edge, 0), scripted.url, first=CLOUD_FIRST) as client:
        with pytest.raises(EdgeCloudError):
            client.chat.completions.create(messages=message, max_tokens=8)
    assert scripted.hits == []  # the cloud never saw the request


# ------------------------------------------------------------------ metrics and traces


def test_metrics_and_spans_tell_what_happened(edge: LlamaCppBackend, scripted: ScriptedServer) -> None:
    import urllib.request

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from prometheus_client.parser import text_string_to_metric_families

    from edgecloud.observability.client_metrics import start_metrics_server

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    scripted.script(sse_reply(event(), "data: {junk\n\n"), sse_reply(event(), event("Hi!", "stop"), USAGE))
    with EdgeCloud(edge_model=None, edge_backend=edge, cloud_base_url=scripted.url, cloud_model=CLOUD_MODEL,
                   config={**FAST, "prices": {"cloud_input_per_mtok": 1.0, "cloud_output_per_mtok": 2.0,
                                              "cloud_cached_input_share": 0.5}},
                   policy=RoutePolicy(scorer=CLOUD_FIRST), tracer_provider=provider) as client:
        fell = client.chat.completions.create(messages=HELLO, max_tokens=6, temperature=0)  # junk → edge
        cloud = client.chat.completions.create(messages=HELLO, max_tokens=6)  # the cloud answers
        with start_metrics_server(port=0, metrics=client.metrics) as server:
            body = urllib.request.urlopen(f"{server.url}", timeout=10).read().decode()
        stats = client.stats()
    assert fell.route.target == "edge" and cloud.route.target == "cloud"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body) for s in family.samples}
    assert samples[("edgecloud:route_decisions_total", (("reason", "score"), ("target", "cloud")))] == 2
    assert samples[("edgecloud:fallbacks_total", (("cause", "malformed_stream"), ("from", "cloud"), ("to", "edge")))] == 1
    assert samples[("edgecloud:client_requests_total", (("outcome", "ok"), ("target", "edge")))] == 1
    assert samples[("edgecloud:client_requests_total", (("outcome", "ok"), ("target", "cloud")))] == 1
    # the cloud answer: 5 prompt tokens (3 of them read from its cache at half price) + 2 completion
    # tokens, at $1 / $2 per million
    assert cloud.cost is not None and cloud.cost.usd == pytest.approx(2e-6 + 1.5e-6 + 4e-6)
    assert fell.cost is not None and fell.cost.usd == 0.0 and fell.cost.saved_usd > 0
    assert stats["requests"] == 2 and stats["fallbacks"] == 1 and stats["cost_usd"] == pytest.approx(7.5e-6)
    spans = exporter.get_finished_spans()
    assert len(spans) == 2
    first = spans[0]
    assert first.attributes["gen_ai.operation.name"] == "chat"
    assert first.attributes["gen_ai.request.max_tokens"] == 6
    assert first.attributes["edgecloud.route.target"] == "edge"
    assert first.attributes["gen_ai.usage.output_tokens"] == fell.usage.completion_tokens
    assert [e.name for e in first.events if e.name == "edgecloud.fallback"] == ["edgecloud.fallback"]
    assert spans[1].attributes["gen_ai.usage.input_tokens"] == 5


def test_a_stream_the_caller_closes_early_counts_as_cancelled(edge: LlamaCppBackend, scripted: ScriptedServer) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with client_for(edge, scripted.url, first=EDGE_FIRST) as client:
        stream = client.chat.completions.create(messages=HELLO, max_tokens=12, temperature=0, stream=True)
        assert next(stream).choices is not None  # one chunk read, then the caller walks away
        stream.close()
        client.chat.completions.create(messages=HELLO, max_tokens=4, temperature=0)
        body = client.metrics.render().decode()
        stats = client.stats()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body) for s in family.samples}
    assert samples[("edgecloud:client_requests_total", (("outcome", "cancelled"), ("target", "edge")))] == 1
    assert samples[("edgecloud:client_requests_total", (("outcome", "error"), ("target", "edge")))] == 0
    assert samples[("edgecloud:client_requests_total", (("outcome", "ok"), ("target", "edge")))] == 1
    assert stats["requests"] == 1  # totals count finished answers only
    assert scripted.hits == []  # closing is not a failure: nothing fell back to the cloud
