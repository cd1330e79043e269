"""What this machine computes with, read without importing torch: NVIDIA GPUs and the CPU's number formats.

This module owns :func:`nvidia_gpus` (``nvidia-smi``'s view: name, free memory, compute
capability), :func:`cpu_flags` / :func:`cpu_has_bf16`, and :func:`cpu_budget` (how many cores this
process may compute on: its CPU affinity and its container's CPU quota, not the host's count). The edge's memory planner asks for
free GPU memory, and ``edgecloud serve --engine auto`` for what the machine can run fast (a
CUDA GPU for vLLM or FP8, a CPU with bfloat16 dot products for the torch engine), before any
framework is loaded: importing torch to find out costs a llama.cpp process ~180 MiB.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["GPU", "CpuBudget", "cpu_budget", "cpu_flags", "cpu_has_bf16", "nvidia_gpus"]


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


@dataclass(frozen=True)
class CpuBudget:
    """The cores this process may compute on, and why (see :func:`cpu_budget`)."""

    #: Compute threads to run: physical cores, at most the allowed CPUs and the quota.
    threads: int
    #: The host's physical and logical cores.
    physical: int
    logical: int
    #: CPUs in this process's affinity mask (``taskset``, ``cpuset``); the logical count when unknown.
    allowed: int
    #: The cgroup CPU quota in CPUs (``docker --cpus``), None when unlimited.
    quota: float | None

    def describe(self) -> str:
        """One line for ``edgecloud plan``."""
        limits = []
        if self.allowed < self.logical:
            limits.append(f"{self.allowed} of {self.logical} CPUs allowed (affinity)")
        if self.quota is not None:
            limits.append(f"CPU quota {self.quota:g}")
        said = f"{self.threads} compute thread{'s' if self.threads != 1 else ''}"
        return said + (f": {', '.join(limits)}" if limits else f" (the {self.physical} physical cores)")


def _cgroup_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in CPUs (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), None if unlimited."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = (f.read().split() + ["100000"])[:2]
        return None if quota == "max" else int(quota) / max(1, int(period))
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 else quota_us / max(1, period_us)


def cpu_budget(*, affinity: set[int] | None = None, quota: float | None | str = "read",
               physical: int | None = None, logical: int | None = None) -> CpuBudget:
    """How many compute threads this process should run: the host's physical cores, scaled down
    to the CPUs its affinity allows (an app pinned with ``taskset``) and capped by its cgroup's
    CPU quota rounded up (a container with ``--cpus``). Arguments override what is read (tests)."""
    logical = logical or os.cpu_count() or 1
    if physical is None:
        try:
            import psutil

            physical = psutil.cpu_count(logical=False)
        except ImportError:
            physical = None
    physical = max(1, physical or logical)
    if affinity is None and sys.platform.startswith("linux"):  # (macOS and Windows have no affinity call)
        affinity = os.sched_getaffinity(0)
    allowed = max(1, min(logical, len(affinity))) if affinity else logical
    if quota == "read":
        quota = _cgroup_quota()
    assert not isinstance(quota, str)
    threads = min(physical, max(1, -(-allowed * physical // logical)))  # SMT siblings share a core
    if quota is not None:
        threads = min(threads, max(1, math.ceil(quota)))
    return CpuBudget(threads=threads, physical=physical, logical=logical, allowed=allowed, quota=quota)
