"""The torch inference engine: llama/qwen2 model code, GGUF weights, llama.cpp-identical tokenizer.

``Transformer.from_gguf(path, precision="fp32"|"bf16"|"fp8")`` loads a model;
``Tokenizer(path)`` its tokenizer and chat template; ``generate`` / ``prefill`` / ``decode_one_token`` run it against an
explicit per-sequence ``KVCache``. Needs torch (``pip install 'edgecloud[cloud]'``).
"""

from __future__ import annotations

from .generate import Tokenizer, decode_one_token, generate, prefill, sample
from .model import PRECISIONS, KVCache, ModelArgs, Transformer, param_bytes
from .weights import GGUFFile, load_state_dict

__all__ = [
    "PRECISIONS",
    "GGUFFile",
    "KVCache",
    "ModelArgs",
    "Tokenizer",
    "Transformer",
    "decode_one_token",
    "generate",
    "load_state_dict",
    "param_bytes",
    "prefill",
    "sample",
]
