"""ClientMetrics over a real /metrics endpoint on loopback, parsed with prometheus_client's parser."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgecloud.errors import ConfigError
from edgecloud.observability.client_metrics import ClientMetrics, start_metrics_server
from edgecloud.types import CostInfo, Usage


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample as {(name, labels): value}."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(all_samples: dict, name: str, **labels: str) -> float:
    return all_samples[(name, frozenset(labels.items()))]


def record(metrics: ClientMetrics) -> None:
    metrics.route("edge", "score")
    metrics.route("edge", "score")
    metrics.route("cloud", "pii redacted (email)")  # free text is not a kind
    metrics.fallback("cloud", "edge", "timeout")
    metrics.request("edge", ttft=0.03, e2e=0.9, usage=Usage(prompt_tokens=100, completion_tokens=20),
                    cost=CostInfo(usd=0.0, cloud_equivalent_usd=0.00008, saved_usd=0.00008))
    metrics.request("cloud", ttft=0.3, e2e=2.0, usage=Usage(prompt_tokens=10, completion_tokens=5),
                    cost=CostInfo(usd=0.00002, cloud_equivalent_usd=0.00002, saved_usd=0.0))
    metrics.request("cloud", ttft=None, e2e=0.2, usage=None, cost=None, ok=False)


def test_scrape_over_http_sees_every_event() -> None:
    metrics = ClientMetrics()
    record(metrics)
    with start_metrics_server(port=0, metrics=metrics) as server:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(server.url, timeout=5) as response:
            assert response.status == 200
            text = response.read().decode()
    s = samples(text)
    assert value(s, "edgecloud:route_decisions_total", target="edge", reason="score") == 2
    assert value(s, "edgecloud:route_decisions_total", target="cloud", reason="other") == 1
    assert value(s, "edgecloud:fallbacks_total", **{"from": "cloud", "to": "edge", "cause": "timeout"}) == 1
    assert value(s, "edgecloud:client_requests_total", target="edge", outcome="ok") == 1
    assert value(s, "edgecloud:client_requests_total", target="cloud", outcome="ok") == 1
    assert value(s, "edgecloud:client_requests_total", target="cloud", outcome="error") == 1
    assert value(s, "edgecloud:client_requests_total", target="edge", outcome="error") == 0
    assert value(s, "edgecloud:client_requests_total", target="edge", outcome="cancelled") == 0
    assert value(s, "edgecloud:client_tokens_total", target="edge", kind="prompt") == 100
    assert value(s, "edgecloud:client_tokens_total", target="edge", kind="completion") == 20
    assert value(s, "edgecloud:client_tokens_total", target="cloud", kind="completion") == 5
    assert value(s, "edgecloud:client_cost_usd_total", target="cloud") == pytest.approx(0.00002)
    assert value(s, "edgecloud:client_saved_usd_total") == pytest.approx(0.00008)
    assert value(s, "edgecloud:client_cloud_equivalent_usd_total") == pytest.approx(0.0001)
    # a request with no token observes e2e but not ttft
    assert value(s, "edgecloud:client_time_to_first_token_seconds_count", target="cloud") == 1
    assert value(s, "edgecloud:client_e2e_request_latency_seconds_count", target="cloud") == 2
    assert value(s, "edgecloud:client_e2e_request_latency_seconds_sum", target="cloud") == pytest.approx(2.2)
    assert value(s, "edgecloud:client_time_to_first_token_seconds_bucket", target="edge", le="0.05") == 1
    assert value(s, "edgecloud:client_time_to_first_token_seconds_bucket", target="edge", le="0.025") == 0


def test_a_closed_stream_is_cancelled_not_an_error() -> None:
    metrics = ClientMetrics()
    metrics.request("edge", ttft=0.02, e2e=0.1, usage=None, cost=None, ok=False, cancelled=True)
    s = samples(metrics.render().decode())
    assert value(s, "edgecloud:client_requests_total", target="edge", outcome="cancelled") == 1
    assert value(s, "edgecloud:client_requests_total", target="edge", outcome="error") == 0


def test_render_matches_and_registries_are_private() -> None:
    a, b = ClientMetrics(), ClientMetrics()
    a.route("edge", "pinned")
    assert value(samples(a.render().decode()), "edgecloud:route_decisions_total", target="edge", reason="pinned") == 1
    assert ("edgecloud:route_decisions_total", frozenset({("target", "edge"), ("reason", "pinned")})) not in samples(
        b.render().decode()
    )


def test_negative_saving_does_not_decrease_the_counter() -> None:
    metrics = ClientMetrics()
    metrics.request("edge", ttft=0.1, e2e=1.0, usage=None, cost=CostInfo(usd=0.01, cloud_equivalent_usd=0.002, saved_usd=-0.008))
    s = samples(metrics.render().decode())
    assert value(s, "edgecloud:client_saved_usd_total") == 0
    assert value(s, "edgecloud:client_cost_usd_total", target="edge") == pytest.approx(0.01)


def test_port_in_use_is_a_config_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}.*already in use"):
            start_metrics_server(port=port)


def test_close_frees_the_port() -> None:
    server = start_metrics_server(port=0)
    port = server.port
    server.close()
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))  # would raise if the server still held it
