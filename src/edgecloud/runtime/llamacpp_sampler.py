"""llama.cpp sampler chains from :class:`~edgecloud.runtime.sampling.SamplingParams`.

This module owns :func:`make_sampler`, the one translation from a request's sampling options to
a llama.cpp sampler chain, used by the edge's :class:`~edgecloud.edge.llamacpp.LlamaCppBackend`
(one context, one sequence) and the serving engine
(:mod:`edgecloud.serving.llamacpp_engine`, one chain per sequence of a batch). Plain greedy
decoding gets no chain at all: an ``argmax`` over the logits is cheaper than a sampler call.

The chain's order is llama.cpp's: penalties, logit bias, grammar, then temperature / top-p and
the seeded distribution (or greedy). ``llama_sampler_sample(chain, ctx, i)`` samples from batch
row ``i``'s logits and accepts the token into every stage (penalty history, grammar state).
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequestError
from .grammar_mask import GrammarMask, grammar_stage
from .held import HeldPicker
from .sampling import PENALTY_LAST_N, SamplingParams, check_logit_bias

__all__ = ["CoupledSampler", "GreedyGrammarSampler", "grammar_stage", "make_sampler", "needs_sampler"]


class GreedyGrammarSampler:
    """Greedy decoding held to a grammar, the fast way (:meth:`GrammarMask.greedy
    <edgecloud.runtime.grammar_mask.GrammarMask.greedy>`): what :func:`make_sampler` gives for a
    grammar with no other sampling option. :meth:`sample` reads a llama.cpp context's row as a
    ``LlamaSampler`` does; :meth:`pick` takes the row's logits."""

    def __init__(self, lib: Any, vocab: Any, n_vocab: int, params: SamplingParams) -> None:
        self._lib, self._n_vocab = lib, n_vocab
        self.mask = GrammarMask(lib, vocab, n_vocab, params)

    def pick(self, logits: Any) -> int:
        return self.mask.greedy(logits)

    def sample(self, ctx: Any, idx: int = -1) -> int:
        import numpy as np

        raw = self._lib.llama_get_logits_ith(ctx.ctx, idx)
        return self.pick(np.ctypeslib.as_array(raw, shape=(self._n_vocab,)))

    def close(self) -> None:
        self.mask.close()


class CoupledSampler:
    """Sampling with the shared-noise scheme (:class:`~edgecloud.runtime.coupling.Coupling`): what
    the serving engine samples with (:func:`make_sampler` with ``coupled``), so that a request's
    ``seed`` gives the same text asked of the cloud alone and verified with an edge.
    :meth:`pick` takes a logits row and the position of the token it predicts. ``mask``: the
    draws are held to a grammar (a tool call, ``response_format``), as verified checks hold them."""

    def __init__(self, params: SamplingParams, mask: GrammarMask | None = None) -> None:
        self.coupling = params.coupling()
        self._held = HeldPicker(mask, self.coupling) if mask is not None else None

    def pick(self, logits: Any, position: int) -> int:
        if self._held is not None:
            return self._held.pick(logits, position)
        return self.coupling.pick(logits, position)

    def close(self) -> None:
        if self._held is not None:
            self._held.close()


def needs_sampler(params: SamplingParams) -> bool:
    """Whether ``params`` need a sampler chain (anything but plain greedy)."""
    return not (params.greedy and not params.penalised and not params.logit_bias and params.grammar is None)


def make_sampler(lib: Any, vocab: Any, n_vocab: int, params: SamplingParams, *, coupled: bool = False) -> Any:
    """A llama.cpp sampler chain for ``params`` (a ``LlamaSampler``; ``close()`` it), or None for
    plain greedy. ``coupled``: a request that samples without penalties or a grammar gets a
    :class:`CoupledSampler` instead (the serving engine). Raises
    :class:`~edgecloud.errors.InvalidRequestError` for a ``logit_bias`` token outside the
    vocabulary and a grammar llama.cpp cannot compile (``response_format``)."""
    if not needs_sampler(params):
        return None
    if params.grammar is not None and params.greedy and not params.penalised and not params.logit_bias:
        return GreedyGrammarSampler(lib, vocab, n_vocab, params)
    check_logit_bias(params, n_vocab)
    if coupled and not params.greedy and not params.penalised:
        return CoupledSampler(params, GrammarMask(lib, vocab, n_vocab, params) if params.grammar is not None else None)
    from llama_cpp._internals import LlamaSampler

    sampler = LlamaSampler()
    presence, frequency = params.presence_penalty, params.frequency_penalty
    if presence or frequency:
        sampler.add_penalties(n_vocab, PENALTY_LAST_N, 1.0, frequency, presence)
    if params.logit_bias:
        sampler.add_logit_bias(n_vocab, dict(params.logit_bias))
    if params.grammar is not None:
        grammar = grammar_stage(lib, vocab, params)
        if not grammar:
            sampler.close()
            raise InvalidRequestError(f"invalid '{params.grammar_param}': llama.cpp could not compile the grammar "
                                      "for this schema; simplify it", param=params.grammar_param)
        lib.llama_sampler_chain_add(sampler.sampler, grammar)
    if params.temperature == 0.0:
        sampler.add_greedy()
        return sampler
    sampler.add_temp(params.temperature)
    if params.top_k > 0:
        sampler.add_top_k(params.top_k)
    if params.top_p < 1.0:
        sampler.add_top_p(params.top_p, 1)
    if params.min_p > 0.0:
        sampler.add_min_p(params.min_p, 1)
    if params.seed is None:
        seed = lib.LLAMA_DEFAULT_SEED  # llama.cpp draws a random seed
    else:
        seed = params.seed & 0xFFFFFFFF
        if seed == lib.LLAMA_DEFAULT_SEED:
            seed -= 1  # that value means "random" to llama.cpp
    sampler.add_dist(seed)
    return sampler
