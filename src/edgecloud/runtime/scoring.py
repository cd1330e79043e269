"""Scoring a given continuation: what a verifier needs from a model, on either side.

This module owns :class:`TokenScore` (one position: the token there, its logprob under the
model, the model's best alternatives) and :func:`check_token_ids` (token-id prompts are
validated before they reach a runtime). The llama.cpp backend produces scores
(:meth:`~edgecloud.edge.llamacpp.LlamaCppBackend.score`), ``edgecloud serve`` returns them
on ``/v1/completions`` with ``echo`` and ``logprobs``, and the verified collaboration mode
(:mod:`edgecloud.collab.verified`) reads them back through the cloud client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ContextOverflowError, InvalidRequestError

__all__ = ["TokenScore", "check_token_ids"]


@dataclass(frozen=True)
class TokenScore:
    """One scored position: ``token`` with its ``logprob``; ``top`` the best (token, logprob), best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    @property
    def argmax(self) -> int:
        """The model's greedy choice at this position (``token`` when no alternatives were asked)."""
        return self.top[0][0] if self.top else self.token


def check_token_ids(tokens: Sequence[int], n_vocab: int, room: int) -> None:
    """Refuse token ids outside the vocabulary and sequences longer than ``room`` tokens."""
    if not tokens:
        raise InvalidRequestError("the prompt has no tokens", param="prompt")
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside this model's vocabulary (0..{n_vocab - 1})", param="prompt")
    if len(tokens) > room:
        raise ContextOverflowError(len(tokens), room)
