"""Checking draft tokens against the target model: greedy matching and exact rejection sampling.

This module owns :func:`verify`, which turns the target's logits at the ``k + 1`` positions it scored in one forward into the tokens to emit.

* Greedy (``temperature <= 0``): draft token ``i`` is accepted while it equals the target's
  argmax at position ``i``; the first mismatch (or position ``k`` when all ``k`` were accepted)
  contributes the target's own argmax. The output is the token sequence plain greedy decoding
  produces, one forward for up to ``k + 1`` tokens.
* Sampling: the speculative sampling rule of Leviathan et al. / Chen et al. Draft token ``x``
  drawn from the draft's distribution ``q`` is accepted with probability ``min(1, p(x)/q(x))``;
  on rejection the replacement is drawn from ``norm(max(0, p - q))``; when all are accepted a
  bonus token is drawn from ``p`` at position ``k``. Every emitted token is then distributed
  exactly as the target alone would sample it. A proposer without probabilities (n-gram
  lookup) proposes deterministically: ``q`` is one-hot, so acceptance is ``p(x)`` and the
  residual is ``p`` with ``x`` removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...engine.generate import sampling_probs
from ...runtime.speculative import accept_prefix

__all__ = ["Verdict", "sampling_probs", "verify"]


@dataclass(frozen=True)
class Verdict:
    """What one verification step emits: ``tokens`` (the accepted drafts, then one token of the
    target's own) and ``accepted`` (how many drafts were kept; ``len(tokens) == accepted + 1``)."""

    tokens: list[int]
    accepted: int


def verify(
    logits: Tensor,
    draft: list[int],
    *,
    draft_probs: Tensor | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Accept a prefix of ``draft`` given the target's ``logits[k + 1, vocab]``.

    Row ``i`` of ``logits`` is the target's prediction for the position of ``draft[i]`` (row
    ``k``: the position after the last draft). ``draft_probs[k, vocab]`` is the distribution
    each draft token was sampled from (None: deterministic proposals).
    """
    k = len(draft)
    if logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} rows of logits for {k} draft tokens, got {logits.shape[0]}")
    if temperature <= 0:
        best = logits.argmax(-1).tolist()
        accepted = accept_prefix(draft, best)
        return Verdict(draft[:accepted] + [best[accepted]], accepted)
    p = sampling_probs(logits, temperature, top_p)
    uniforms = torch.rand(k, generator=generator).tolist() if k else []
    for i, token in enumerate(draft):
        p_x = float(p[i, token])
        q_x = float(draft_probs[i, token]) if draft_probs is not None else 1.0
        if q_x > 0 and uniforms[i] * q_x < p_x:  # u < p/q without dividing
            continue
        residual = p[i].clone()
        if draft_probs is not None:
            residual = (residual - draft_probs[i].to(residual.dtype)).clamp_(min=0)
        else:
            residual[token] = 0
        total = float(residual.sum())
        # p <= q everywhere only when p == q (then acceptance is certain); guard rounding anyway
        choice = int(torch.multinomial(residual / total if total > 0 else p[i], 1, generator=generator))
        return Verdict(draft[:i] + [choice], i)
    bonus = int(torch.multinomial(p[k], 1, generator=generator))
    return Verdict(list(draft) + [bonus], k)
