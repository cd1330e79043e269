"""The token gate: is the edge unsure of the token it is about to write?

This module owns :class:`TokenSignals` (what the edge's own next-token distribution says:
entropy, top-1 probability, margin to the runner-up, all read from the OpenAI-shaped
``top_logprobs`` any edge runtime streams) and :class:`Gate` (one of those signals against a
threshold). The gate has no fitted weights on purpose. Measured on 2,049 answer tokens of the
0.5B edge over the five outcome suites, as predictors of "the 1.5B cloud's greedy token differs
here": AUC top-1 0.938, margin 0.937, entropy 0.934; a logistic on all three 0.938 fitted and
scored on every suite, 0.935 fitted on four suites and scored on the fifth. Learning adds
nothing a single number does not already give, and a rule with one number cannot learn a
suite. What is chosen from data is the signal (top-1, unfitted, so the same in and out of
suite) and the threshold (chosen leave-one-suite-out, ``benchmarks/collab.py``).

Entropy is computed over the ``top_logprobs`` alternatives plus the leftover mass as one
bucket: a lower bound of the true entropy that is tight whenever the edge is confident (the
case that matters for not escalating).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..types import TokenLogprob

__all__ = ["GATE_SIGNALS", "Gate", "GateSignal", "TokenSignals", "signals_of"]

GateSignal = Literal["entropy", "top1", "margin"]
GATE_SIGNALS: tuple[str, ...] = ("entropy", "top1", "margin")


@dataclass(frozen=True)
class TokenSignals:
    """The edge's next-token distribution, summarised."""

    #: Entropy in nats over the alternatives seen (and the rest as one bucket).
    entropy: float
    #: Probability of the most likely token.
    top1: float
    #: ``top1`` minus the runner-up's probability.
    margin: float

    def unsure(self, signal: GateSignal) -> float:
        """The signal as an unsure-score in 0..1 (higher: less sure)."""
        if signal == "entropy":
            return 1.0 - math.exp(-self.entropy)
        if signal == "top1":
            return 1.0 - self.top1
        return 1.0 - self.margin


def signals_of(entry: TokenLogprob | Sequence[float]) -> TokenSignals:
    """Signals of one streamed token (its ``top_logprobs``), or of a list of top logprobs."""
    if isinstance(entry, TokenLogprob):
        logprobs = [t.logprob for t in entry.top_logprobs] or [entry.logprob]
    else:
        logprobs = list(entry)
    probs = sorted((math.exp(lp) for lp in logprobs), reverse=True)
    if not probs:
        return TokenSignals(entropy=0.0, top1=1.0, margin=1.0)
    rest = max(0.0, 1.0 - sum(probs))
    entropy = -sum(p * math.log(p) for p in probs if p > 0) - (rest * math.log(rest) if rest > 0 else 0.0)
    second = probs[1] if len(probs) > 1 else rest
    return TokenSignals(entropy=entropy, top1=probs[0], margin=probs[0] - second)


@dataclass(frozen=True)
class Gate:
    """Escalate a token when ``signal``'s unsure-score exceeds ``threshold``.

    Unsure-scores: ``top1`` → 1 − p(top-1); ``margin`` → 1 − (p1 − p2); ``entropy`` →
    1 − exp(−H). A threshold of 1 never escalates; 0 escalates every token.
    """

    signal: GateSignal = "top1"
    threshold: float = 0.5

    def __post_init__(self) -> None:
        if self.signal not in GATE_SIGNALS:
            raise ConfigError(f"unknown gate signal {self.signal!r}; use one of {', '.join(GATE_SIGNALS)}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"the gate threshold must be in 0..1, got {self.threshold}")

    def score(self, entry: TokenLogprob) -> float:
        """How unsure the edge was of ``entry`` (0..1)."""
        return signals_of(entry).unsure(self.signal)

    def unsure(self, entry: TokenLogprob) -> bool:
        """Whether ``entry`` should be written by the cloud instead."""
        return self.score(entry) > self.threshold
