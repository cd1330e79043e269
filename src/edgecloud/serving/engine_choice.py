"""Which engine ``edgecloud serve --engine auto`` runs, and at what precision, with the reason said.

This module owns :func:`choose_engine` and :func:`choose_precision`. The rules come from
``benchmarks/serving.py`` (every engine on the same prompts in one run, figures in the README):

- an NVIDIA GPU with vLLM installed: **vLLM** (paged attention, CUDA graphs, tensor
  parallelism: the engine to scale out with);
- an NVIDIA GPU without vLLM: the **torch** engine, FP8 where the GPU multiplies in FP8 and the
  model passes the start-up self-check (:mod:`edgecloud.serving.fp8_check`), else bf16;
- a CPU only: the engine expected to make the most tokens/s at the load the server is sized
  for (``--max-batch`` when given, else one user), from :data:`CPU_TOKENS_PER_S`, measured with
  the 0.5B model on this project's 2-core AVX-512 machine (``benchmarks/serving.py
  --interleave``, fresh prompts, 64 tokens, medians of 4 runs). The **llama.cpp** engine (the
  GGUF's own INT4 weights) makes one stream 2.2x vLLM CPU bf16's tokens/s in 11 % of its memory,
  ready in 3 s; at 8 streams it makes 0.69x vLLM, where the **torch** engine in bf16 makes 0.97x
  (0.90x at 16) in 24 % of vLLM's memory. Eight prompts at once wait for llama.cpp's prefill, and
  its batched INT4 kernels gain less from a batch than bf16 GEMMs, so INT4's quarter of the bytes
  wins for one or two streams and not for three or more. The torch engine is weighed only where
  torch is installed.

Options steer the choice: an option the preferred engine does not take (``--quant fp32`` for
llama.cpp, which serves the file's own weights) picks the next engine that takes it, and the
reason says so.

A GGUF model always works with the llama.cpp and torch engines; vLLM gets a converted
checkpoint (:mod:`edgecloud.store.convert`).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

from ..runtime.hardware import cpu_has_bf16, nvidia_gpus

__all__ = ["CPU_TOKENS_PER_S", "EngineChoice", "choose_engine", "choose_precision", "expected_tokens_per_s"]


@dataclass(frozen=True)
class EngineChoice:
    """An engine and why it was chosen (said at start-up)."""

    engine: str
    reason: str


#: Aggregate tokens/s by concurrent streams on a CPU, the 0.5B model, measured on this project's
#: 2-core AVX-512 machine (``benchmarks/serving.py --interleave``, medians of 4 runs;
#: ``benchmarks/results/serving.json``). vLLM's CPU build made 16.1 / 88.5 / 124.8 there, in
#: 10 GB and 125 s of start-up: ``auto`` leaves it to ``--engine vllm``.
CPU_TOKENS_PER_S: dict[str, dict[int, float]] = {
    "llamacpp": {1: 35.7, 8: 61.3, 16: 74.2},
    "torch bf16": {1: 13.6, 8: 86.2, 16: 112.2},
    "torch fp32": {1: 8.3, 8: 53.3, 16: 73.9},
}


def expected_tokens_per_s(measured: dict[int, float], streams: int) -> float:
    """Tokens/s at ``streams`` concurrent streams, interpolated between the measured levels in
    log(streams) (flat beyond the ends)."""
    levels = sorted(measured)
    if streams <= levels[0]:
        return measured[levels[0]]
    for low, high in zip(levels, levels[1:]):
        if streams <= high:
            share = (math.log(streams) - math.log(low)) / (math.log(high) - math.log(low))
            return measured[low] + share * (measured[high] - measured[low])
    return measured[levels[-1]]


def choose_engine(*, vllm_version: str | None, vllm_on_cpu: bool, streams: int | None = None,
                  refuses: Callable[[str], list[str]] | None = None, quant: str | None = None,
                  torch_installed: bool | None = None) -> EngineChoice:
    """The engine for this machine (see the module docstring), said with the figures it was chosen by.

    ``vllm_version``: the vLLM found (None: none); ``vllm_on_cpu``: whether it would run on the
    CPU; ``streams``: the load expected (``--max-batch`` when given; None: one user); ``refuses``:
    the options given that an engine does not take (an engine that refuses one is passed over,
    and the reason says so); ``quant``: ``--quant`` when given."""
    gpus = nvidia_gpus()
    refuses = refuses or (lambda engine: [])
    if torch_installed is None:
        torch_installed = importlib.util.find_spec("torch") is not None
    if gpus:
        names = ", ".join(sorted({g.name for g in gpus}))
        ranked = []
        if vllm_version is not None and not vllm_on_cpu:
            ranked.append(EngineChoice("vllm", f"vLLM {vllm_version} is installed and {len(gpus)} NVIDIA GPU(s) "
                                               f"({names}) are here"))
        ranked.append(EngineChoice("torch", f"an NVIDIA GPU ({gpus[0].name})" + (
            "" if ranked else " and no CUDA vLLM: the torch engine on CUDA (pip install 'edgecloud[vllm]' to scale "
                              "out with vLLM)")))
        return _first_taking_the_options(ranked, refuses)
    load = streams or 1
    torch_figures = "torch fp32" if quant == "fp32" or (quant in (None, "auto") and not cpu_has_bf16()) else "torch bf16"
    candidates = {"llamacpp": expected_tokens_per_s(CPU_TOKENS_PER_S["llamacpp"], load)}
    if torch_installed:
        candidates["torch"] = expected_tokens_per_s(CPU_TOKENS_PER_S[torch_figures], load)
    said = {"llamacpp": "llama.cpp (INT4)", "torch": f"torch ({torch_figures.split()[1]})"}
    figures = ", ".join(f"{said[name]} ~{rate:.0f}" for name, rate in candidates.items())
    expected = (f"{load} concurrent stream{'s' if load != 1 else ''} ("
                f"{'--max-batch' if streams else 'one user: --max-batch N says more'}); measured tokens/s there on a "
                f"2-core AVX-512 CPU, 0.5B model: {figures}")
    found = f"; vLLM {vllm_version} is installed too (--engine vllm)" if vllm_version else ""
    if not torch_installed:
        found += "; the torch engine (pip install 'edgecloud[cloud]') would be weighed too"
    ranked = [EngineChoice(name, f"CPU only, expecting {expected}{found}")
              for name in sorted(candidates, key=lambda n: -candidates[n])]
    return _first_taking_the_options(ranked, refuses)


def _first_taking_the_options(ranked: list[EngineChoice], refuses: Callable[[str], list[str]]) -> EngineChoice:
    """The first of ``ranked`` that takes every option given; the reason says which it passed over."""
    passed_over: list[str] = []
    for choice in ranked:
        refused = refuses(choice.engine)
        if refused:
            passed_over.append(f"{', '.join(refused)} does not apply to {choice.engine}")
            continue
        if not passed_over:
            return choice
        return EngineChoice(choice.engine, f"{'; '.join(passed_over)}, so {choice.engine}, which takes it ({choice.reason})")
    return ranked[0]


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
