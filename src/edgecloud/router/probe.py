"""The early-exit probe's check: after the edge's first tokens, keep its answer or ask the cloud?

For a cloud that only chats (a hosted API: it neither scores a continuation nor continues an
assistant message) an answer is written by one side. The pre-generation router cannot tell how
hard a request is for the edge model (no better than random on unseen task families); the edge's
own uncertainty over its first tokens can. :class:`ProbeCheck` reads the first ``tokens`` tokens
the edge wrote (each token's logprob and its runner-up's) and gives ``p_escalate``, the chance that
the cloud would answer well where the edge's answer would fail: a logistic model over
:func:`probe_features`, fitted on the development corpus (``benchmarks/chat_only.py report``,
which also chooses ``threshold`` held out by task family) and shipped as ``data/probe.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

__all__ = ["FEATURES", "PROBE_FORMAT", "ProbeCheck", "probe_features"]

PROBE_FORMAT = "edgecloud.router.probe/1"
PACKAGED_PROBE = "probe.json"
#: What :func:`probe_features` returns, in order.
FEATURES = ("mean_logprob", "min_logprob", "p10_logprob", "share_below_half", "mean_margin", "min_margin",
            "finished")
_HALF = math.log(0.5)


def probe_features(tokens: Sequence[tuple[float, float]], finished: bool) -> list[float]:
    """Features of the edge's first tokens: each ``(logprob of the token, logprob of the runner-up)``;
    ``finished``: the answer ended within them."""
    if not tokens:
        return [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, float(finished)]
    lps = sorted(t[0] for t in tokens)
    margins = [math.exp(lp) - math.exp(second) for lp, second in tokens]
    return [
        sum(lps) / len(lps),
        lps[0],
        lps[int(0.1 * (len(lps) - 1))],
        sum(lp < _HALF for lp in lps) / len(lps),
        sum(margins) / len(margins),
        min(margins),
        float(finished),
    ]


@dataclass(frozen=True)
class ProbeCheck:
    """A logistic model over :func:`probe_features` (standardised), and the escalation threshold."""

    tokens: int
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float
    threshold: float

    def p_escalate(self, tokens: Sequence[tuple[float, float]], finished: bool) -> float:
        """The chance that the cloud should write this answer instead of the edge."""
        x = probe_features(tokens[: self.tokens], finished)
        z = self.bias + sum(w * (v - m) / s for w, v, m, s in zip(self.weights, x, self.mean, self.scale))
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))

    def escalate(self, tokens: Sequence[tuple[float, float]], finished: bool) -> tuple[bool, float]:
        """Whether to ask the cloud for the whole answer, and ``p_escalate``."""
        p = self.p_escalate(tokens, finished)
        return p >= self.threshold, p

    def to_json(self) -> dict[str, object]:
        return {"format": PROBE_FORMAT, "features": list(FEATURES), "tokens": self.tokens, "mean": list(self.mean),
                "scale": list(self.scale), "weights": list(self.weights), "bias": self.bias,
                "threshold": self.threshold}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> ProbeCheck:
        if data.get("format") != PROBE_FORMAT or list(data.get("features") or []) != list(FEATURES):  # type: ignore[call-overload]
            raise ValueError(f"not a {PROBE_FORMAT} check with features {', '.join(FEATURES)}")
        return cls(tokens=int(data["tokens"]), mean=tuple(data["mean"]), scale=tuple(data["scale"]),  # type: ignore[arg-type]
                   weights=tuple(data["weights"]), bias=float(data["bias"]),  # type: ignore[arg-type]
                   threshold=float(data["threshold"]))  # type: ignore[arg-type]

    @classmethod
    def packaged(cls) -> ProbeCheck:
        """The check shipped with edgecloud (fitted on the development corpus)."""
        return _packaged()


@lru_cache(maxsize=1)
def _packaged() -> ProbeCheck:
    text = resources.files("edgecloud.router").joinpath("data", PACKAGED_PROBE).read_text(encoding="utf-8")
    return ProbeCheck.from_json(json.loads(text))
