"""llama.cpp's grammar engine over logits that did not come from llama.cpp (the torch engine).

This module owns :class:`GrammarMask`: the same GBNF grammar (and lazy triggers) the llama.cpp
runtime holds a sequence to (:mod:`edgecloud.runtime.llamacpp_sampler`), applied to a logits
row from any runtime that shares the GGUF's vocabulary: :meth:`GrammarMask.mask` sets every
token the grammar forbids at this point to ``-inf``, :meth:`GrammarMask.accept` advances the
grammar by the token chosen, and :meth:`GrammarMask.greedy` picks the best allowed token the
fast way: the best token is checked alone first (llama.cpp's own common sampler does the same;
most tokens of a call or a JSON answer are the model's first choice), then the
:data:`CANDIDATES` best in one grammar pass, and only when none of those is allowed is the
whole vocabulary masked. The answer is the masked argmax exactly (a candidate is taken only
when its logit beats every token outside the candidates).
One grammar implementation for every engine means a call or a ``json_schema`` answer is
constrained the same way wherever it is written.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import InvalidRequestError
from .sampling import SamplingParams

__all__ = ["GrammarMask", "grammar_stage"]

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
#: Best tokens :meth:`GrammarMask.greedy` checks in one pass when the very best is refused
#: (masking all ~150k tokens of a Qwen vocabulary costs milliseconds a token).
CANDIDATES = 64


def grammar_stage(lib: Any, vocab: Any, params: SamplingParams) -> Any:
    """The grammar stage (a bare llama.cpp sampler; NULL when the grammar does not compile): on from the first token, or lazy (``grammar_triggers``): switched on
    when the output so far matches a trigger, and held from its group 1 on."""
    import ctypes

    text = params.grammar.encode("utf-8") if params.grammar else b""
    if not params.grammar_triggers:
        return lib.llama_sampler_init_grammar(vocab, text, b"root")
    patterns = (ctypes.c_char_p * len(params.grammar_triggers))(*(t.encode("utf-8") for t in params.grammar_triggers))
    return lib.llama_sampler_init_grammar_lazy_patterns(vocab, text, b"root", patterns, len(patterns), None, 0)


class GrammarMask:
    """One sequence's grammar state (``params.grammar``, lazy when ``params.grammar_triggers``)."""

    def __init__(self, lib: Any, vocab: Any, n_vocab: int, params: SamplingParams | None, *, stage: Any = None) -> None:
        self._lib, self._vocab, self._n_vocab = lib, vocab, n_vocab
        self._sampler = stage if stage is not None else grammar_stage(lib, vocab, params)
        if not self._sampler:
            assert params is not None
            raise InvalidRequestError(f"invalid '{params.grammar_param}': llama.cpp could not compile the grammar "
                                      "for this schema; simplify it", param=params.grammar_param)
        self._data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._data["id"] = np.arange(n_vocab, dtype=np.int32)
        self._array = lib.llama_token_data_array(
            data=self._data.ctypes.data_as(ctypes.POINTER(lib.llama_token_data)),
            size=n_vocab, selected=-1, sorted=False)
        self._few = np.zeros(CANDIDATES, dtype=_TOKEN_DATA)
        self._few_array = lib.llama_token_data_array(
            data=self._few.ctypes.data_as(ctypes.POINTER(lib.llama_token_data)), size=1, selected=-1, sorted=False)

    def allowed(self, tokens: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Which of ``tokens`` (at most :data:`CANDIDATES`) the grammar accepts next, in one pass."""
        n = len(tokens)
        self._few["id"][:n], self._few["logit"][:n] = tokens, 0.0
        self._few_array.size, self._few_array.selected, self._few_array.sorted = n, -1, False
        self._lib.llama_sampler_apply(self._sampler, ctypes.byref(self._few_array))
        return np.isfinite(self._few["logit"][:n])

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts ``token`` next (one token checked, not the vocabulary)."""
        return bool(self.allowed(np.array([token]))[0])

    def greedy(self, logits: npt.NDArray[np.float32]) -> int:
        """The most likely token the grammar allows (the lowest id on a tie, as ``argmax``), accepted into it."""
        token = self.best(logits)
        self.accept(token)
        return token

    def best(self, logits: npt.NDArray[np.float32]) -> int:
        """The most likely token the grammar allows next (not accepted)."""
        row = logits[: self._n_vocab]
        token = int(row.argmax())
        if not self.allows(token):
            token = self._best_allowed(row)
        return token

    def fork(self) -> GrammarMask:
        """An independent copy of this grammar state (drafts run ahead on a fork; the original
        stays where the written answer is)."""
        return GrammarMask(self._lib, self._vocab, self._n_vocab, None,
                           stage=self._lib.llama_sampler_clone(self._sampler))

    def _best_allowed(self, row: npt.NDArray[np.float32]) -> int:
        top = np.argpartition(row, -CANDIDATES)[-CANDIDATES:]
        ok = top[self.allowed(top)]
        if len(ok):
            best = ok[row[ok] == row[ok].max()].min()
            # exact only when it beats every token outside the candidates (a tie there may be
            # allowed and have a lower id)
            if row[best] > row[top].min():
                return int(best)
        return int(self.mask(row).argmax())

    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """``logits`` (one row over the vocabulary) with the tokens the grammar forbids at ``-inf``."""
        self._data["logit"] = logits[: self._n_vocab]
        self._array.size, self._array.selected, self._array.sorted = self._n_vocab, -1, False
        self._lib.llama_sampler_apply(self._sampler, ctypes.byref(self._array))
        return self._data["logit"].copy()

    def accept(self, token: int) -> None:
        """Advance the grammar by the token the sequence took."""
        self._lib.llama_sampler_accept(self._sampler, token)

    def close(self) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler:
            self._lib.llama_sampler_free(sampler)

    def __del__(self) -> None:
        self.close()
