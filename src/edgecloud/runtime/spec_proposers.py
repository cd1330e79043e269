"""Where speculative drafts come from, below both sides: the proposer interface and prompt lookup.

This module owns the :class:`Proposer` interface (with :class:`DraftRequest` and
:class:`Proposal`) and :class:`NgramProposer` (``"ngram"``, no model): it finds the most recent
earlier occurrence of the context's last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``)
and proposes what followed it. Free to run; strong when the answer repeats the prompt (code
edits, quoting, reformatting), silent otherwise. The serving engines' speculator
(:mod:`edgecloud.serving.speculative`, which adds a draft model on llama.cpp) and the edge
runtime (:mod:`edgecloud.edge.llamacpp`) both draft through it.

A proposal carries the drafted tokens and, when they were sampled, the distribution each was
drawn from (needed for exact rejection sampling); greedy and n-gram proposals carry none.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError

__all__ = ["DraftRequest", "NgramProposer", "Proposal", "Proposer"]


@dataclass
class DraftRequest:
    """One sequence asking for up to ``k`` draft tokens after ``tokens`` (its prompt and output so far)."""

    key: int
    tokens: list[int]
    k: int
    temperature: float = 0.0
    top_p: float = 1.0
    #: A ``torch.Generator`` for sampled drafts (torch is needed only then).
    generator: Any = None


@dataclass
class Proposal:
    """Draft tokens (possibly none) and, for sampled drafts, their distributions ``[len(tokens), vocab]``."""

    tokens: list[int] = field(default_factory=list)
    #: A torch tensor ``[len(tokens), vocab]`` for sampled drafts; None for deterministic ones.
    probs: Any = None


class Proposer(abc.ABC):
    """Proposes draft tokens for several sequences at once; keeps whatever per-sequence state it needs."""

    name: ClassVar[str] = ""
    #: Seconds the last :meth:`propose` spent drafting, when the proposer measures it more
    #: fairly than the caller's wall clock can (None: the caller times the call).
    last_seconds: float | None = None

    @abc.abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """One proposal per request, in order (an empty one when there is nothing worth proposing)."""

    def release(self, key: int) -> None:  # noqa: B027 - optional hook
        """Sequence ``key`` finished: drop its state."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free resources."""


class NgramProposer(Proposer):
    """Prompt-lookup drafting: continue the most recent earlier match of the context's suffix."""

    name: ClassVar[str] = "ngram"

    def __init__(self, *, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(self.lookup(r.tokens, r.k)) for r in requests]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if k < 1 or len(tokens) <= self.min_n:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # starts 0..L-1-n: never the suffix itself
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start : start + k].tolist()
        return []
