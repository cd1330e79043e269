"""The cloud engine's figures: continuous batching, the matmul path, vs transformers, prefix cache, FP8.

Every figure is a ratio between two measurements taken in this run on this machine:

- ``batching``: 8 concurrent streams of 64 new tokens each (greedy, end-of-generation
  ignored so every stream makes exactly 64 tokens) through the continuous-batching
  :class:`~edgecloud.serving.scheduler.Scheduler`, aggregate tokens/s vs one stream alone, on
  the 0.5B model in fp32. Measured twice: with the oneDNN-prepacked linear layers the server
  uses, and with PyTorch's default ``F.linear`` (MKL sgemm), to show which matmul path wins.
- ``vs_transformers``: one stream (batch 1, greedy, 64 tokens, prefill included) through our
  engine vs ``model.generate`` of Hugging Face transformers on the same GGUF file, same dtype
  (see ``_hf_baseline.py``).
- ``prefix_cache``: time to first token of a request whose ~1,000-token prefix a previous
  request already had, vs the first request (same prefix, different question).
- ``fp8``: FP8 (every block linear, none kept in high precision) vs fp32 on 2,000
  teacher-forced tokens of the packaged text + code sample (``fp8_precision.py`` does the
  measuring), plus FP8 weight bytes vs bf16.

Prints one JSON object and writes it to ``benchmarks/results/cloud_engine.json``.

    python benchmarks/cloud_engine.py [--model NAME] [--skip transformers,fp8]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _common import bench_lock, model_path

from edgecloud.engine import Tokenizer, Transformer, pack_linears
from edgecloud.serving.scheduler import SamplingParams, Scheduler

RESULTS = Path(__file__).resolve().parent / "results" / "cloud_engine.json"
ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 64
STREAMS = 8
#: Eight different coding and prose requests, one per stream.
PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that returns the ten most recent orders.",
    "Write a bash one-liner that counts lines in all .py files.",
    "What is the difference between a process and a thread?",
    "Write a JavaScript function that debounces another function.",
    "Summarise the rules of chess in three sentences.",
    "Write a Rust function that reverses a string.",
]
TARGETS = {"batching": 3.0, "vs_transformers": 1.5, "prefix_cache_ttft_ratio": 0.3}


def _run_streams(scheduler: Scheduler, prompts: list[list[int]]) -> dict[str, Any]:
    """Submit all ``prompts`` at once; wall time until the last of them has its 64 tokens."""
    params = SamplingParams(NEW_TOKENS, temperature=0.0, stop_at_eog=False)
    start = time.perf_counter()
    seqs = [scheduler.submit(p, params) for p in prompts]
    outputs: list[list[int]] = [[] for _ in seqs]

    def drain(i: int) -> None:
        outputs[i] = list(seqs[i])

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(seqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    return {"streams": len(prompts), "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": tokens / seconds,
            "outputs": outputs}


def measure_batching(model: Transformer, prompts: list[list[int]], eog: frozenset[int]) -> dict[str, Any]:
    """One stream alone, then ``STREAMS`` at once, through a fresh scheduler (no prefix reuse)."""
    scheduler = Scheduler(model, eog_ids=eog, max_batch=STREAMS, prefix_cache_bytes=0)
    try:
        _run_streams(scheduler, prompts[:1])  # warm-up: first-call allocations, oneDNN primitives
        singles = [_run_streams(scheduler, [p]) for p in prompts[:2]]
        many = _run_streams(scheduler, prompts[:STREAMS])
    finally:
        scheduler.close()
    single_tps = statistics.mean(s["tokens_per_s"] for s in singles)
    same = all(many["outputs"][i] == singles[i]["outputs"][0] for i in range(len(singles)))
    return {
        "one_stream_tokens_per_s": round(single_tps, 2),
        f"{STREAMS}_streams_tokens_per_s": round(many["tokens_per_s"], 2),
        "ratio": round(many["tokens_per_s"] / single_tps, 2),
        "batched_outputs_equal_alone": same,
        "single_stream_outputs": [s["outputs"][0] for s in singles],
    }


def measure_prefix_cache(model: Transformer, tokenizer: Tokenizer, eog: frozenset[int]) -> dict[str, Any]:
    """TTFT of a ~1,000-token-prefix request, cold and then with the prefix cached."""
    source = (ROOT / "src/edgecloud/cloud/scheduler.py").read_text(encoding="utf-8")
    prefix_ids = tokenizer.encode(source)[:1000]
    context = tokenizer.decode(prefix_ids).decode("utf-8", errors="ignore")
    system = "You are a code reviewer. Here is the file under review:\n\n" + context

    def ttft(question: str, scheduler: Scheduler) -> tuple[float, int, int]:
        prompt = tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": question}])
        start = time.perf_counter()
        seq = scheduler.submit(prompt, SamplingParams(2, temperature=0.0))
        next(iter(seq))
        elapsed = time.perf_counter() - start
        seq.cancel()
        list(seq)
        return elapsed, len(prompt), seq.cached_tokens

    scheduler = Scheduler(model, eog_ids=eog)
    try:
        cold, cold_len, _ = ttft("What does the scheduler do when the queue is full?", scheduler)
        warm, warm_len, cached = ttft("Which lock protects the waiting queue?", scheduler)
    finally:
        scheduler.close()
    return {
        "prompt_tokens_first": cold_len,
        "prompt_tokens_second": warm_len,
        "cached_tokens_second": cached,
        "ttft_first_s": round(cold, 3),
        "ttft_second_s": round(warm, 3),
        "ratio": round(warm / cold, 3),
    }


def measure_vs_transformers(path: Path, ours_tps: float, ours_output: list[int], tokenizer: Tokenizer) -> dict[str, Any]:
    from _hf_baseline import hf_generate_tokens_per_second

    hf = hf_generate_tokens_per_second(path, PROMPTS[0], new_tokens=NEW_TOKENS, dtype="float32")
    return {
        "ours_tokens_per_s": round(ours_tps, 2),
        "transformers_tokens_per_s": round(hf["tokens_per_s"], 2),
        "transformers_version": hf.get("transformers"),
        "transformers_load_s": hf.get("load_s"),
        "ratio": round(ours_tps / hf["tokens_per_s"], 2),
        "same_text": tokenizer.decode(ours_output).decode("utf-8", errors="replace") == hf.get("text"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: transformers, fp8, unpacked")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    path = model_path(args.model)
    report: dict[str, Any] = {
        "benchmark": "cloud_engine",
        "model": path.name,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "targets": TARGETS,
    }
    tokenizer = Tokenizer(path)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    eog = tokenizer.eog_ids
    with bench_lock():
        model = Transformer.from_gguf(path, precision="fp32")
        if "unpacked" not in skip:
            report["batching_default_matmul"] = measure_batching(model, prompts, eog)
        report["packed_layers"] = len(pack_linears(model))
        report["batching"] = measure_batching(model, prompts, eog)
        report["prefix_cache"] = measure_prefix_cache(model, tokenizer, eog)
        ours_tps = report["batching"]["one_stream_tokens_per_s"]
        ours_output = report["batching"]["single_stream_outputs"][0]
        del model
        if "transformers" not in skip:
            report["vs_transformers"] = measure_vs_transformers(path, ours_tps, ours_output, tokenizer)
        if "fp8" not in skip:
            from fp8_precision import measure_model

            fp8 = measure_model(path, 2000, "none", None)  # every block linear in FP8, no layer protected
            vs = fp8["fp8"]["vs_fp32"]
            report["fp8"] = {
                "top1_agreement": vs["top1_agreement"],
                "nll_delta_pct": vs["nll_delta_pct"],
                "kl_mean": vs.get("kl_mean"),
                "positions": vs.get("positions"),
                "weight_bytes_vs_bf16": fp8["fp8_block_bytes_vs_bf16"],
                "bf16_top1_agreement": fp8["bf16"]["vs_fp32"]["top1_agreement"],
            }
    for section in ("batching", "batching_default_matmul"):
        report.get(section, {}).pop("single_stream_outputs", None)
    report["met"] = {
        "batching": report["batching"]["ratio"] >= TARGETS["batching"],
        "prefix_cache": report["prefix_cache"]["ratio"] <= TARGETS["prefix_cache_ttft_ratio"],
    }
    if "vs_transformers" in report:
        report["met"]["vs_transformers"] = report["vs_transformers"]["ratio"] >= TARGETS["vs_transformers"]
    if "fp8" in report:
        f = report["fp8"]
        report["met"]["fp8"] = f["top1_agreement"] >= 0.97 and f["nll_delta_pct"] <= 1.0 and f["weight_bytes_vs_bf16"] <= 0.55
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
