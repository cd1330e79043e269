"""Per-op CPU fallback of the torch edge backend: are the logits unchanged, and what does it cost?

Teacher-forces ``--tokens`` tokens (default 200: the start of the first passage of edgecloud's
``eval`` text sample, after a chat prompt) through :class:`~edgecloud.edge.torch.TorchBackend`
on this machine's device twice: with the device's own capability table, and with attention
(``scaled_dot_product_attention``) declared unsupported, so every attention call runs on the
CPU path. The tokens go in the way the edge decodes: one prefill of the prompt, then one
decode step per teacher token (KV cache and all). Reports, at the ``--tokens`` positions that
predict the teacher's tokens, the top-1 agreement of the two runs and the largest |logit
difference|; the fallback counts; and the slowdown (decode time per token with fallback /
without, best of ``--repeats``).

On a CPU device the fallback's "move" is a copy of each input (the same path a GPU takes,
minus the transfer), so the slowdown there is the interception and copy overhead only; on a
GPU it also includes the device-to-host round trips. Prints one JSON object and adds it to
``benchmarks/results/torch_fallback.json`` under ``models.<model>`` (other models' entries stay).

    python benchmarks/torch_fallback.py [--model smollm2-135m-instruct-q4] [--tokens 200] [--repeats 2]
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

from edgecloud.engine import decode_one_token, prefill
from edgecloud.edge.torch import TorchBackend
from edgecloud.quant import load_sample

ATTENTION = "scaled_dot_product_attention"
PROMPT = [{"role": "user", "content": "Read this and explain what it does."}]
RESULTS = Path(__file__).parent / "results" / "torch_fallback.json"


def teacher_forced(backend: TorchBackend, tokens: list[int], n_prompt: int) -> tuple[torch.Tensor, float]:
    """Logits predicting each teacher token ``[len(tokens) - n_prompt, vocab]`` and decode seconds per token."""
    model = backend.transformer
    cache = model.new_cache(len(tokens))
    with backend.fallback_scope():
        rows = [prefill(model, tokens[:n_prompt], cache).cpu()]
    start = time.perf_counter()
    for token in tokens[n_prompt:-1]:
        with backend.fallback_scope():  # per step, as the backend's own loop enters it
            rows.append(decode_one_token(model, token, cache).cpu())
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    per_token = (time.perf_counter() - start) / max(1, len(tokens) - n_prompt - 1)
    return torch.stack(rows), per_token


def measure(model: str, n_tokens: int, repeats: int) -> dict[str, Any]:
    plain = TorchBackend(model_path(model))
    fallen = TorchBackend(model_path(model), unsupported_ops={ATTENTION})
    with plain, fallen:
        prompt = plain.tokenize_chat(PROMPT)
        passage = next(iter(load_sample("eval").values()))
        teacher = plain.tokenizer.encode(passage)[:n_tokens]
        if len(teacher) < n_tokens:
            raise SystemExit(f"the sample passage has only {len(teacher)} tokens; ask for fewer")
        tokens = prompt + teacher
        fallen.load()
        teacher_forced(plain, tokens[: len(prompt) + 4], len(prompt))  # warm both (allocator, oneDNN)
        teacher_forced(fallen, tokens[: len(prompt) + 4], len(prompt))
        before = fallen.fallbacks
        times: dict[str, list[float]] = {"plain": [], "fallback": []}
        for _ in range(repeats):
            plain_logits, seconds = teacher_forced(plain, tokens, len(prompt))
            times["plain"].append(seconds)
            fallen_logits, seconds = teacher_forced(fallen, tokens, len(prompt))
            times["fallback"].append(seconds)
        counts = {op: (n - before.get(op, 0)) // repeats for op, n in fallen.fallbacks.items()}
        best = {side: min(values) for side, values in times.items()}
        agreement = (plain_logits.argmax(-1) == fallen_logits.argmax(-1)).float().mean().item()
        return {
            "model": Path(model).stem if str(model).endswith(".gguf") else model,
            "device": plain.device,
            "dtype": str(plain.dtype).removeprefix("torch."),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
            "prompt_tokens": len(prompt),
            "teacher_forced_tokens": n_tokens,
            "declared_unsupported": sorted(fallen.caps.unsupported),
            "top1_agreement": round(agreement, 4),
            "max_abs_logit_diff": (plain_logits - fallen_logits).abs().max().item(),
            "fallback_counts": counts,
            "fallbacks_per_token": round(sum(counts.values()) / n_tokens, 2),
            "decode_ms_per_token": {side: round(s * 1000, 2) for side, s in best.items()},
            "slowdown": round(best["fallback"] / best["plain"], 3),
            "repeats": repeats,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct-q4")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    # 1: on a busy 2-core machine, 2 threads stall at every parallel region; pass more on a quiet one
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with bench_lock():
        result = measure(args.model, args.tokens, args.repeats)
    print(json.dumps(result, indent=2))
    # One entry per model: a run on another model adds its entry instead of replacing the file.
    models = json.loads(RESULTS.read_text(encoding="utf-8"))["models"] if RESULTS.exists() else {}
    models[result["model"]] = result
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"models": models}, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
