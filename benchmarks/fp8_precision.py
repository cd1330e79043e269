"""How much accuracy do bf16 and FP8 (E4M3, per-channel) weights cost against fp32?

For each model, teacher-force a fixed set of texts (code and prose from this repository,
``--tokens`` tokens in all, split evenly) through the torch engine in fp32, bf16 and fp8, and
compare each low precision with fp32 position by position: top-1 agreement, mean
KL(fp32 || low) of the next-token distributions, and the mean NLL of the real next tokens
(change in %). Also reports the weight bytes of the converted layers and of the whole model.

On a machine without FP8 matmuls (CPU, or CUDA below compute capability 8.9) FP8 runs as
quantize-dequantize: the numbers are FP8's, the speed is not. Prints one JSON object and
writes it to ``benchmarks/results/fp8_precision.json``.

    python benchmarks/fp8_precision.py [--models qwen05[,qwen15]] [--tokens 2000]
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

from edgecloud.cloud.engine import Tokenizer, Transformer, param_bytes
from edgecloud.quant import FP8Linear, scaled_mm_supported

MODELS: dict[str, str] = {
    "smollm2": "smollm2-135m-instruct-q4",
    "qwen05": "qwen2.5-coder-0.5b-instruct-q4",
    "qwen15": "qwen2.5-coder-1.5b-instruct-q4",
}
ROOT = Path(__file__).resolve().parent.parent
#: Real code and prose, read from files of this repository (kinds alternate code / prose).
TEXTS: dict[str, Path] = {
    "code:model.py": ROOT / "src/edgecloud/cloud/engine/model.py",
    "prose:README.md": ROOT / "README.md",
    "code:generate.py": ROOT / "src/edgecloud/cloud/engine/generate.py",
}
RESULTS = Path(__file__).resolve().parent / "results" / "fp8_precision.json"


def _sequences(tokenizer: Tokenizer, total_tokens: int) -> dict[str, list[int]]:
    per_text = total_tokens // len(TEXTS)
    return {name: tokenizer.encode(path.read_text(encoding="utf-8"))[:per_text] for name, path in TEXTS.items()}


@torch.inference_mode()
def _log_probs(model: Transformer, tokens: list[int]) -> torch.Tensor:
    logits = model(torch.tensor(tokens), None, model.new_cache(len(tokens)))
    return torch.log_softmax(logits[:-1].float(), dim=-1)


def _compare(reference: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    kl = (reference.exp() * (reference - other)).sum(-1)
    nll_ref = -reference.gather(1, targets[:, None]).mean()
    nll_other = -other.gather(1, targets[:, None]).mean()
    return {
        "positions": int(targets.numel()),
        "top1_agreement": float((reference.argmax(-1) == other.argmax(-1)).float().mean()),
        "mean_kl": float(kl.mean()),
        "nll_fp32": float(nll_ref),
        "nll": float(nll_other),
        "nll_delta_pct": float((nll_other / nll_ref - 1) * 100),
    }


def measure_model(path: Path, total_tokens: int) -> dict[str, Any]:
    """Teacher-forced comparison of bf16 and fp8 against fp32 for one GGUF file."""
    tokenizer = Tokenizer(path)
    sequences = _sequences(tokenizer, total_tokens)
    tokenizer.close()
    targets = {name: torch.tensor(tokens[1:]) for name, tokens in sequences.items()}
    result: dict[str, Any] = {"model": path.name, "texts": {n: len(t) for n, t in sequences.items()}}
    reference: dict[str, torch.Tensor] = {}
    for precision in ("fp32", "bf16", "fp8"):
        start = time.perf_counter()
        model = Transformer.from_gguf(path, precision=precision)
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        log_probs = {name: _log_probs(model, tokens) for name, tokens in sequences.items()}
        entry: dict[str, Any] = {
            "load_s": round(load_s, 1),
            "forward_s": round(time.perf_counter() - start, 1),
            "weight_bytes": param_bytes(model),
            "block_linear_bytes": sum(
                param_bytes(m) for n, m in model.named_modules() if n.startswith("blk.") and isinstance(m, (torch.nn.Linear, FP8Linear))
            ),
        }
        if precision == "fp32":
            reference = log_probs
        else:
            per_text = {n: _compare(reference[n], log_probs[n], targets[n]) for n in sequences}
            weights = {n: c["positions"] for n, c in per_text.items()}
            total = sum(weights.values())
            entry["vs_fp32"] = {
                key: sum(per_text[n][key] * weights[n] for n in per_text) / total
                for key in ("top1_agreement", "mean_kl", "nll_fp32", "nll", "nll_delta_pct")
            }
            entry["vs_fp32"]["positions"] = total
            entry["per_text"] = per_text
        result[precision] = entry
        del model
    result["fp8_block_bytes_vs_bf16"] = result["fp8"]["block_linear_bytes"] / result["bf16"]["block_linear_bytes"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen05", help=f"comma-separated keys of {sorted(MODELS)}")
    parser.add_argument("--tokens", type=int, default=2000, help="teacher-forced tokens per model, over all texts")
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
            report["models"][key] = measure_model(model_path(MODELS[key]), args.tokens)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
