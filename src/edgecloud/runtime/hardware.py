"""What this machine computes with, read without importing torch: NVIDIA GPUs and the CPU's number formats.

This module owns :func:`nvidia_gpus` (``nvidia-smi``'s view: name, free memory, compute
capability) and :func:`cpu_flags` / :func:`cpu_has_bf16`. The edge's memory planner asks for
free GPU memory, and ``edgecloud serve --engine auto`` for what the machine can run fast (a
CUDA GPU for vLLM or FP8, a CPU with bfloat16 dot products for the torch engine), before any
framework is loaded: importing torch to find out costs a llama.cpp process ~180 MiB.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass

__all__ = ["GPU", "cpu_flags", "cpu_has_bf16", "nvidia_gpus"]


@dataclass(frozen=True)
class GPU:
    """One NVIDIA GPU as ``nvidia-smi`` reports it."""

    name: str
    free_bytes: int
    #: ``(major, minor)``, e.g. ``(9, 0)`` for Hopper; ``(0, 0)`` when the driver did not say.
    compute_capability: tuple[int, int]


def nvidia_gpus() -> list[GPU]:
    """The NVIDIA GPUs ``nvidia-smi`` lists (none when there is no driver or no GPU)."""
    if not os.path.exists("/proc/driver/nvidia/gpus") and shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.free,compute_cap", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2:
            continue
        try:
            free = int(float(parts[1]) * 2**20)
        except ValueError:
            continue
        major, _, minor = (parts[2] if len(parts) > 2 else "").partition(".")
        capability = (int(major), int(minor or 0)) if major.isdigit() and (minor or "0").isdigit() else (0, 0)
        gpus.append(GPU(name=parts[0], free_bytes=free, compute_capability=capability))
    return gpus


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags ``/proc/cpuinfo`` lists (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_signature() -> str:
    """A short, stable name for this CPU's model and feature flags (results measured on one CPU,
    such as which kernels round alike, are kept under it)."""
    import hashlib
    import platform

    return hashlib.sha256((platform.machine() + " " + " ".join(sorted(cpu_flags()))).encode()).hexdigest()[:16]


def cpu_has_bf16() -> bool:
    """Whether the CPU has bfloat16 dot products (AVX-512 BF16, AMX BF16, or Arm's BF16)."""
    flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & flags)
