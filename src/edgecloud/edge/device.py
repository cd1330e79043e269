"""Device profiles: how much memory a model may use on a given kind of device.

This module owns :class:`DeviceProfile`, the registry of named profiles (``phone-8gb``,
``laptop-16gb``, ``mac-16gb``, ``server-24gb``) and :func:`detect_device` for ``this``
machine. The memory planner (:mod:`edgecloud.edge.memory`) plans against a profile's
``budget_bytes``; it never looks at the machine itself.

A budget is not the RAM size: the OS, other apps and the host app's own UI need their share,
and mobile OSes kill a foreground app well before RAM is full. Each profile's docstring line
in :data:`PROFILES` says where its number comes from.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import InvalidRequestError
from ..runtime.hardware import nvidia_gpus
from ..runtime.llama_cpp import physical_cores

__all__ = ["DeviceProfile", "PROFILES", "get_device", "detect_device", "device_names"]

GiB = 1024**3


@dataclass(frozen=True)
class DeviceProfile:
    """A device the planner can plan for.

    ``budget_bytes`` is what the model (weights + KV cache + compute buffers + the runtime's
    own baseline) may use in total. ``gpu_bytes`` is how much of it may live on a GPU
    (0 = CPU only, no layer offload). With ``unified_memory`` the GPU share is part of the
    same RAM (Apple silicon), so offloading moves no bytes out of the budget; on a discrete
    GPU the offloaded part lives in VRAM and also has to fit ``gpu_bytes``.
    """

    name: str
    description: str
    total_bytes: int
    budget_bytes: int
    gpu_bytes: int = 0
    unified_memory: bool = False
    cpu_threads: int = 4
    gpu_backend: str | None = None

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0 or self.budget_bytes > self.total_bytes:
            raise InvalidRequestError(
                f"device {self.name!r}: budget_bytes must be in (0, total_bytes], got {self.budget_bytes}",
                param="device",
            )
        if self.gpu_bytes < 0:
            raise InvalidRequestError(f"device {self.name!r}: gpu_bytes must be >= 0", param="device")

    @property
    def has_gpu(self) -> bool:
        """True when layers may be offloaded to a GPU."""
        return self.gpu_bytes > 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return asdict(self)


#: Named profiles. The budgets:
#:
#: * ``phone-8gb`` — 8 GiB Android/iPhone. iOS jetsam and Android's low-memory killer leave a
#:   foreground app roughly half of RAM on 8 GB devices (the OS, system services and cached
#:   apps hold the rest); the host app's own UI takes ~0.5 GiB of that half, so the model gets
#:   3.5 GiB. CPU only (4 big cores): llama.cpp's mobile GPU backends are not the default path.
#: * ``laptop-16gb`` — 16 GiB x86 laptop, integrated graphics. The OS, a browser and an IDE
#:   typically hold 6-8 GiB; the model gets 8 GiB. CPU only, 8 threads.
#: * ``mac-16gb`` — 16 GiB Apple-silicon Mac. Unified memory: Metal's
#:   ``recommendedMaxWorkingSetSize`` is ~2/3 of RAM on 16 GiB machines (~10.7 GiB; ~3/4 on
#:   larger ones). macOS plus apps need ~6 GiB, so the model gets 10 GiB, all of it usable by
#:   the GPU (every layer can be offloaded).
#: * ``server-24gb`` — a CPU-only box with 24 GiB RAM (a small cloud VM, or this project's own
#:   CI machine). The OS, the HTTP server and page cache for other work keep ~4 GiB; the model
#:   gets 20 GiB. No GPU: a GPU server is what the cloud side is for.
PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile(
            name="phone-8gb",
            description="8 GiB phone, CPU inference; the app may use ~half of RAM, the model 3.5 GiB",
            total_bytes=8 * GiB,
            budget_bytes=int(3.5 * GiB),
            cpu_threads=4,
        ),
        DeviceProfile(
            name="laptop-16gb",
            description="16 GiB x86 laptop, integrated graphics; the model may use 8 GiB",
            total_bytes=16 * GiB,
            budget_bytes=8 * GiB,
            cpu_threads=8,
        ),
        DeviceProfile(
            name="mac-16gb",
            description="16 GiB Apple-silicon Mac, unified memory (Metal); the model may use 10 GiB",
            total_bytes=16 * GiB,
            budget_bytes=10 * GiB,
            gpu_bytes=10 * GiB,
            unified_memory=True,
            cpu_threads=8,
            gpu_backend="metal",
        ),
        DeviceProfile(
            name="server-24gb",
            description="CPU-only server with 24 GiB RAM; the model may use 20 GiB",
            total_bytes=24 * GiB,
            budget_bytes=20 * GiB,
            cpu_threads=8,
        ),
    )
}

#: What ``this`` leaves for the rest of the machine: 10% of the available memory (page
#: cache the model's own file needs, other processes growing while the model runs).
_THIS_HEADROOM = 0.10
#: Share of RAM Metal lets one process use on Apple silicon (recommendedMaxWorkingSetSize, ~2/3).
_METAL_WORKING_SET = 0.66


def _memory() -> tuple[int, int]:
    """(total, available) bytes of RAM; MemAvailable counts reclaimable page cache."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except ImportError:
        pass
    info: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    return info["MemTotal"], info.get("MemAvailable", info["MemFree"])


