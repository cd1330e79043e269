"""llama.cpp's grammar engine over logits that did not come from llama.cpp (the torch engine).

This module owns :class:`GrammarMask`: the same GBNF grammar (and lazy triggers) the llama.cpp
runtime holds a sequence to (:mod:`edgecloud.runtime.llamacpp_sampler`), applied to a logits
row from any runtime that shares the GGUF's vocabulary: :meth:`GrammarMask.mask` sets every
token the grammar forbids at this point to ``-inf``, :meth:`GrammarMask.accept` advances the
grammar by the token chosen, and :meth:`GrammarMask.greedy` picks the best allowed token the
fast way: the best token is checked alone first, and only when the grammar refuses it is the
whole vocabulary masked (llama.cpp's own common sampler does the same; for greedy decoding the
answer is identical, and most tokens of a call or a JSON answer are the model's first choice).
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

    def __init__(self, lib: Any, vocab: Any, n_vocab: int, params: SamplingParams) -> None:
        self._lib, self._n_vocab = lib, n_vocab
        self._sampler = grammar_stage(lib, vocab, params)
        if not self._sampler:
            raise InvalidRequestError(f"invalid '{params.grammar_param}': llama.cpp could not compile the grammar "
                                      "for this schema; simplify it", param=params.grammar_param)
        self._data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._data["id"] = np.arange(n_vocab, dtype=np.int32)
        self._array = lib.llama_token_data_array(
            data=self._data.ctypes.data_as(ctypes.POINTER(lib.llama_token_data)),
            size=n_vocab, selected=-1, sorted=False)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        self._one_array = lib.llama_token_data_array(
            data=self._one.ctypes.data_as(ctypes.POINTER(lib.llama_token_data)), size=1, selected=-1, sorted=False)

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts ``token`` next (one token checked, not the vocabulary)."""
        self._one["id"], self._one["logit"] = token, 0.0
        self._one_array.size, self._one_array.selected, self._one_array.sorted = 1, -1, False
        self._lib.llama_sampler_apply(self._sampler, ctypes.byref(self._one_array))
        return bool(np.isfinite(self._one["logit"][0]))

    def greedy(self, logits: npt.NDArray[np.float32]) -> int:
        """The most likely token the grammar allows, accepted into it."""
        token = int(logits.argmax())
        if not self.allows(token):
            token = int(self.mask(logits).argmax())
        self.accept(token)
        return token

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
