"""The torch inference engine: llama/qwen2 model code, GGUF weights, llama.cpp-identical tokenizer.

``Transformer.from_gguf(path, precision="fp32"|"bf16"|"fp8")`` loads a model;
``Tokenizer(path)`` its tokenizer and chat template; ``generate`` / ``prefill`` / ``decode_one_token`` run it against an
explicit per-sequence ``KVCache``; ``pack_linears`` switches float32 CPU layers to oneDNN's
prepacked matmuls (fast small batches). Needs torch (``pip install 'edgecloud[cloud]'``).
"""

from __future__ import annotations

from .generate import Tokenizer, decode_one_token, generate, prefill, sample, sampling_probs
from .linear import PackedLinear, pack_linears, packing_supported
from .model import PRECISIONS, KVCache, ModelArgs, Transformer, param_bytes
from .weights import GGUFFile, load_state_dict

__all__ = [
    "PRECISIONS",
    "GGUFFile",
    "KVCache",
    "ModelArgs",
    "PackedLinear",
    "Tokenizer",
    "Transformer",
    "decode_one_token",
    "generate",
    "load_state_dict",
    "pack_linears",
    "packing_supported",
    "param_bytes",
    "prefill",
    "sample",
    "sampling_probs",
]
