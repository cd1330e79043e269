"""Where speculative drafts come from: a small draft model, or n-gram lookup in the context.

The two kinds of proposer (this module owns the draft-model one):

* :class:`NgramProposer` (``"ngram"``, no model; it lives in :mod:`edgecloud.runtime.spec_proposers`,
  with the interface, so the edge runtime drafts with it too): prompt lookup.
* :class:`LlamaDraftProposer` (``"draft"``): a small model with the target's vocabulary on
  llama.cpp's INT4 runtime, far cheaper per token on a CPU than the target. Each scheduler
  sequence gets its own llama.cpp sequence (KV stream) in one context; a step drafts for all
  speculating sequences together, one ``llama_decode`` per draft position. A sequence's draft
  KV is rolled back to the longest prefix it shares with the new context, so after a
  verification only the accepted tokens (and the target's correction) are fed.

A proposal carries the drafted tokens and, when they were sampled, the distribution each was
drawn from (needed for exact rejection sampling); greedy and n-gram proposals carry none.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ...errors import ConfigError, InvalidRequestError
from ...runtime.spec_proposers import DraftRequest, NgramProposer, Proposal, Proposer

__all__ = ["DraftRequest", "LlamaDraftProposer", "NgramProposer", "Proposal", "Proposer"]


class LlamaDraftProposer(Proposer):
    """A draft model on llama.cpp, one KV stream per scheduler sequence.

    ``target_vocab`` (the target's vocabulary size) is checked at start-up: speculative
    decoding compares token ids, so a draft with another vocabulary is refused.
    """

    name: ClassVar[str] = "draft"

    def __init__(
        self,
        model: str | Path,
        *,
        target_vocab: int | None = None,
        max_seqs: int = 8,
        ctx_per_seq: int = 4096,
        threads: int = 0,
        n_batch: int = 512,
    ) -> None:
        from ...runtime.llamacpp_batch import MultiSeqContext
        from ...store import resolve_model

        path = resolve_model(model, pull=False)
        self.model_path = path
        self._seqs = MultiSeqContext(path, n_seq=max_seqs, n_ctx=max_seqs * ctx_per_seq, n_batch=n_batch, threads=threads)
        self.vocab_size = self._seqs.n_vocab
        if target_vocab is not None and target_vocab != self.vocab_size:
            self._seqs.close()
            raise ConfigError(
                f"draft model {path.name} has a vocabulary of {self.vocab_size} tokens but the target has "
                f"{target_vocab}; speculative decoding needs the same tokenizer (e.g. a smaller model of the same family)"
            )
        self._slots: dict[int, int] = {}
        self._held: dict[int, list[int]] = {}  # slot -> the tokens its KV holds
        self._free = list(range(max_seqs - 1, -1, -1))
        # last_seconds counts the draft loop and short catch-ups (the tokens verification
        # accepted), not the first prefill of a new prompt: that is paid once per sequence and
        # would make drafting look far dearer per token than it is.
        self.last_seconds = None

    def _slot(self, key: int) -> int | None:
        slot = self._slots.get(key)
        if slot is None and self._free:
            slot = self._slots[key] = self._free.pop()
            self._held[slot] = []
        return slot

    def release(self, key: int) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._seqs.forget(slot)
            self._held.pop(slot, None)
            self._free.append(slot)

    def close(self) -> None:
        self._seqs.close()

    def _catch_up(self, slot: int, tokens: list[int]) -> np.ndarray:
        """Feed what the slot's KV lacks of ``tokens``; the logits after the last one (a copy)."""
        held = self._held[slot]
        common = 0
        limit = min(len(held), len(tokens) - 1)  # always re-feed at least the last token for its logits
        while common < limit and held[common] == tokens[common]:
            common += 1
        if len(tokens) > self._seqs.room:
            raise InvalidRequestError(f"context of {len(tokens)} tokens exceeds the draft's {self._seqs.room}")
        self._seqs.forget(slot, common)
        logits = np.array(self._seqs.prefill(slot, tokens[common:], start=common), dtype=np.float32)
        self._held[slot] = list(tokens)
        return logits

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        proposals = [Proposal() for _ in requests]
        active: list[tuple[int, int, DraftRequest, np.ndarray]] = []  # (index, slot, request, logits)
        drafting = 0.0
        for i, request in enumerate(requests):
            slot = self._slot(request.key)
            if slot is None or request.k < 1 or len(request.tokens) + request.k > self._seqs.room:
                continue
            started = time.perf_counter()
            short = len(request.tokens) - len(self._held[slot]) <= 2 * request.k + 2
            active.append((i, slot, request, self._catch_up(slot, request.tokens)))
            if short:
                drafting += time.perf_counter() - started
        started = time.perf_counter()
        draws: dict[int, list[Any]] = {i: [] for i, *_ in active}
        while active:
            fed: list[tuple[int, int, DraftRequest]] = []
            self._seqs.clear()
            for i, slot, request, logits in active:
                token, q = _draw(logits, request)
                proposal = proposals[i]
                proposal.tokens.append(token)
                if q is not None:
                    draws[i].append(q)
                if len(proposal.tokens) < request.k and not self._seqs.is_eog(token):
                    self._seqs.add(token, len(self._held[slot]), slot, True)
                    self._held[slot].append(token)
                    fed.append((i, slot, request))
            if not fed:
                break
            self._seqs.decode()
            active = [(i, slot, req, np.array(self._seqs.logits(row), dtype=np.float32)) for row, (i, slot, req) in enumerate(fed)]
        for i, rows in draws.items():
            if rows:
                import torch

                proposals[i].probs = torch.stack(rows)
        self.last_seconds = drafting + time.perf_counter() - started
        return proposals


def _draw(logits: np.ndarray, request: DraftRequest) -> tuple[int, Any]:
    """The draft's next token: argmax (greedy target) or a sample with the request's settings, and its distribution."""
    if request.temperature <= 0:
        return int(logits.argmax()), None
    import torch

    from ...engine.generate import sampling_probs

    q = sampling_probs(torch.from_numpy(logits), request.temperature, request.top_p)
    return int(torch.multinomial(q, 1, generator=request.generator)), q
