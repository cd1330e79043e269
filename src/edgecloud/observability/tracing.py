"""OpenTelemetry spans for chat requests, following the GenAI semantic conventions.

This module owns :func:`chat_span` and :class:`ChatSpan`. One span per request, named
``chat {model}``, kind ``CLIENT``, with the ``gen_ai.*`` request and response attributes,
plus edgecloud's own: ``edgecloud.route.*`` (where it ran and why), an ``edgecloud.fallback``
event per switch of side, ``edgecloud.fallbacks`` (their count), ``edgecloud.cost.usd`` and
``edgecloud.ttft_s``.

OpenTelemetry is optional: it is imported when a span starts, not when edgecloud is
imported, and without it :func:`chat_span` yields a :class:`ChatSpan` whose methods do
nothing. Without a configured provider the OpenTelemetry API itself records nothing, so
leaving tracing on costs next to nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..types import ChatRequest, CostInfo, Usage

__all__ = ["ChatSpan", "chat_span"]

PROVIDER = "edgecloud"


def _set(span: Any, attributes: dict[str, Any]) -> None:
    # OpenTelemetry rejects None values (with a warning); an unknown value is simply absent.
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(key, value)


class ChatSpan:
    """What a request adds to its span as it runs; every method is a no-op without a span."""

    def __init__(self, span: Any = None) -> None:
        self.span = span
        self.fallbacks = 0

    def set_route(self, target: str, backend: str, reason: str, score: float | None) -> None:
        """Where the request runs (``target`` edge/cloud, ``backend`` name) and why."""
        if self.span is not None:
            _set(self.span, {
                "edgecloud.route.target": target,
                "edgecloud.route.backend": backend or None,
                "edgecloud.route.reason": reason or None,
                "edgecloud.route.score": score,
            })

    def add_fallback(self, from_: str, to: str, cause: str, at_chars: int) -> None:
        """The request switched side after ``at_chars`` characters of answer (0: before any)."""
        self.fallbacks += 1
        if self.span is not None:
            self.span.add_event("edgecloud.fallback", {
                "edgecloud.fallback.from": from_,
                "edgecloud.fallback.to": to,
                "edgecloud.fallback.cause": cause,
                "edgecloud.fallback.at_chars": at_chars,
            })
            self.span.set_attribute("edgecloud.fallbacks", self.fallbacks)

    def add_span_event(self, mode: str, outcome: str, cloud_tokens: int, seconds: float) -> None:
        """One cloud request inside a collaborative answer (a token-mode span, a verified round)."""
        if self.span is not None:
            self.span.add_event("edgecloud.collab.span", {
                "edgecloud.collab.mode": mode,
                "edgecloud.collab.outcome": outcome,
                "edgecloud.collab.cloud_tokens": cloud_tokens,
                "edgecloud.collab.seconds": seconds,
            })

    def ttft(self, seconds: float) -> None:
        """The first token arrived ``seconds`` after the request started."""
        if self.span is not None:
            self.span.set_attribute("edgecloud.ttft_s", seconds)
            self.span.add_event("gen_ai.first_token", {"edgecloud.ttft_s": seconds})

    def set_response(
        self,
        *,
        model: str | None,
        response_id: str | None,
        finish_reason: str | None,
        usage: Usage | None,
        cost: CostInfo | None,
    ) -> None:
        """What came back: model, id, finish reason, token counts and cost."""
        if self.span is None:
            return
        _set(self.span, {
            "gen_ai.response.model": model,
            "gen_ai.response.id": response_id,
            "gen_ai.response.finish_reasons": [finish_reason] if finish_reason else None,
            "gen_ai.usage.input_tokens": usage.prompt_tokens if usage is not None else None,
            "gen_ai.usage.output_tokens": usage.completion_tokens if usage is not None else None,
            "edgecloud.cost.usd": cost.usd if cost is not None else None,
            "edgecloud.cost.saved_usd": cost.saved_usd if cost is not None else None,
        })


def _tracer(tracer_provider: Any) -> Any:
    """A tracer, or None when OpenTelemetry is not installed."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    from .._version import __version__

    if tracer_provider is not None:
        return tracer_provider.get_tracer("edgecloud", __version__)
    return trace.get_tracer("edgecloud", __version__)


@contextmanager
def chat_span(
    *,
    request_model: str | None,
    server_address: str | None = None,
    request: ChatRequest | None = None,
    tracer_provider: Any = None,
) -> Iterator[ChatSpan]:
    """A ``chat {request_model}`` CLIENT span around one request, current while the block runs.

    ``tracer_provider`` defaults to OpenTelemetry's global one. An exception leaving the
    block is recorded on the span (status ERROR, ``error.type`` = its class name) and
    re-raised; a generator closed early (``GeneratorExit``) marks ``edgecloud.cancelled``
    instead, since a caller that stops reading is not an error.
    """
    tracer = _tracer(tracer_provider)
    if tracer is None:
        yield ChatSpan()
        return
    from opentelemetry.trace import SpanKind, Status, StatusCode

    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.system": PROVIDER,  # the name before semantic conventions 1.37
        "gen_ai.request.model": request_model,
        "server.address": server_address,
    }
    if request is not None:
        attributes.update({
            "gen_ai.request.max_tokens": request.max_tokens,
            "gen_ai.request.temperature": request.temperature,
            "gen_ai.request.top_p": request.top_p,
        })
    with tracer.start_as_current_span(
        f"chat {request_model}" if request_model else "chat",
        kind=SpanKind.CLIENT,
        attributes={k: v for k, v in attributes.items() if v is not None},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield ChatSpan(span)
        except GeneratorExit:
            span.set_attribute("edgecloud.cancelled", True)
            raise
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            span.set_attribute("error.type", type(exc).__name__)
            raise
