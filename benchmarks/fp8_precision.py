"""How much accuracy do bf16 and FP8 (E4M3, per-channel) weights cost against fp32?

For each model, teacher-force the text sample that ships with edgecloud (real code and prose,
``edgecloud/quant/data``: the ``eval`` split, ``--tokens`` tokens in all, split evenly over its
passages and scored in chunks of at most 512 tokens) through the torch engine in fp32, bf16
and fp8, and compare each low precision with fp32 position by position: top-1 agreement,
mean KL(fp32 || low) of the next-token distributions, and the mean NLL of the real next
tokens (change in %). Also reports the weight bytes of the block linears and of the whole
model.

With ``--protect auto`` (the default) it then runs :func:`edgecloud.quant.compare_precision`:
each block linear's sensitivity on the sample's ``calibration`` split, and the layers kept in
high precision within 0.55x the bf16 bytes of the block linears. The model is loaded again
through ``Transformer.from_gguf(precision="fp8", fp8_skip=...)`` with that choice and scored
like the others ("fp8_protected"). ``--save-config`` writes the choice as a quantization
config. The sensitivity pass is one forward per linear (168 on Qwen2.5-0.5B): minutes on a
small CPU.

On a machine without FP8 matmuls (CPU, or CUDA below compute capability 8.9) FP8 runs as
quantize-dequantize with float32 activations: the numbers are FP8 weights', the speed is not,
and the per-token E4M3 activations of the native path are not part of them. Prints one JSON
object and writes it to ``benchmarks/results/fp8_precision.json``.

    python benchmarks/fp8_precision.py [--models qwen05[,qwen15]] [--tokens 2000] [--protect auto|none]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from _common import bench_lock, model_path

from edgecloud.engine import Tokenizer, Transformer, param_bytes
from edgecloud.quant import (
    FP8Linear,
    compare_precision,
    load_sample,
    save_quant_config,
    scaled_mm_supported,
)
from edgecloud.quant.compare import chunk_texts, drift, log_probs

MODELS: dict[str, str] = {
    "smollm2": "smollm2-135m-instruct-q4",
    "qwen05": "qwen2.5-coder-0.5b-instruct-q4",
    "qwen15": "qwen2.5-coder-1.5b-instruct-q4",
}
RESULTS = Path(__file__).resolve().parent / "results" / "fp8_precision.json"
CHUNK_TOKENS = 512


def _block_linear_bytes(model: Transformer) -> int:
    return sum(param_bytes(m) for n, m in model.named_modules() if n.startswith("blk.") and isinstance(m, (torch.nn.Linear, FP8Linear)))


def measure_model(path: Path, total_tokens: int, protect: str, save_config: Path | None) -> dict[str, Any]:
    """Teacher-forced comparison of bf16 and fp8 (and fp8 with protected layers) against fp32 for one GGUF file."""
    texts = load_sample("eval")
    tokenizer = Tokenizer(path)
    chunks = chunk_texts(tokenizer, texts, total_tokens, CHUNK_TOKENS)
    tokenizer.close()
    result: dict[str, Any] = {
        "model": path.name,
        "texts": {name: sum(len(ids) for n, ids in chunks if n == name) for name in texts},
        "chunk_tokens": CHUNK_TOKENS,
    }
    reference: list[torch.Tensor] = []
    runs: list[tuple[str, str, tuple[str, ...]]] = [("fp32", "fp32", ()), ("bf16", "bf16", ()), ("fp8", "fp8", ())]
    if protect == "auto":
        comparison = compare_precision(path, "fp8", texts, tokens=total_tokens, protect="auto", chunk_tokens=CHUNK_TOKENS)
        comparison.pop("per_text")
        result["compare_precision"] = comparison
        runs.append(("fp8_protected", "fp8", tuple(comparison["protected"])))
        if save_config is not None:
            save_quant_config(comparison, save_config)
    for label, precision, keep in runs:
        start = time.perf_counter()
        model = Transformer.from_gguf(path, precision=precision, fp8_skip=keep)
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        entry: dict[str, Any] = {"load_s": round(load_s, 1)}
        if label == "fp32":
            reference = log_probs(model, chunks)
        else:
            compared = drift(reference, model, chunks)
            entry["per_text"] = compared.pop("per_text")
            entry["vs_fp32"] = compared
        entry["forward_s"] = round(time.perf_counter() - start, 1)
        entry["weight_bytes"] = param_bytes(model)
        entry["block_linear_bytes"] = _block_linear_bytes(model)
        if keep:
            entry["kept_high_precision"] = list(keep)
        result[label] = entry
        del model
    result["fp8_block_bytes_vs_bf16"] = result["fp8"]["block_linear_bytes"] / result["bf16"]["block_linear_bytes"]
    if protect == "auto":
        # Kept layers are float32 here (the CPU activation dtype); deployed next to bf16
        # activations they are bf16, which is what compare_precision's ratio counts.
        result["fp8_protected_block_bytes_vs_bf16"] = result["compare_precision"]["weight_bytes_ratio"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen05", help=f"comma-separated keys of {sorted(MODELS)}")
    parser.add_argument("--tokens", type=int, default=2000, help="teacher-forced tokens per model, over all texts")
    parser.add_argument("--protect", choices=("auto", "none"), default="auto", help="also measure fp8 with protected layers")
    parser.add_argument("--save-config", type=Path, help="write the protected-layer choice as a quantization config")
    args = parser.parse_args()
    torch.manual_seed(0)
    report: dict[str, Any] = {
        "benchmark": "fp8_precision",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "fp8_path": "scaled_mm" if scaled_mm_supported("cuda") else "quantize-dequantize (cpu)",
        "models": {},
    }
    with bench_lock():
        for key in args.models.split(","):
            save = args.save_config.with_suffix(f".{key}.json") if args.save_config and "," in args.models else args.save_config
            report["models"][key] = measure_model(model_path(MODELS[key]), args.tokens, args.protect, save)
            report["models"][key]["measured_on"] = time.strftime("%Y-%m-%d")
    print(json.dumps(report, indent=2))
    # Keep the other models' figures from earlier runs on the same FP8 path (a model run alone,
    # e.g. --models qwen15, adds its entry rather than dropping the rest).
    if RESULTS.exists():
        earlier = json.loads(RESULTS.read_text(encoding="utf-8"))
        if earlier.get("fp8_path") == report["fp8_path"]:
            report["models"] = {**earlier.get("models", {}), **report["models"]}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
