#!/usr/bin/env python3
"""Print the CMAKE_ARGS for building llama-cpp-python on this x86-64 machine, without AMX.

A native build (-march=native) turns on every instruction set the CPU reports, AMX included;
on virtual machines whose kernel does not grant the AMX tile state, llama.cpp then dies with
"Illegal instruction" at its first matrix multiply. This script enables the SIMD extensions
/proc/cpuinfo lists (AVX2, AVX-512, VNNI, BF16...) explicitly and leaves AMX off. Elsewhere
(no /proc/cpuinfo, or not x86-64) it prints nothing and llama.cpp's default build applies.
"""

from __future__ import annotations

import platform
from pathlib import Path

# cmake option -> the /proc/cpuinfo flags it needs
OPTIONS = {
    "GGML_SSE42": ["sse4_2"],
    "GGML_F16C": ["f16c"],
    "GGML_FMA": ["fma"],
    "GGML_BMI2": ["bmi2"],
    "GGML_AVX": ["avx"],
    "GGML_AVX2": ["avx2"],
    "GGML_AVX_VNNI": ["avx_vnni"],
    "GGML_AVX512": ["avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"],
    "GGML_AVX512_VBMI": ["avx512vbmi"],
    "GGML_AVX512_VNNI": ["avx512_vnni"],
    "GGML_AVX512_BF16": ["avx512_bf16"],
}


def cmake_args() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine().lower() not in ("x86_64", "amd64") or not cpuinfo.exists():
        return ""
    flags: set[str] = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    args += [f"-D{opt}={'ON' if all(f in flags for f in need) else 'OFF'}" for opt, need in OPTIONS.items()]
    return " ".join(args)


if __name__ == "__main__":
    print(cmake_args())
