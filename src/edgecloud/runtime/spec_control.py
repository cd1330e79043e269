"""How many tokens to draft: a cost model of the target step, live acceptance, and an off switch.

One controller for every speculating runtime: the serving engines (a batch of sequences) and
the edge runtime (one sequence). This module owns :class:`SpecConfig` (speculation settings), :class:`StepCost`
(an online fit of the target's step time ``a + b * rows``) and :class:`SpecState` (one
sequence's controller, counters and k trace), with :func:`speedup`. The acceptance estimate,
``E(k)`` and the choice of k are the shared maths of :mod:`edgecloud.runtime.speculative`
(also what the verified collaboration mode uses).

The choice. With per-token acceptance ``alpha``, drafting ``k`` tokens yields
``E(k) = (1 - alpha^(k+1)) / (1 - alpha)`` tokens per verification. In a batch of ``B``
decoding sequences whose plain step takes ``T`` seconds, adding ``k`` rows for one sequence
costs ``k * (b + d)`` (``b``: the target's marginal cost per row, ``d``: the proposer's cost per
drafted token) and slows every sequence in the batch, so the batch's token rate changes by

    speedup(k) = (B - 1 + E(k)) * T / (B * (T + k * (b + d)))

and the controller takes the ``k`` in ``[0, k_max]`` that maximises it. A large batch makes
each extra row harder to justify (batch-size aware, like vLLM's schedule, but measured).

The switch. When no ``k >= 1`` beats plain decoding by ``min_gain``, the sequence stops
speculating; every ``probe_every`` plain steps it drafts ``probe_k`` tokens once to refresh its
acceptance estimate (the interval doubles after each failed probe, up to ``max_probe_every``),
so speculation comes back when drafts become good again and costs almost nothing while
they are bad.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from .speculative import Acceptance, best_k, expected_tokens

__all__ = ["SPEC_MODES", "Acceptance", "SpecConfig", "SpecState", "StepCost", "expected_tokens", "speedup"]

SpecMode = Literal["draft", "ngram", "auto", "off"]
SPEC_MODES: tuple[str, ...] = ("draft", "ngram", "auto", "off")
#: Largest k accepted anywhere (CLI and requests).
K_LIMIT = 32


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings for one server."""

    mode: SpecMode = "off"
    k_max: int = 8
    #: Speculate only when the expected gain is at least this factor.
    min_gain: float = 1.03
    probe_every: int = 16
    max_probe_every: int = 128
    probe_k: int = 2
    #: Acceptance assumed before anything was measured.
    prior_acceptance: float = 0.6
    #: Weight kept by the acceptance estimate per observed draft token (closer to 1: slower to move).
    decay: float = 0.9
    #: False: always draft ``k_max`` tokens (a fixed k, as vLLM's ``num_speculative_tokens``).
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES:
            raise ConfigError(f"speculative mode {self.mode!r} is not one of {', '.join(SPEC_MODES)}")
        if not 1 <= self.k_max <= K_LIMIT:
            raise ConfigError(f"spec k_max must be between 1 and {K_LIMIT}, got {self.k_max}")
        if self.probe_k < 1 or self.probe_every < 1 or self.max_probe_every < self.probe_every:
            raise ConfigError("probe_k and probe_every must be >= 1 and max_probe_every >= probe_every")

    def allows(self, proposer: str) -> bool:
        """Whether requests may ask for ``proposer`` ("off" is always allowed)."""
        return proposer == "off" or self.mode == proposer or (self.mode == "auto" and proposer in ("draft", "ngram"))


def speedup(alpha: float, k: int, *, step: float, row: float, draft: float, batch: int) -> float:
    """The batch's token-rate factor when one of its ``batch`` sequences drafts ``k`` tokens (see module doc)."""
    if k <= 0:
        return 1.0
    b = max(1, batch)
    return (b - 1 + expected_tokens(alpha, k)) * step / (b * (step + k * (row + draft)))


