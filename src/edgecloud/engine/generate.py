"""Tokenizing and generating with the torch engine.

This module owns the generation steps, named after what they do:
:func:`prefill` (score a prompt into a KV cache), :func:`decode_one_token` (one new
position), :func:`sample` (greedy or temperature / top-p, from :func:`sampling_probs`) and :func:`generate` (the token
iterator built from them).

Tokenization is :class:`~edgecloud.runtime.tokenizer.Tokenizer` (llama.cpp's own; re-exported here).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from ..runtime.tokenizer import Tokenizer
from ..runtime.sampling import GREEDY_BELOW, sampling_distribution
from ..errors import ContextOverflowError, InvalidRequestError
from .model import KVCache, Transformer

__all__ = ["Tokenizer", "decode_one_token", "generate", "prefill", "sample", "sampling_probs"]


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
    """:func:`~edgecloud.runtime.sampling.sampling_distribution` of a logits tensor, as a float32
    tensor on the logits' device (what speculative verification compares draft and target by)."""
    probs = sampling_distribution(logits.detach().float().cpu().numpy(), temperature, top_p)
    return torch.from_numpy(probs.astype(np.float32)).to(logits.device)


def sample(
    logits: Tensor, *, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> int:
    """Next token from ``logits[vocab]``: argmax when ``temperature <= 0``, else a draw from
    :func:`sampling_probs` (with ``generator`` when given: a seeded torch stream)."""
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
