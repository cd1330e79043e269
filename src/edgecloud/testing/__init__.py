"""Tools for testing an app that uses edgecloud against real conditions (a network with latency,
a hosted chat API that refuses edgecloud's extensions)."""

from .hosted_api import HOSTED_CHAT_FIELDS, HostedChatProxy
from .latency_proxy import LatencyProxy

__all__ = ["HOSTED_CHAT_FIELDS", "HostedChatProxy", "LatencyProxy"]
