"""Checks held to a grammar: tool calls and structured output written by both sides of verified mode.

This module owns :class:`HeldGrammar` (the grammar an answer is held to, as a check carries it:
the request fields it comes from — ``tools``, ``tool_choice``, ``response_format`` — and the
sequence position where the answer starts; each side derives the GBNF text and the lazy triggers
of ``tool_choice: "auto"`` from them as it does for a chat request, so no grammar or regular
expression from the wire reaches llama.cpp unchecked) and :class:`HeldPicker` (one side's grammar state with its picks: the best token
the grammar allows next, or the coupled draw among the allowed ones; each pick advances the
grammar). The edge drafts with a picker (a fork of the written answer's state, so drafts run
ahead and are thrown away on a rejection); the server replays the answer so far into a fresh
picker and picks at each checked position, so the call or the JSON is the cloud's own
constrained answer — the same tokens the cloud writes alone under that grammar.

The grammar is llama.cpp's (:class:`~edgecloud.runtime.grammar_mask.GrammarMask`), so both sides
need the GGUF vocabulary (the llama.cpp edge; either ``edgecloud serve`` engine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from ..errors import InvalidRequestError
from .coupling import Coupling
from .grammar_mask import GrammarMask
from .sampling import SamplingParams, sampling_params

__all__ = ["GRAMMAR_FIELDS", "WIRE_FIELDS", "HeldGrammar", "HeldPicker", "held_picker"]


#: The chat request fields a grammar is derived from.
GRAMMAR_FIELDS = ("tools", "tool_choice", "response_format")
#: The request fields a grammar-held check carries (:meth:`HeldGrammar.wire`).
WIRE_FIELDS = ("grammar", "grammar_from")


@dataclass(frozen=True)
class HeldGrammar:
    """The grammar an answer is held to (see the module docstring)."""

    #: The request fields it comes from (:data:`GRAMMAR_FIELDS`), as JSON.
    spec: dict[str, Any]
    #: The sequence position of the answer's first token (what precedes it is the prompt).
    start: int = 0

    def params(self) -> SamplingParams:
        """Sampling parameters that carry this grammar (what a grammar state is built from): the
        grammar a chat request with these fields is held to. Bad fields are a 400 naming ``grammar``."""
        from ..types import ChatRequest

        try:
            chat = ChatRequest(messages=[{"role": "user", "content": "."}], **self.spec)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"invalid 'grammar': {exc}", param="grammar") from exc
        params = sampling_params(chat, 1, logit_bias=True, grammar=True)
        if params.grammar is None:
            raise InvalidRequestError("grammar names no tools to call and no JSON response_format",
                                      param="grammar")
        return dataclasses.replace(params, grammar_param="grammar")

    def wire(self) -> dict[str, Any]:
        """The request fields that ask a server to check under this grammar."""
        return {"grammar": self.spec, "grammar_from": self.start}

    @classmethod
    def of(cls, request: Any, start: int) -> HeldGrammar | None:
        """The grammar a chat request's answer is held to (its ``response_format`` json or its
        tools), or None; ``start``: the position of the answer's first token."""
        if sampling_params(request, 1, logit_bias=True, grammar=True).grammar is None:
            return None
        spec = request.model_dump(include=set(GRAMMAR_FIELDS), exclude_none=True)
        return cls(spec, start)


class HeldPicker:
    """One side's grammar state and its picks (see the module docstring). ``coupling``: picks are
    the coupled draws among the allowed tokens (None: the best allowed token)."""

    def __init__(self, mask: GrammarMask, coupling: Coupling | None = None) -> None:
        self.mask, self.coupling = mask, coupling
        #: Set once a checked position disagreed with the draft: the picks after it are not asked.
        self.stopped = False

    def choose(self, logits: npt.NDArray[Any], position: int) -> int:
        """The token this side writes at ``position`` under the grammar (not accepted yet)."""
        if self.coupling is None or (self.coupling.greedy and not self.coupling.bias):
            return self.mask.best(logits)
        return self.coupling.pick(self.mask.mask(logits), position)

    def pick(self, logits: npt.NDArray[Any], position: int) -> int:
        """:meth:`choose`, accepted into the grammar (the drafting side's picker)."""
        token = self.choose(logits, position)
        self.mask.accept(token)
        return token

    def accept(self, token: int) -> None:
        """The answer took ``token`` (one the grammar allows)."""
        self.mask.accept(token)

    def replay(self, tokens: list[int], at: int) -> None:
        """Advance through the answer so far (``tokens``, the first at sequence position ``at``);
        a token the grammar does not allow is refused (a 400 naming ``grammar_from``), never fed
        to llama.cpp's grammar (which would abort the process)."""
        for i, token in enumerate(tokens):
            if not self.mask.allows(token):
                raise InvalidRequestError(f"token {token} at position {at + i} does not match the grammar; the "
                                          "answer must follow it from grammar_from on", param="grammar_from")
            self.mask.accept(token)

    def fork(self) -> HeldPicker:
        """An independent copy (drafts run ahead on it)."""
        return HeldPicker(self.mask.fork(), self.coupling)

    def close(self) -> None:
        self.mask.close()


def held_picker(mask_of: Callable[[SamplingParams], GrammarMask], grammar: HeldGrammar | None,
                coupling: Coupling | None, tokens: Sequence[int], start: int) -> HeldPicker | None:
    """A server's picker for a check held to ``grammar`` (None: not held): a fresh grammar state
    (``mask_of`` compiles it for the model's vocabulary) replayed through the answer up to the
    first checked position ``start``. Bad input is a 400 naming the field."""
    if grammar is None:
        return None
    if not 0 <= grammar.start <= start:
        raise InvalidRequestError(f"grammar_from={grammar.start} must be at most score_from={start} (the answer "
                                  "starts before the first checked token)", param="grammar_from")
    picker = HeldPicker(mask_of(grammar.params()), coupling)
    try:
        picker.replay(list(tokens[grammar.start:start]), grammar.start)
    except BaseException:
        picker.close()
        raise
    return picker
