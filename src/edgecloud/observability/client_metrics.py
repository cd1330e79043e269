"""The client's Prometheus metrics: routing, fallbacks, latency, tokens and cost per side.

This module owns :class:`ClientMetrics` (one private ``CollectorRegistry`` per client unless
one is passed) and :func:`start_metrics_server`, which serves it on ``GET /metrics``. Names
follow :mod:`~edgecloud.observability.server_metrics`: an ``edgecloud:`` prefix, seconds, and
``_total`` on counters; the client's own latency series add ``client_`` so they never clash
with a server's in one Prometheus.

=====================================================  =========  ===========================
name                                                   kind       labels
=====================================================  =========  ===========================
``edgecloud:route_decisions_total``                    counter    ``target``, ``reason``
``edgecloud:fallbacks_total``                          counter    ``from``, ``to``, ``cause``
``edgecloud:client_time_to_first_token_seconds``       histogram  ``target``
``edgecloud:client_e2e_request_latency_seconds``       histogram  ``target``
``edgecloud:client_requests_total``                    counter    ``target``, ``outcome``
``edgecloud:client_tokens_total``                      counter    ``target``, ``kind``
``edgecloud:client_cost_usd_total``                    counter    ``target``
``edgecloud:client_cloud_equivalent_usd_total``        counter    (none)
``edgecloud:client_saved_usd_total``                   counter    (none)
``edgecloud:kv_cache_events_total``                    counter    ``tier``, ``event``
=====================================================  =========  ===========================

``kv_cache_events_total`` counts the edge runtime's saved KV states: ``tier`` ``ram`` or
``disk``; ``event`` ``hit``, ``miss``, ``save``, ``evict`` or a fault that was recovered by
recomputing (``corrupt``, ``foreign``, ``stale``, ``read_error``, ``write_error``, ``too_large``,
``refused``).

Label values must stay few: ``reason`` and ``cause`` take a *kind* - a short snake_case word
such as ``pinned``, ``privacy``, ``pii``, ``context``, ``unavailable``, ``score``,
``cascade``, ``only_side`` (reasons) or ``connect``, ``timeout``, ``rate_limited``,
``server_error``, ``malformed_stream``, ``runtime_error``, ``context_overflow`` (every
:data:`edgecloud.errors.FAILURE_CAUSES`),
``low_confidence`` (causes) - never the free-text explanation of a route. Anything that is
not such a word is counted as ``other`` rather than creating a new series. A counter cannot
go down, so ``client_saved_usd_total`` adds positive savings only; the signed net saving is
``client_cloud_equivalent_usd_total - sum(client_cost_usd_total)``.
"""

from __future__ import annotations

import errno
import re
import threading
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server

from ..errors import ConfigError
from ..types import CostInfo, Usage
from .server_metrics import _E2E_BUCKETS, _TTFT_BUCKETS, PREFIX

__all__ = ["ClientMetrics", "MetricsServer", "start_metrics_server"]

_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")
_TARGETS = ("edge", "cloud")


def _kind(value: str) -> str:
    """``value`` if it is a short snake_case kind, else ``other`` (keeps label cardinality low)."""
    return value if _KIND.fullmatch(value) else "other"


