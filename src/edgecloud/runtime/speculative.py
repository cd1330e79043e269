"""The speculative maths every drafter-verifier pair shares: accept a prefix, estimate acceptance, choose k.

This module owns :func:`accept_prefix` (how many draft tokens a greedy verifier keeps),
:class:`Acceptance` (a decayed per-token acceptance estimate), :func:`expected_tokens` (tokens
one verification yields) and :func:`best_k` (the draft length with the most tokens per unit of
cost). The server's speculator (:mod:`edgecloud.serving.speculative`) and the verified
collaboration mode (:mod:`edgecloud.collab.verified`, where the drafter is the device and the
verifier a remote endpoint) both read them from here, so the two cannot drift apart.

The model. With per-token acceptance ``alpha``, drafting ``k`` tokens yields
``E(k) = (1 - alpha^(k+1)) / (1 - alpha)`` tokens per verification (the accepted drafts plus
the verifier's own token). A round that drafts ``k`` tokens costs ``fixed + k * per_token``
(the verifier's step, or a network round trip, plus the drafter's time per token); when the
round is shared with ``others`` sequences that each advance one token (a batch), the rate is
``(others + E(k)) / (fixed + k * per_token)``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Acceptance", "accept_prefix", "best_k", "expected_tokens"]


def accept_prefix(draft: Sequence[int], target: Sequence[int]) -> int:
    """How many leading ``draft`` tokens equal the verifier's greedy choices ``target`` (aligned
    position by position); the verifier's own token then follows at that index."""
    kept = 0
    limit = min(len(draft), len(target))
    while kept < limit and draft[kept] == target[kept]:
        kept += 1
    return kept


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification yields on average with ``k`` drafts at per-token acceptance ``alpha``."""
    if k <= 0:
        return 1.0
    if alpha >= 0.999999:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, k_max: int, *, fixed: float, per_token: float, others: float = 0.0) -> tuple[int, float]:
    """The ``k`` in ``1..k_max`` with the highest rate ``(others + E(alpha, k)) / (fixed + k * per_token)``,
    and that rate (the smallest such ``k`` on a tie)."""
    best, best_rate = 1, float("-inf")
    for k in range(1, max(1, k_max) + 1):
        cost = fixed + k * per_token
        rate = (others + expected_tokens(alpha, k)) / cost if cost > 0 else float("inf")
        if rate > best_rate:
            best, best_rate = k, rate
    return best, best_rate


class Acceptance:
    """Per-token acceptance as decayed counts (``accepted / tried``) with a prior worth ``prior_weight`` tries."""

    def __init__(self, prior: float, *, decay: float = 0.9, prior_weight: float = 2.0) -> None:
        self.decay = decay
        self._accepted = prior * prior_weight
        self._tried = prior_weight

    @property
    def rate(self) -> float:
        """Current estimate."""
        return self._accepted / self._tried

    def observe(self, proposed: int, accepted: int) -> None:
        """One verification: ``accepted`` of ``proposed`` drafts kept (the tokens after the first rejection were never tried)."""
        tried = accepted + (1 if accepted < proposed else 0)
        if tried == 0:
            return
        keep = self.decay**tried
        self._accepted = keep * self._accepted + accepted
        self._tried = keep * self._tried + tried