def _torch_gpu() -> tuple[int, bool, str | None]:
    """(gpu bytes, unified, backend) as torch sees them; called only once torch is imported."""
    try:
        import torch
    except Exception:  # a broken torch install must not break planning
        return 0, False, None
    try:
        if torch.cuda.is_available():
            free, _total = torch.cuda.mem_get_info()
            return int(free), False, "cuda"
        if torch.backends.mps.is_available():
            return int(torch.mps.recommended_max_memory()), True, "metal"
    except Exception:
        return 0, False, None
    return 0, False, None


def _nvidia_free_bytes() -> int:
    """Free memory of the first NVIDIA GPU as ``nvidia-smi`` reports it (0 when there is none)."""
    gpus = nvidia_gpus()
    return gpus[0].free_bytes if gpus else 0


def _gpu(total_ram: int) -> tuple[int, bool, str | None]:
    """(gpu bytes, unified, backend), without importing torch.

    Importing torch to look for a GPU costs a llama.cpp process ~180 MiB of resident memory
    that it never uses, so torch is asked only when the process already imported it (the torch
    backends do). Otherwise: NVIDIA through ``nvidia-smi``; Apple silicon as unified memory with
    Metal's usual working-set limit (about two thirds of RAM).
    """
    if "torch" in sys.modules:
        return _torch_gpu()
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return int(total_ram * _METAL_WORKING_SET), True, "metal"
    free = _nvidia_free_bytes()
    return (free, False, "cuda") if free else (0, False, None)


def detect_device() -> DeviceProfile:
    """A profile for this machine: 90% of MemAvailable, physical cores, and its GPU (see :func:`_gpu`).

    A CUDA GPU offers its free memory; Apple MPS offers Metal's recommended working set
    (unified memory). llama.cpp itself may be built without GPU support, in which case the
    planned ``gpu_layers`` are simply ignored by the runtime.
    """
    total, available = _memory()
    gpu_bytes, unified, backend = _gpu(total)
    budget = max(1, int(available * (1 - _THIS_HEADROOM)))
    if unified:
        gpu_bytes = min(gpu_bytes, budget)
    return DeviceProfile(
        name="this",
        description=f"this machine: {total / GiB:.1f} GiB RAM, {available / GiB:.1f} GiB available"
        + (f", {backend} GPU {gpu_bytes / GiB:.1f} GiB" if gpu_bytes else ", CPU only"),
        total_bytes=total + (0 if unified else gpu_bytes),
        budget_bytes=min(budget + (0 if unified else gpu_bytes), total + (0 if unified else gpu_bytes)),
        gpu_bytes=gpu_bytes,
        unified_memory=unified,
        cpu_threads=physical_cores(),
        gpu_backend=backend,
    )


def device_names() -> list[str]:
    """All names :func:`get_device` accepts."""
    return [*PROFILES, "this"]


def get_device(name: str | DeviceProfile) -> DeviceProfile:
    """The named profile (``this`` is detected now); InvalidRequestError listing the names otherwise."""
    if isinstance(name, DeviceProfile):
        return name
    if name == "this":
        return detect_device()
    profile = PROFILES.get(str(name))
    if profile is None:
        raise InvalidRequestError(
            f"unknown device {name!r}; known devices: {', '.join(device_names())}", param="device"
        )
    return profile