class ClientMetrics:
    """Counters and histograms of one client's requests; ``render()`` is the ``/metrics`` body."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        target = ["target"]
        self.route_decisions = Counter(
            PREFIX + "route_decisions", "Routing decisions, by side and kind of reason.", ["target", "reason"], registry=r
        )
        self.fallbacks = Counter(
            PREFIX + "fallbacks", "Switches from one side to the other, by kind of cause.", ["from", "to", "cause"],
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "client_time_to_first_token_seconds", "Request start -> first content token, seen by the client.",
            target, buckets=_TTFT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "client_e2e_request_latency_seconds", "Request start -> last chunk, seen by the client.",
            target, buckets=_E2E_BUCKETS, registry=r,
        )
        self.requests = Counter(
            PREFIX + "client_requests", "Finished requests, by the side they ended on.", ["target", "outcome"], registry=r
        )
        self.tokens = Counter(
            PREFIX + "client_tokens", "Tokens, by side and kind (prompt, completion).", ["target", "kind"], registry=r
        )
        self.cost = Counter(PREFIX + "client_cost_usd", "What requests cost, in USD.", target, registry=r)
        self.cloud_equivalent = Counter(
            PREFIX + "client_cloud_equivalent_usd", "What the same tokens would have cost on the cloud.", registry=r
        )
        self.saved = Counter(PREFIX + "client_saved_usd", "Positive savings of running on the device.", registry=r)
        self.collab_spans = Counter(
            PREFIX + "collab_spans", "Cloud requests inside a collaborative answer (token-mode spans, verified "
            "rounds), by mode and outcome.", ["mode", "outcome"], registry=r,
        )
        self.collab_tokens = Counter(
            PREFIX + "collab_tokens", "Answer tokens of collaborative answers, by the side that wrote them.", ["side"],
            registry=r,
        )
        self.kv_cache_events = Counter(
            PREFIX + "kv_cache_events", "Saved KV states of the edge runtime, by tier and event.", ["tier", "event"],
            registry=r,
        )
        for side in _TARGETS:  # present (at 0) from the start, as scrapers expect
            self.collab_tokens.labels(side)
            self.cost.labels(side)
            for outcome in ("ok", "error", "cancelled"):
                self.requests.labels(side, outcome)
            for kind in ("prompt", "completion"):
                self.tokens.labels(side, kind)

    def route(self, target: str, reason: str) -> None:
        """A request was routed to ``target``; ``reason`` is a kind such as ``score`` or ``pii``."""
        self.route_decisions.labels(_kind(target), _kind(reason)).inc()

    def fallback(self, from_: str, to: str, cause: str) -> None:
        """A request switched from one side to the other; ``cause`` is a kind such as ``timeout``."""
        self.fallbacks.labels(_kind(from_), _kind(to), _kind(cause)).inc()

    def kv_cache_event(self, tier: str, event: str) -> None:
        """One event of the edge's KV tiers (``tier`` ram/disk; ``event`` hit, save, corrupt ...)."""
        self.kv_cache_events.labels(_kind(tier), _kind(event)).inc()

    def collab_span(self, mode: str, outcome: str) -> None:
        """One cloud request inside a collaborative answer ended (``outcome``: line, budget, finished, failed ...)."""
        self.collab_spans.labels(_kind(mode), _kind(outcome)).inc()

    def collab_answer(self, tokens: dict[str, int]) -> None:
        """A collaborative answer finished with ``tokens`` written per side."""
        for side, n in tokens.items():
            self.collab_tokens.labels(_kind(side)).inc(n)

    def request(
        self,
        target: str,
        *,
        ttft: float | None,
        e2e: float,
        usage: Usage | None,
        cost: CostInfo | None,
        ok: bool = True,
        cancelled: bool = False,
    ) -> None:
        """A request finished on ``target`` (``ttft`` is None when no token arrived).

        ``outcome`` is ``ok``, ``error``, or ``cancelled`` when the caller stopped reading the
        stream before its end (closed it, broke out of the loop): not a failure of either side.
        """
        side = _kind(target)
        if ttft is not None:
            self.ttft.labels(side).observe(ttft)
        self.e2e.labels(side).observe(e2e)
        self.requests.labels(side, "ok" if ok else "cancelled" if cancelled else "error").inc()
        if usage is not None:
            self.tokens.labels(side, "prompt").inc(usage.prompt_tokens)
            self.tokens.labels(side, "completion").inc(usage.completion_tokens)
        if cost is not None:
            self.cost.labels(side).inc(max(cost.usd, 0.0))
            self.cloud_equivalent.inc(max(cost.cloud_equivalent_usd, 0.0))
            self.saved.inc(max(cost.saved_usd, 0.0))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class MetricsServer:
    """A running ``/metrics`` endpoint; close it (or use ``with``) to free the port."""

    def __init__(self, httpd: Any, thread: threading.Thread, addr: str, metrics: ClientMetrics) -> None:
        self._httpd = httpd
        self._thread = thread
        self.addr = addr
        #: What it serves.
        self.metrics = metrics
        #: The port it listens on (the one the OS picked when port 0 was asked).
        self.port: int = httpd.server_port

    @property
    def url(self) -> str:
        """Where to scrape: ``http://ADDR:PORT/metrics``."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def start_metrics_server(port: int = 0, addr: str = "127.0.0.1", metrics: ClientMetrics | None = None) -> MetricsServer:
    """Serve ``metrics`` (a new :class:`ClientMetrics` if None) on a background thread.

    ``port=0`` lets the OS pick a free port (see :attr:`MetricsServer.port`). A port that is
    taken raises :class:`~edgecloud.errors.ConfigError`.
    """
    metrics = metrics if metrics is not None else ClientMetrics()
    try:
        httpd, thread = start_http_server(port, addr=addr, registry=metrics.registry)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"cannot serve metrics on {addr}:{port}: the port is already in use; pick another port or 0 for any free one"
            ) from exc
        raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc}") from exc
    return MetricsServer(httpd, thread, addr, metrics)
