"""GGUF dequantization: gguf.quants (numpy, the baseline) vs edgecloud's torch decoders.

For each model, dequantizes every tensor with both in the same run, per ggml type, and prints
one JSON object (seconds per backend, per type, and the speedup ratio). Writes
benchmarks/results/dequant_load.json.

    python benchmarks/dequant_load.py [MODEL ...]     # default: the 0.5B and 1.5B Qwen models
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import gguf.quants
import numpy as np
from _common import bench_lock, model_path
from gguf import GGMLQuantizationType

from edgecloud.engine.dequant import dequantize
from edgecloud.engine.weights import GGUFFile

RESULTS = Path(__file__).resolve().parent / "results" / "dequant_load.json"
DEFAULT_MODELS = ["qwen2.5-coder-0.5b-instruct-q4", "qwen2.5-coder-1.5b-instruct-q4"]


def time_backend(f: GGUFFile, backend: str) -> tuple[float, dict[str, float]]:
    per_type: dict[str, float] = defaultdict(float)
    start = time.perf_counter()
    for name, info in f.tensors.items():
        t = time.perf_counter()
        if backend == "gguf.quants":
            raw = gguf.quants.dequantize(f.raw(name), GGMLQuantizationType(info.ggml_type))
            np.asarray(raw, dtype=np.float32).reshape(info.shape)
        else:
            dequantize(f.raw(name), info.ggml_type, info.shape)
        per_type[info.type_name] += time.perf_counter() - t
    return time.perf_counter() - start, {k: round(v, 2) for k, v in sorted(per_type.items())}


def main() -> None:
    models = sys.argv[1:] or DEFAULT_MODELS
    report: dict[str, Any] = {"benchmark": "dequant_load", "models": []}
    with bench_lock():
        for name in models:
            f = GGUFFile(model_path(name))
            base_s, base_types = time_backend(f, "gguf.quants")
            ours_s, ours_types = time_backend(f, "torch")
            report["models"].append(
                {
                    "model": name,
                    "gguf_quants_s": round(base_s, 2),
                    "torch_s": round(ours_s, 2),
                    "speedup": round(base_s / ours_s, 2),
                    "per_type_gguf_quants_s": base_types,
                    "per_type_torch_s": ours_types,
                }
            )
    text = json.dumps(report, indent=2)
    print(text)
    RESULTS.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
