"""Which engine ``edgecloud serve --engine auto`` runs, and at what precision, with the reason said.

This module owns :func:`choose_engine` and :func:`choose_precision`. The rules come from
``benchmarks/serving.py`` (every engine on the same prompts in one run, figures in the README):

- an NVIDIA GPU with vLLM installed: **vLLM** (paged attention, CUDA graphs, tensor
  parallelism: the engine to scale out with);
- an NVIDIA GPU without vLLM: the **torch** engine, FP8 where the GPU multiplies in FP8 and the
  model passes the start-up self-check (:mod:`edgecloud.serving.fp8_check`), else bf16;
- a CPU only: the **llama.cpp** engine, serving the GGUF's own INT4 weights with continuous
  batching, and the engine here that answers everything the API has (logprobs, penalties,
  ``logit_bias`` and scoring for the verified collaboration mode, which the torch engine lacks;
  both hold ``response_format`` and tool calls to their grammars).
  Measured with the 0.5B model on this project's 2-core AVX-512 machine (``benchmarks/serving.py
  --interleave``, fresh prompts, 64 tokens, medians of 4 runs): one stream at 2.2x vLLM CPU
  bf16's tokens/s, 11 % of its peak memory, ready in 3 s against 125 s; at 8 streams 0.69x
  vLLM, where our torch engine in bf16 makes 0.97x (0.90x at 16 streams) in 24 % of vLLM's
  memory: ``--engine torch`` for batch-heavy loads. Eight prompts at once wait for llama.cpp's
  prefill (about 200 tokens/s on the shipped Q4_K_M file), and its batched INT4 kernels gain
  less from a batch than bf16 GEMMs, so INT4's quarter of the bytes wins for one stream and
  not for eight.

A GGUF model always works with the llama.cpp and torch engines; vLLM gets a converted
checkpoint (:mod:`edgecloud.store.convert`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.hardware import cpu_has_bf16, nvidia_gpus

__all__ = ["EngineChoice", "choose_engine", "choose_precision"]


@dataclass(frozen=True)
class EngineChoice:
    """An engine and why it was chosen (said at start-up)."""

    engine: str
    reason: str


def choose_engine(*, vllm_version: str | None, vllm_on_cpu: bool) -> EngineChoice:
    """The engine for this machine (see the module docstring). ``vllm_version``: the vLLM found
    (None: none), ``vllm_on_cpu``: whether that vLLM would run on the CPU."""
    gpus = nvidia_gpus()
    if gpus and vllm_version is not None and not vllm_on_cpu:
        names = ", ".join(sorted({g.name for g in gpus}))
        return EngineChoice("vllm", f"vLLM {vllm_version} is installed and {len(gpus)} NVIDIA GPU(s) ({names}) are here")
    if gpus:
        return EngineChoice("torch", f"an NVIDIA GPU ({gpus[0].name}) and no CUDA vLLM: the torch engine on CUDA "
                                     "(pip install 'edgecloud[vllm]' to scale out with vLLM)")
    found = f"; vLLM {vllm_version} is installed too (--engine vllm)" if vllm_version else ""
    return EngineChoice("llamacpp", "CPU only: the llama.cpp engine serves the GGUF's INT4 weights with continuous "
                                    "batching and every API feature (fastest single stream, least memory, starts in "
                                    f"seconds; --engine torch for the most tokens/s at 8+ streams){found}")


def choose_precision(requested: str) -> tuple[str, str, str]:
    """``(device, precision, reason)`` for the torch engine, from what torch sees. ``auto``:
    ``fp8-checked`` (FP8 if the engine's start-up self-check passes, else bf16) on CUDA GPUs that
    multiply in FP8 (compute capability 8.9+), bf16 on other CUDA GPUs and on CPUs where oneDNN
    computes in bfloat16, else fp32."""
    import torch

    from ..engine.linear import packing_supported

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if requested != "auto":
        return device, requested, f"--quant {requested}"
    if device == "cuda":
        name, capability = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
        if capability >= (8, 9):
            return device, "fp8-checked", f"{name} multiplies in FP8: FP8 weights if they pass the self-check"
        return device, "bf16", f"{name} has no FP8 matmuls (compute capability {capability[0]}.{capability[1]} < 8.9): bf16"
    if cpu_has_bf16() and packing_supported(torch.bfloat16):
        return device, "bf16", "the CPU has bfloat16 dot products: oneDNN-packed bf16 linears"
    return device, "fp32", "the CPU has no bfloat16 dot products: fp32"
