"""Tools for testing an app that uses edgecloud against real conditions (a network with latency)."""

from .latency_proxy import LatencyProxy

__all__ = ["LatencyProxy"]
