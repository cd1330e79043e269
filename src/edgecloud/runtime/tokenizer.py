"""llama.cpp's tokenizer and chat template for a GGUF file, for the runtimes that do not decode with llama.cpp's own loop.

This module owns :class:`Tokenizer`. Tokenization is llama.cpp's own, loaded vocab-only
(``llama_cpp.Llama(model_path, vocab_only=True)``: ~0.5 s, no weights). Re-implementing the
GGUF BPE/SPM tokenizers (pre-tokenizer regexes per model family, byte fallback, special-token
parsing) would be a large, subtle copy; loading the same code from the same file makes the
engine's tokens identical to the edge backend's *by construction*, which is what
speculative decoding across the two and the parity tests need. Chat prompts are rendered with
:class:`~edgecloud.runtime.chat_template.ChatTemplate` and tokenized with special tokens parsed
and no extra BOS, exactly as llama-cpp-python's ``Jinja2ChatFormatter`` does.
Users: the torch engine (both sides), the Core ML and ONNX exporters, and the llama.cpp serving
engine (which wraps the ``Llama`` object it decodes with instead of loading the vocabulary twice).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailableError, InvalidRequestError
from .chat_template import ChatTemplate
from .llama_cpp import import_llama_cpp, token_piece

__all__ = ["Tokenizer"]


class Tokenizer:
    """llama.cpp's tokenizer for one GGUF file, plus its chat template and end-of-generation ids.

    Loads the file vocab-only, or wraps ``llm``, a ``llama_cpp.Llama`` the caller already has
    (whose lifetime stays the caller's).
    """

    def __init__(self, model_path: str | os.PathLike[str], *, llm: Any = None) -> None:
        llama_cpp = import_llama_cpp("the tokenizer")
        self.path = Path(model_path)
        #: Whether :meth:`close` frees the ``Llama`` object (not when the caller lent its own).
        self._owned = llm is None
        if llm is None:
            try:
                llm = llama_cpp.Llama(model_path=str(self.path), vocab_only=True, verbose=False)
            except (ValueError, RuntimeError, OSError) as exc:
                raise BackendUnavailableError(f"llama.cpp could not read the vocabulary of {self.path}: {exc}") from exc
        self._llm = llm
        self._lib = llama_cpp
        self._vocab = self._llm._model.vocab
        self.vocab_size: int = self._llm.n_vocab()
        self.bos_id: int = self._llm.token_bos()
        self.eos_id: int = self._llm.token_eos()
        #: Every id llama.cpp treats as end of generation (eos, eot, <|im_end|>, <|endoftext|>, ...).
        self.eog_ids: frozenset[int] = frozenset(
            i for i in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(self._vocab, i)
        )
        self.metadata: dict[str, Any] = dict(self._llm.metadata)
        self.chat_template = ChatTemplate.from_gguf_metadata(
            self.metadata,
            bos_token=self.token_text(self.bos_id) if self.bos_id != -1 else "",
            eos_token=self.token_text(self.eos_id) if self.eos_id != -1 else "",
        )
        self._pieces: dict[int, bytes] = {}

    def grammar_mask(self, params: Any) -> Any:
        """A :class:`~edgecloud.runtime.grammar_mask.GrammarMask` for ``params.grammar`` over this
        vocabulary (InvalidRequestError when llama.cpp cannot compile it)."""
        from .grammar_mask import GrammarMask

        return GrammarMask(self._lib, self._vocab, self.vocab_size, params)

    def encode(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special`` parses control tokens such as ``<|im_start|>``."""
        return self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], *, continue_final: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt tokens llama.cpp would evaluate for ``messages`` with this file's chat template
        (``continue_final``: the last, assistant, message is continued rather than a new turn opened;
        ``tools``: the functions offered)."""
        return self.encode(self.chat_template.prompt(messages, continue_final=continue_final, tools=tools))

    def encode_request(self, request: Any) -> list[int]:
        """The prompt tokens of a :class:`~edgecloud.types.ChatRequest`: its messages, its tools,
        a new assistant turn or its last message continued."""
        return self.encode_chat(request.message_dicts(), continue_final=request.continue_final_message,
                                tools=request.tool_dicts())

    def decode(self, tokens: Sequence[int], *, special: bool = True) -> bytes:
        """The bytes of ``tokens`` (may end inside a UTF-8 character; decode with care when streaming)."""
        return b"".join(self.token_to_piece(t, special=special) for t in tokens)

    def token_to_piece(self, token: int, *, special: bool = True) -> bytes:
        """The bytes one token stands for (control tokens render as their text when ``special``)."""
        if not 0 <= token < self.vocab_size:
            raise InvalidRequestError(f"token id {token} is outside the vocabulary (0..{self.vocab_size - 1})")
        key = token if special else -1 - token
        piece = self._pieces.get(key)
        if piece is None:
            piece = self._pieces[key] = token_piece(self._lib, self._vocab, token, special=special)
        return piece

    def token_text(self, token: int) -> str:
        """The vocabulary entry of ``token`` as stored in the file (e.g. ``"<|im_end|>"``)."""
        return self._llm._model.token_get_text(token)

    def is_eog(self, token: int) -> bool:
        """Whether generation should stop at ``token``."""
        return token in self.eog_ids

    def close(self) -> None:
        """Free llama.cpp's vocabulary."""
        llm, self._llm = self._llm, None
        if llm is not None and self._owned:
            llm.close()
