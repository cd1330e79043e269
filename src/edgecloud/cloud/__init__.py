"""The cloud side of edgecloud: what a team self-hosts behind an OpenAI-compatible URL.

``engine/`` (torch model code, weights from GGUF, tokenizer identical to llama.cpp's, an
explicit per-sequence KV cache) comes first; the scheduler, the HTTP server and the HTTP
client build on it. Nothing here is imported by ``import edgecloud``: torch is an optional
dependency (the ``cloud`` extra).
"""
