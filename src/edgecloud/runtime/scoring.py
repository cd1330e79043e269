"""Scoring a given continuation: what a verifier needs from a model, on either side.

This module owns :class:`TokenScore` (one position: the token there, its logprob under the
model, the model's best alternatives) and :func:`check_token_ids` (token-id prompts are
validated before they reach a runtime). The llama.cpp backend produces scores
(:meth:`~edgecloud.edge.llamacpp.LlamaCppBackend.score`), ``edgecloud serve`` returns them
on ``/v1/completions`` with ``echo`` and ``logprobs``, and the verified collaboration mode
(:mod:`edgecloud.collab.verified`) reads them back through the cloud client.

It also owns the client's half of token sessions: :class:`TokenSession` (what a remote endpoint
holds of one answer's token ids, so each round sends only what is new: the first round sends
the whole context with ``session.base`` 0; a server that holds it says so (``session.tokens``);
each later round sends the tokens after the prefix still valid; a server that lost the session
answers 409 ``session_expired`` and the round is sent whole again; ``edgecloud serve`` holds
sessions, other servers get the whole context every round) and :class:`Scored` (a round's scores
and what it cost). The answer never depends on the session: only what is sent does.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from ..errors import ContextOverflowError, InvalidRequestError
from .chunks import log_partition, top_tokens

if TYPE_CHECKING:
    from .coupling import Coupling
    from .held import HeldPicker

__all__ = ["Scored", "TokenScore", "TokenSession", "check_token_ids", "score_rows"]


@dataclass(frozen=True)
class TokenScore:
    """One scored position: ``token`` with its ``logprob``; ``top`` the best (token, logprob), best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    #: The model's sampled pick here under a coupled sampler (:mod:`edgecloud.runtime.coupling`).
    pick: int | None = None

    @property
    def argmax(self) -> int:
        """The model's greedy choice at this position (``token`` when no alternatives were asked)."""
        return self.top[0][0] if self.top else self.token

    @property
    def choice(self) -> int:
        """What the model writes here: its coupled pick when it sampled, else its greedy choice."""
        return self.pick if self.pick is not None else self.argmax


def score_rows(rows: Sequence[npt.NDArray[Any]], tokens: Sequence[int], start: int, top_n: int,
               coupling: Coupling | None = None,
               held: HeldPicker | None = None) -> tuple[list[TokenScore], TokenScore]:
    """Scores from logits rows: ``rows[i]`` predicts ``tokens[start + i]``; the last row predicts the
    token after them all (the next token: the greedy one, or the pick). With ``coupling`` every row
    also carries the model's pick at its position; with ``held`` (a grammar state at ``start``)
    the picks are held to the grammar, which advances by each given token that equals the pick —
    after the first that does not, no more picks are made (the check ends there)."""
    scores = []
    for i, logits in enumerate(rows):
        at = start + i
        log_z = log_partition(logits)
        pick = None
        if held is not None:
            if not held.stopped:
                pick = held.choose(logits, at)
                if at < len(tokens):
                    if tokens[at] == pick:
                        held.accept(pick)
                    else:
                        held.stopped = True
        elif coupling is not None:
            pick = coupling.pick(logits, at)
        token = tokens[at] if at < len(tokens) else pick if pick is not None else int(logits.argmax())
        scores.append(TokenScore(token=token, logprob=min(0.0, float(logits[token]) - log_z),
                                 top=top_tokens(logits, top_n, log_z), pick=pick))
    return scores[:-1], scores[-1]


def check_token_ids(tokens: Sequence[int], n_vocab: int, room: int) -> None:
    """Refuse token ids outside the vocabulary and sequences longer than ``room`` tokens."""
    if not tokens:
        raise InvalidRequestError("the prompt has no tokens", param="prompt")
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside this model's vocabulary (0..{n_vocab - 1})", param="prompt")
    if len(tokens) > room:
        raise ContextOverflowError(len(tokens), room)


@dataclass
class TokenSession:
    """What a remote endpoint holds of one answer's token ids (see the module docstring)."""

    id: str = field(default_factory=lambda: f"ec-{uuid.uuid4().hex}")
    #: Tokens the server holds that are still this answer's context (what the next round may skip).
    held: int = 0
    #: None until the first answer says; False when the server does not hold sessions.
    supported: bool | None = None
    #: The server continues from what it holds with no new tokens (its answers say ``resumes``);
    #: otherwise a round without drafts sends the last held token again.
    resumes: bool = False
    #: Rounds sent whole again because the server had lost the session.
    resent: int = 0
    #: Whether a round the server refuses to continue (it holds fewer tokens than ``held``) is sent
    #: whole again; False: the refusal (SessionExpiredError) is raised (a check sent ahead, on a bet).
    resend: bool = True

    def ahead(self, held: int) -> TokenSession:
        """A view of this session for a round sent before the last one is answered, on the bet
        that the server will then hold ``held`` tokens of this answer: raised, not resent, when it
        does not (its answer says nothing then)."""
        return TokenSession(id=self.id, held=held, supported=self.supported, resumes=self.resumes, resend=False)

    def base(self, tokens: int) -> int:
        """How many of a round's first ``tokens`` need not be sent."""
        return min(self.held, tokens) if self.supported else 0

    def keep(self, n: int) -> None:
        """Only the first ``n`` tokens the server holds are still the answer's context (the rest
        were drafts it rejected); the next round continues after them."""
        self.held = min(self.held, n)

    def checked(self, at: int, kept: int, token: int, scored: Scored) -> None:
        """A check of drafts after the first ``at`` tokens landed: the client keeps ``kept`` of them
        and the server's ``token`` after them. A server that kept the same itself holds that token
        too (it is not sent again); otherwise the session holds the kept drafts at most."""
        agreed = scored.verified == (kept, token)
        server_kept = scored.verified[0] if scored.verified is not None else kept
        self.keep(at + kept + 1 if agreed else at + min(kept, server_kept))

    def lost(self) -> None:
        """The server no longer holds the session: the next round is sent whole."""
        self.held = 0
        self.resent += 1


@dataclass(frozen=True)
class Scored:
    """A scoring round: the scores of the scored positions, the greedy next token, and its cost
    (``sent``: prompt tokens the request carried and was billed for, ``cached`` of them read from
    the server's prefix cache; ``held``: context the session held, not sent; ``verified``: what a
    ``keep_verified`` check's server kept in the session, ``(drafts it agreed with, its token)``,
    None where it keeps the whole context)."""

    scores: list[TokenScore]
    next: TokenScore
    sent: int
    cached: int = 0
    held: int = 0
    verified: tuple[int, int] | None = None
