"""Observability: Prometheus metrics (server side today), later OpenTelemetry spans and cost.

:class:`ServerMetrics` is what ``edgecloud serve`` exposes on ``GET /metrics``: vLLM's metric
names with an ``edgecloud:`` prefix, so dashboards built for vLLM read it unchanged.
"""

from __future__ import annotations

from .server_metrics import ServerMetrics

__all__ = ["ServerMetrics"]
