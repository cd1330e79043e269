"""Routing policy: hard rules first, then the scorer's bands.

Order of decisions (each decision carries its reason and score, for the response's ``route``):

1. ``route="edge"`` / ``route="cloud"`` on the request pins the side.
2. Privacy: ``privacy="local_only"``, or personal data found in the conversation under the
   default ``pii="edge_only"``, keeps the request on the device - also when the edge is down
   (then :class:`~edgecloud.errors.PrivacyViolationError` rather than a cloud call).
   ``pii="redact"`` lets it go to the cloud with placeholders (the caller restores the answer
   with the returned :class:`~edgecloud.router.pii.Redaction`); ``pii="off"`` ignores PII.
3. Context fit: prompt + ``max_tokens`` beyond the edge's context goes to the cloud.
4. Availability: an unavailable side is skipped.
5. Bands: score < ``edge_below`` → edge; score > ``cloud_above`` → cloud; in between → edge
   first with the cascade's confidence check (``target="edge"``, ``cascade=True``). Bands
   left unset are the scorer's own (``scorer.bands``: 0.3 / 0.7 for the rules; the learned
   scorer's are fitted with it, its scores being probabilities of a cloud win). With
   ``target_cloud_fraction`` set, the cloud threshold is instead the rolling quantile of
   recent scores that sends that share of live traffic to the cloud.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from ..errors import ConfigError, PrivacyViolationError
from ..types import ChatRequest
from .features import estimate_tokens, max_tokens_of, messages_of
from .pii import Redaction, has_pii, redact
from .scorers import DESIGN_BANDS, BandedScorer, Scorer, load_scorer

__all__ = ["PrivacyViolationError", "RouteDecision", "RoutePolicy"]

Side = Literal["edge", "cloud"]


def _hint(request: Any, name: str) -> Any:
    """A routing field (``route``, ``privacy``) of a ChatRequest or a request dict; None otherwise."""
    if isinstance(request, ChatRequest):
        return request.route if name == "route" else request.privacy
    return request.get(name) if isinstance(request, dict) else None


@dataclass
class RouteDecision:
    """Where a request goes, and why."""

    target: Side
    reason: str
    score: float | None = None
    #: Answer on the edge first, escalate to the cloud when the answer's check fails.
    cascade: bool = False
    #: Privacy keeps it on the device: no fallback may send it to the cloud.
    local_only: bool = False
    #: The caller pinned the side with ``route="edge"``/``"cloud"``.
    pinned: bool = False
    #: Set when PII was replaced by placeholders for the cloud (policy ``pii="redact"``).
    redaction: Redaction | None = None
    messages: list[dict[str, str]] | None = field(default=None, repr=False)
    #: Which rule decided, as a metrics label: ``privacy``, ``pii``, ``pinned``, ``unavailable``,
    #: ``context``, ``score``, ``cascade`` (the hybrid adds ``only_side``).
    kind: str = "score"

    def __post_init__(self) -> None:
        if self.cascade and self.kind == "score":
            self.kind = "cascade"


@dataclass
class RoutePolicy:
    """Bands, a target cloud fraction, and the hard rules (see the module docstring)."""

    scorer: Scorer | None = None
    edge_below: float | None = None
    cloud_above: float | None = None
    target_cloud_fraction: float | None = None
    pii: Literal["edge_only", "redact", "off"] = "edge_only"
    edge_max_context: int | None = None
    window: int = 500
    count_tokens: Callable[[str], int] | None = None
    _recent: deque[float] = field(default_factory=deque, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.scorer is None:
            self.scorer = load_scorer("learned")
        low, high = self.scorer.bands if isinstance(self.scorer, BandedScorer) else DESIGN_BANDS
        self.edge_below = low if self.edge_below is None else self.edge_below
        self.cloud_above = max(high, self.edge_below) if self.cloud_above is None else self.cloud_above
        if not 0.0 <= self.edge_below <= self.cloud_above <= 1.0:
            raise ConfigError(f"need 0 <= edge_below <= cloud_above <= 1, got {self.edge_below} and {self.cloud_above}")
        if self.target_cloud_fraction is not None and not 0.0 <= self.target_cloud_fraction <= 1.0:
            raise ConfigError(f"target_cloud_fraction must be in [0, 1], got {self.target_cloud_fraction}")
        if self.pii not in ("edge_only", "redact", "off"):
            raise ConfigError(f"pii policy must be edge_only, redact or off, got {self.pii!r}")
        self._recent = deque(maxlen=self.window)

    def cloud_threshold(self) -> float:
        """The score above which requests go to the cloud now."""
        if self.target_cloud_fraction is None:
            return self.cloud_above
        with self._lock:
            if len(self._recent) < 20:
                return self.cloud_above
            return float(np.quantile(np.array(self._recent), 1.0 - self.target_cloud_fraction))

    def decide(self, request: Any, available: Collection[str] = ("edge", "cloud")) -> RouteDecision:
        """Route one request (a ChatRequest, a dict with ``messages``/``prompt``, or a string)."""
        messages = messages_of(request)
        pinned, privacy = _hint(request, "route"), _hint(request, "privacy")
        found = has_pii([m["content"] for m in messages]) if self.pii != "off" else []
        local_only = privacy == "local_only" or (bool(found) and self.pii == "edge_only")
        if local_only:
            why = "privacy=local_only" if privacy == "local_only" else f"PII detected ({', '.join(found)}), pii=edge_only"
            if "edge" not in available:
                raise PrivacyViolationError(f"{why}: the request must stay on the device, but the edge is unavailable")
            if pinned == "cloud":
                raise PrivacyViolationError(f"{why}: route='cloud' is not allowed for this request")
            return RouteDecision("edge", why, local_only=True, kind="privacy" if privacy == "local_only" else "pii")
        if pinned in ("edge", "cloud"):
            return self._with_redaction(
                RouteDecision(pinned, f"route={pinned} requested", pinned=True, kind="pinned"), messages, found)
        if available and set(available) <= {"edge"}:
            return RouteDecision("edge", "the cloud is unavailable", kind="unavailable")
        if available and set(available) <= {"cloud"}:
            return self._with_redaction(RouteDecision("cloud", "the edge is unavailable", kind="unavailable"), messages, found)
        if self.edge_max_context is not None:
            count = self.count_tokens or estimate_tokens
            need = sum(count(m["content"]) for m in messages) + (max_tokens_of(request) or 0)
            if need > self.edge_max_context:
                return self._with_redaction(RouteDecision(
                    "cloud", f"prompt + max_tokens ≈ {need} tokens exceed the edge context {self.edge_max_context}",
                    kind="context"),
                    messages, found)
        assert self.scorer is not None
        score = self.scorer.score(request)
        threshold = self.cloud_threshold()
        with self._lock:
            self._recent.append(score)
        name = self.scorer.name
        if score > threshold:
            return self._with_redaction(
                RouteDecision("cloud", f"{name} score {score:.3f} > {threshold:.3f}", score), messages, found)
        if score < min(self.edge_below, threshold):
            return RouteDecision("edge", f"{name} score {score:.3f} < {self.edge_below}", score)
        return RouteDecision("edge", f"{name} score {score:.3f} in the middle band: edge first, cloud if the answer "
                             "fails its check", score, cascade=True)

    def _with_redaction(self, decision: RouteDecision, messages: list[dict[str, str]], found: list[str]
                        ) -> RouteDecision:
        if decision.target != "cloud" or not found or self.pii != "redact":
            return decision
        texts, redaction = redact([m["content"] for m in messages])
        return replace(decision, redaction=redaction, messages=[{**m, "content": t} for m, t in zip(messages, texts)],
                       reason=f"{decision.reason}; PII redacted ({', '.join(found)})")
