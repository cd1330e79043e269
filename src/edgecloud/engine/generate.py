"""Tokenizing and generating with the torch engine.

This module owns :class:`Tokenizer` and the generation steps, named after what they do:
:func:`prefill` (score a prompt into a KV cache), :func:`decode_one_token` (one new
position), :func:`sample` (greedy or temperature / top-p, from :func:`sampling_probs`) and :func:`generate` (the token
iterator built from them).

Tokenization is llama.cpp's own, loaded vocab-only
(``llama_cpp.Llama(model_path, vocab_only=True)``: ~0.5 s, no weights). Re-implementing the
GGUF BPE/SPM tokenizers (pre-tokenizer regexes per model family, byte fallback, special-token
parsing) would be a large, subtle copy; loading the same code from the same file makes the
engine's tokens identical to the edge backend's *by construction*, which is what
speculative decoding across the two and the parity tests need. Chat prompts are rendered with
:class:`~edgecloud.runtime.chat_template.ChatTemplate` and tokenized with special tokens parsed
and no extra BOS, exactly as llama-cpp-python's ``Jinja2ChatFormatter`` does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..runtime.chat_template import ChatTemplate
from ..runtime.llama_cpp import import_llama_cpp, token_piece
from ..runtime.sampling import GREEDY_BELOW
from ..errors import BackendUnavailableError, ContextOverflowError, InvalidRequestError
from .model import KVCache, Transformer

__all__ = ["Tokenizer", "decode_one_token", "generate", "prefill", "sample", "sampling_probs"]


class Tokenizer:
    """llama.cpp's tokenizer for one GGUF file, plus its chat template and end-of-generation ids."""

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        llama_cpp = import_llama_cpp("the torch engine's tokenizer")
        self.path = Path(model_path)
        try:
            self._llm = llama_cpp.Llama(model_path=str(self.path), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError, OSError) as exc:
            raise BackendUnavailableError(f"llama.cpp could not read the vocabulary of {self.path}: {exc}") from exc
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

    def encode(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special`` parses control tokens such as ``<|im_start|>``."""
        return self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def encode_chat(self, messages: Sequence[dict[str, str]], *, continue_final: bool = False) -> list[int]:
        """The prompt tokens llama.cpp would evaluate for ``messages`` with this file's chat template
        (``continue_final``: the last, assistant, message is continued rather than a new turn opened)."""
        return self.encode(self.chat_template.prompt(messages, continue_final=continue_final))

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
        if llm is not None:
            llm.close()


@torch.inference_mode()
def prefill(model: Transformer, tokens: Sequence[int] | Tensor, cache: KVCache) -> Tensor:
    """Score ``tokens`` after what ``cache`` already holds; returns the last position's logits ``[vocab]``."""
    ids = torch.as_tensor(tokens, dtype=torch.long)
    return model.forward_batch([(ids, None, cache)], last_only=True)[0][0]


@torch.inference_mode()
def decode_one_token(model: Transformer, token: int, cache: KVCache) -> Tensor:
    """Append one token to the sequence in ``cache``; returns the next position's logits ``[vocab]``."""
    return model(torch.tensor([token], dtype=torch.long), None, cache)[0]


def sampling_probs(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """Probabilities over the vocabulary (last dim) after temperature and nucleus (top-p) truncation:
    the distribution :func:`sample` draws from (and speculative verification compares against)."""
    # shift by the maximum first: the top logit maps to 0 and nothing overflows, however small
    # the temperature or extreme the logits (an inf logit would otherwise give inf - inf = NaN)
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)
    probs = torch.softmax((shifted / max(temperature, GREEDY_BELOW)).nan_to_num(nan=float("-inf")), dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
        keep[..., 0] = True  # the top token always stays, whatever top_p (5e-324 is 0 in float32)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(
    logits: Tensor, *, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> int:
    """Next token from ``logits[vocab]``: argmax when ``temperature <= 0``, else temperature + nucleus sampling."""
    if temperature < GREEDY_BELOW:
        return int(logits.argmax())
    return int(torch.multinomial(sampling_probs(logits, temperature, top_p), 1, generator=generator))


def generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt_tokens: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_at_eog: bool = True,
    cache: KVCache | None = None,
) -> Iterator[int]:
    """Yield new token ids one by one; stops after ``max_new_tokens`` or at an end-of-generation token.

    ``cache`` (optional) may already hold a prefix of ``prompt_tokens``' sequence: only the
    tokens after ``cache.length`` are prefilled. Without it a cache just large enough is made.
    """
    if not prompt_tokens:
        raise InvalidRequestError("the prompt has no tokens", param="prompt")
    if max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be at least 1, got {max_new_tokens}", param="max_tokens")
    needed = len(prompt_tokens) + max_new_tokens
    if cache is None:
        if needed > model.args.context_length:
            raise ContextOverflowError(len(prompt_tokens), model.args.context_length, detail=f" (+{max_new_tokens} to generate)")
        cache = model.new_cache(needed)
    elif needed > cache.max_tokens:
        raise ContextOverflowError(len(prompt_tokens), cache.max_tokens, detail=f" (+{max_new_tokens} to generate)")
    if cache.length >= len(prompt_tokens):
        cache.truncate(len(prompt_tokens) - 1)  # re-score the last prompt token to get its logits
    generator = None
    if seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(seed)
    logits = prefill(model, prompt_tokens[cache.length :], cache)
    for step in range(max_new_tokens):
        token = sample(logits.cpu(), temperature=temperature, top_p=top_p, generator=generator)
        if stop_at_eog and tokenizer.is_eog(token):
            return
        yield token
        if step + 1 < max_new_tokens:
            logits = decode_one_token(model, token, cache)
