"""chat_span: GenAI-convention spans on an explicit in-memory provider, the error path, and no OpenTelemetry."""

from __future__ import annotations

import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from edgecloud.observability.tracing import ChatSpan, chat_span
from edgecloud.types import ChatRequest, CostInfo, Usage


@pytest.fixture()
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture()
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def request() -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=64, temperature=0.2, top_p=0.9)


def test_span_carries_request_route_fallback_and_response(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    with chat_span(request_model="qwen-0.5b", server_address="api.example.com", request=request(),
                   tracer_provider=provider) as span:
        span.set_route("cloud", "cloud:api.example.com", "score 0.91 > 0.7", 0.91)
        span.ttft(0.125)
        span.add_fallback("cloud", "edge", "timeout", 42)
        span.set_response(model="qwen-0.5b", response_id="chatcmpl-1", finish_reason="stop",
                          usage=Usage(prompt_tokens=12, completion_tokens=34), cost=CostInfo(usd=0.00001, saved_usd=0.00002))
    (done,) = exporter.get_finished_spans()
    assert done.name == "chat qwen-0.5b" and done.kind is SpanKind.CLIENT
    assert done.instrumentation_scope.name == "edgecloud"
    attrs = dict(done.attributes)
    assert attrs == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "edgecloud", "gen_ai.system": "edgecloud",
        "gen_ai.request.model": "qwen-0.5b", "server.address": "api.example.com",
        "gen_ai.request.max_tokens": 64, "gen_ai.request.temperature": 0.2, "gen_ai.request.top_p": 0.9,
        "edgecloud.route.target": "cloud", "edgecloud.route.backend": "cloud:api.example.com",
        "edgecloud.route.reason": "score 0.91 > 0.7", "edgecloud.route.score": 0.91,
        "edgecloud.ttft_s": 0.125, "edgecloud.fallbacks": 1,
        "gen_ai.response.model": "qwen-0.5b", "gen_ai.response.id": "chatcmpl-1",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 34,
        "edgecloud.cost.usd": 0.00001, "edgecloud.cost.saved_usd": 0.00002,
    }
    events = {e.name: dict(e.attributes) for e in done.events}
    assert events["edgecloud.fallback"] == {
        "edgecloud.fallback.from": "cloud", "edgecloud.fallback.to": "edge",
        "edgecloud.fallback.cause": "timeout", "edgecloud.fallback.at_chars": 42,
    }
    assert events["gen_ai.first_token"] == {"edgecloud.ttft_s": 0.125}
    assert done.status.status_code is StatusCode.UNSET


def test_unknown_values_are_left_out(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    with chat_span(request_model=None, tracer_provider=provider) as span:
        span.add_fallback("edge", "cloud", "runtime_error", 0)
        span.add_fallback("cloud", "edge", "server_error", 0)
        span.set_response(model=None, response_id=None, finish_reason=None, usage=None, cost=None)
    (done,) = exporter.get_finished_spans()
    assert done.name == "chat"
    assert "gen_ai.request.model" not in done.attributes and "gen_ai.response.finish_reasons" not in done.attributes
    assert done.attributes["edgecloud.fallbacks"] == 2


def test_exception_is_recorded_and_reraised(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    with pytest.raises(TimeoutError, match="read timed out"):
        with chat_span(request_model="m", tracer_provider=provider):
            raise TimeoutError("read timed out")
    (done,) = exporter.get_finished_spans()
    assert done.status.status_code is StatusCode.ERROR
    assert done.attributes["error.type"] == "TimeoutError"
    (event,) = done.events
    assert event.name == "exception" and event.attributes["exception.type"] == "TimeoutError"


def test_closing_a_stream_early_is_not_an_error(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    def stream():
        with chat_span(request_model="m", tracer_provider=provider):
            yield 1
            yield 2

    chunks = stream()
    next(chunks)
    chunks.close()
    (done,) = exporter.get_finished_spans()
    assert done.status.status_code is StatusCode.UNSET and done.attributes["edgecloud.cancelled"] is True


def test_without_opentelemetry_the_span_is_a_no_op(monkeypatch: pytest.MonkeyPatch, provider: TracerProvider,
                                                   exporter: InMemorySpanExporter) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # makes `import opentelemetry...` raise ImportError
    with chat_span(request_model="m", request=request(), tracer_provider=provider) as span:
        assert isinstance(span, ChatSpan) and span.span is None
        span.set_route("edge", "llama.cpp", "score", 0.1)
        span.add_fallback("edge", "cloud", "runtime_error", 3)
        span.ttft(0.1)
        span.set_response(model="m", response_id="x", finish_reason="stop", usage=None, cost=None)
    assert span.fallbacks == 1
    assert exporter.get_finished_spans() == ()
    with pytest.raises(KeyError):  # errors still propagate
        with chat_span(request_model="m"):
            raise KeyError("k")