class StepCost:
    """Online least-squares fit of the target's forward time, ``seconds = a + b * rows``, with forgetting.

    Until the observed row counts vary enough to separate ``a`` from ``b``, ``b`` is taken as
    ``prior_row_share * a`` (a few per cent of a step per extra row, typical of a memory-bound
    decode on CPU or GPU).
    """

    def __init__(self, *, decay: float = 0.98, prior_row_share: float = 0.05, max_rows: int = 128) -> None:
        self.decay, self.prior_row_share, self.max_rows = decay, prior_row_share, max_rows
        self._s0 = self._s1 = self._s2 = self._sy = self._sxy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """Record one forward of ``rows`` rows (long prefill chunks, a different regime, are ignored)."""
        if rows > self.max_rows or seconds <= 0:
            return
        d = self.decay
        self._s0 = d * self._s0 + 1
        self._s1 = d * self._s1 + rows
        self._s2 = d * self._s2 + rows * rows
        self._sy = d * self._sy + seconds
        self._sxy = d * self._sxy + rows * seconds

    @property
    def known(self) -> bool:
        """Whether any step was observed."""
        return self._s0 > 0

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``: fixed seconds per step and seconds per row."""
        if self._s0 <= 0:
            return 0.0, 0.0
        mean_x, mean_y = self._s1 / self._s0, self._sy / self._s0
        var = self._s2 / self._s0 - mean_x * mean_x
        if var > 0.25:  # the rows varied: fit the slope
            b = max(0.0, (self._sxy / self._s0 - mean_x * mean_y) / var)
            a = max(mean_y - b * mean_x, 1e-6)
            return a, b
        a = mean_y / (1 + self.prior_row_share * mean_x)
        return a, self.prior_row_share * a

    def predict(self, rows: int) -> float:
        """Seconds a forward of ``rows`` rows is expected to take."""
        a, b = self.coefficients()
        return a + b * rows


@dataclass
class SpecState:
    """One sequence's speculation: acceptance per proposer, the off switch, counters and the k trace."""

    config: SpecConfig
    proposers: tuple[str, ...]
    k_max: int
    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    #: Plain steps since the last speculation while switched off.
    off_steps: int = 0
    probe_every: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)
    #: Draft tokens verified at each decoding step of this sequence (0: a plain step).
    k_trace: list[int] = field(default_factory=list)
    failures: int = 0
    disabled_reason: str | None = None
    _probing: bool = False

    def __post_init__(self) -> None:
        self.probe_every = self.probe_every or self.config.probe_every
        self.accepted_at = self.accepted_at or [0] * self.k_max

    def plan(self, *, step: float, row: float, draft_cost: dict[str, float], batch: int) -> tuple[str, int]:
        """The proposer and k for this step (``("", 0)``: decode plainly)."""
        if self.disabled_reason is not None or not self.proposers:
            return "", 0
        if not self.config.adaptive:
            return max(self.proposers, key=lambda n: self.acceptance[n].rate), self.k_max
        best, best_k, best_gain = "", 0, 1.0
        for name in self.proposers:
            k, gain = self.best_k(name, step=step, row=row, draft_cost=draft_cost, batch=batch)
            if gain > best_gain:
                best, best_k, best_gain = name, k, gain
        self._probing = False
        if best_k and best_gain >= self.config.min_gain:
            self.off_steps = 0
        else:
            self.off_steps += 1
            if self.off_steps < self.probe_every:
                return "", 0
            # probe the proposer with the best acceptance so a recovery is noticed
            best = max(self.proposers, key=lambda n: self.acceptance[n].rate)
            best_k, self._probing, self.off_steps = min(self.config.probe_k, self.k_max), True, 0
        return best, best_k

    def best_k(self, name: str, *, step: float, row: float, draft_cost: dict[str, float], batch: int) -> tuple[int, float]:
        """The k in ``[1, k_max]`` with the highest expected speedup for proposer ``name``, and that speedup
        (no state changes: also used when a free proposer had nothing and another one is asked instead)."""
        if not self.config.adaptive:
            return self.k_max, float("inf")
        alpha, cost = self.acceptance[name].rate, draft_cost.get(name, 0.0)
        b = max(1, batch)
        k, rate = best_k(alpha, self.k_max, fixed=step, per_token=row + cost, others=b - 1)
        return k, rate * step / b  # the rate against plain decoding's b / step: speedup()

    def record(self, proposer: str, proposed: int, accepted: int, *, step: float, row: float,
               draft_cost: dict[str, float], batch: int) -> None:
        """The outcome of one verification of ``proposed`` drafts from ``proposer``."""
        if proposed == 0:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for i in range(min(accepted, self.k_max)):
            self.accepted_at[i] += 1
        self.acceptance[proposer].observe(proposed, accepted)
        if self._probing:  # back off when the probe says drafting still does not pay
            alpha = self.acceptance[proposer].rate
            pays = any(
                speedup(alpha, k, step=step, row=row, draft=draft_cost.get(proposer, 0.0), batch=batch)
                >= self.config.min_gain
                for k in range(1, self.k_max + 1)
            )
            self.probe_every = self.config.probe_every if pays else min(2 * self.probe_every, self.config.max_probe_every)

    def summary(self) -> dict[str, object]:
        """The ``speculative`` block of a response's usage."""
        return {
            "proposers": list(self.proposers),
            "num_drafts": self.drafts,
            "num_draft_tokens": self.draft_tokens,
            "num_accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.accepted_tokens / self.draft_tokens, 4) if self.draft_tokens else None,
            "mean_acceptance_length": round(self.accepted_tokens / self.drafts, 3) if self.drafts else None,
            "accepted_per_position": self.accepted_at,
            "k_trace": self.k_trace,
            "draft_failures": self.failures,
            "disabled": self.disabled_reason,
        }
