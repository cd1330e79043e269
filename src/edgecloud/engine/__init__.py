"""The torch inference engine: llama/qwen2 model code, GGUF weights, llama.cpp-identical tokenizer.

Both sides run it: the torch edge backend, the Core ML and ONNX exporters, and the cloud
server's scheduler. It depends on :mod:`edgecloud.runtime` only; :mod:`edgecloud.quant` builds
on it (its FP8 layer, :mod:`edgecloud.engine.fp8`, lives here because loading with
``precision="fp8"`` converts the model).

``Transformer.from_gguf(path, precision="fp32"|"bf16"|"fp8")`` loads a model;
``Tokenizer(path)`` its tokenizer and chat template; ``generate`` / ``prefill`` / ``decode_one_token`` run it against an
explicit per-sequence ``KVCache``; ``pack_linears`` switches float32 CPU layers to oneDNN's
prepacked matmuls (fast small batches). Needs torch (``pip install 'edgecloud[cloud]'``).
"""

from __future__ import annotations

from .generate import Tokenizer, decode_one_token, generate, prefill, sample, sampling_probs
from .linear import PackedLinear, pack_linears, packing_supported
from .model import DEFAULT_N_CTX, PRECISIONS, KVCache, ModelArgs, Transformer, fuse_projections, param_bytes
from .weights import GGUFFile, load_state_dict

__all__ = [
    "DEFAULT_N_CTX",
    "PRECISIONS",
    "GGUFFile",
    "KVCache",
    "ModelArgs",
    "PackedLinear",
    "Tokenizer",
    "Transformer",
    "decode_one_token",
    "fuse_projections",
    "generate",
    "load_state_dict",
    "pack_linears",
    "packing_supported",
    "param_bytes",
    "prefill",
    "sample",
    "sampling_probs",
]
