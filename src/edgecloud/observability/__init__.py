"""Observability: Prometheus metrics, OpenTelemetry spans, and what requests cost.

* :class:`ServerMetrics` is what ``edgecloud serve`` exposes on ``GET /metrics``: vLLM's metric
  names with an ``edgecloud:`` prefix, so dashboards built for vLLM read it unchanged.
* :class:`ClientMetrics` counts the client's routing decisions, fallbacks, latency, tokens and
  cost per side; :func:`start_metrics_server` serves it.
* :func:`chat_span` wraps a request in a GenAI-convention OpenTelemetry span (a no-op without
  OpenTelemetry, which is imported only when a span starts).
* :class:`CostModel` prices a request at the configured prices; :class:`CostTotals` sums them.
"""

from __future__ import annotations

from .client_metrics import ClientMetrics, MetricsServer, start_metrics_server
from .cost import CostModel, CostTotals
from .server_metrics import ServerMetrics
from .tracing import ChatSpan, chat_span

__all__ = [
    "ChatSpan",
    "ClientMetrics",
    "CostModel",
    "CostTotals",
    "MetricsServer",
    "ServerMetrics",
    "chat_span",
    "start_metrics_server",
]
