"""What edgecloud's llama.cpp backend costs over bare llama-cpp-python, same model and settings.

Both sides run the 0.5B default edge model with the same n_ctx / threads / KV settings (the
backend's resolved ``llama_kwargs`` are passed to ``llama_cpp.Llama``). Six short prompts,
64 new tokens, greedy, interleaved (A,B then B,A ...). Measured per request:

- decode tokens/s: tokens after the first / time after the first token;
- TTFT with prefix reuse disabled on both sides ("cold": the backend has ``reuse_prefix=False``,
  bare llama-cpp-python has its context ``reset()`` before each request);
- the first request after load, each in a fresh subprocess.

Targets: decode_ratio (ours / bare) >= 0.97, ttft_ratio_cold (ours / bare) <= 1.05. Timing
runs hold an exclusive flock on /tmp/edgecloud-bench.lock. Prints one JSON object on stdout
and writes benchmarks/results/edge_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from _common import DEFAULT_EDGE_MODEL, bench_lock, model_path, run_child

RESULTS = Path(__file__).resolve().parent / "results" / "edge_overhead.json"
MAX_TOKENS = 64
DECODE_TARGET = 0.97
TTFT_TARGET = 1.05
PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the difference between a list and a tuple in Python?",
    "Explain recursion to a beginner.",
    "Write a SQL query that counts orders per customer.",
    "Why is the sky blue?",
    "Write a bash one-liner that counts lines in all .py files.",
]




def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def run_ours(backend: Any, prompt: str) -> dict[str, Any]:
    from edgecloud.types import ChatRequest

    request = ChatRequest(messages=messages(prompt), temperature=0, max_tokens=MAX_TOKENS)
    t0 = time.perf_counter()
    first = None
    parts: list[str] = []
    tokens = 0
    for chunk in backend.stream(request):
        if chunk.text:
            if first is None:
                first = time.perf_counter()
            parts.append(chunk.text)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    assert first is not None, "no text generated"
    return {"ttft_ms": (first - t0) * 1000.0, "decode_s": end - first, "tokens": tokens, "text": "".join(parts)}


def run_bare(llm: Any, prompt: str) -> dict[str, Any]:
    llm.reset()  # no reuse of the previous prompt's KV: a fair "cold" prefill
    t0 = time.perf_counter()
    first = None
    parts: list[str] = []
    stream = llm.create_chat_completion(messages=messages(prompt), temperature=0.0, max_tokens=MAX_TOKENS, stream=True)
    for chunk in stream:
        text = chunk["choices"][0]["delta"].get("content")
        if text:
            if first is None:
                first = time.perf_counter()
            parts.append(text)
    end = time.perf_counter()
    assert first is not None, "no text generated"
    return {"ttft_ms": (first - t0) * 1000.0, "decode_s": end - first, "text": "".join(parts)}


def load_pair(model: Path) -> tuple[Any, Any]:
    import llama_cpp

    from edgecloud.edge.llamacpp import LlamaCppBackend

    backend = LlamaCppBackend(model, reuse_prefix=False)
    backend.load()
    bare = llama_cpp.Llama(model_path=str(model), verbose=False, **backend.llama_kwargs)
    return backend, bare


def child(side: str, model: Path) -> dict[str, float]:
    """Fresh process: load (untimed), time the first request."""
    if side == "ours":
        from edgecloud.edge.llamacpp import LlamaCppBackend

        backend = LlamaCppBackend(model, reuse_prefix=False)
        backend.load()
        return {"ttft_ms": run_ours(backend, PROMPTS[0])["ttft_ms"]}
    import llama_cpp

    from edgecloud.edge.llamacpp import LlamaCppBackend

    settings = LlamaCppBackend(model, reuse_prefix=False)
    settings.load()  # only to learn the exact llama kwargs the backend uses
    kwargs = settings.llama_kwargs
    settings.close()
    llm = llama_cpp.Llama(model_path=str(model), verbose=False, **kwargs)
    return {"ttft_ms": run_bare(llm, PROMPTS[0])["ttft_ms"]}


def cold_ttft_ms(side: str, model: Path) -> float:
    return float(run_child(__file__, side, model)["ttft_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_EDGE_MODEL, help="catalogue name or .gguf path")
    parser.add_argument("--child", choices=["ours", "bare"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--first-runs", type=int, default=3)
    args = parser.parse_args()
    args.model = model_path(args.model)
    if args.child:
        print(json.dumps(child(args.child, args.model)))
        return

    with bench_lock():
        first: dict[str, list[float]] = {"ours": [], "bare": []}
        for i in range(args.first_runs):
            order = ("ours", "bare") if i % 2 == 0 else ("bare", "ours")
            for side in order:
                first[side].append(cold_ttft_ms(side, args.model))

        backend, bare = load_pair(args.model)
        run_ours(backend, "Hello!")  # untimed: first-call allocations
        run_bare(bare, "Hello!")
        ours_runs: list[dict[str, Any]] = []
        bare_runs: list[dict[str, Any]] = []
        mismatches = 0
        for r in range(args.rounds):
            for i, prompt in enumerate(PROMPTS):
                if (r + i) % 2 == 0:
                    a = run_ours(backend, prompt)
                    b = run_bare(bare, prompt)
                else:
                    b = run_bare(bare, prompt)
                    a = run_ours(backend, prompt)
                # greedy on both sides: same text, so ours' token count holds for both
                b["tokens"] = a["tokens"]
                mismatches += a["text"] != b["text"]
                ours_runs.append(a)
                bare_runs.append(b)
        n_ctx, threads = backend.n_ctx, backend.llama_kwargs.get("n_threads")
        backend.close()
        bare.close()

    def tok_s(run: dict[str, Any]) -> float:
        return (run["tokens"] - 1) / run["decode_s"]

    ours_decode = statistics.median(tok_s(r) for r in ours_runs)
    bare_decode = statistics.median(tok_s(r) for r in bare_runs)
    ours_ttft = statistics.median(r["ttft_ms"] for r in ours_runs)
    bare_ttft = statistics.median(r["ttft_ms"] for r in bare_runs)
    decode_ratio = ours_decode / bare_decode
    ttft_ratio = ours_ttft / bare_ttft
    result = {
        "model": args.model.name,
        "n_ctx": n_ctx,
        "n_threads": threads,
        "prompts": len(PROMPTS),
        "rounds": args.rounds,
        "max_tokens": MAX_TOKENS,
        "ours_decode_tok_s": round(ours_decode, 2),
        "bare_decode_tok_s": round(bare_decode, 2),
        "decode_ratio": round(decode_ratio, 3),
        "ours_ttft_cold_ms": round(ours_ttft, 1),
        "bare_ttft_cold_ms": round(bare_ttft, 1),
        "ttft_ratio_cold": round(ttft_ratio, 3),
        "ours_first_request_ms": round(statistics.median(first["ours"]), 1),
        "bare_first_request_ms": round(statistics.median(first["bare"]), 1),
        "first_request_ratio": round(statistics.median(first["ours"]) / statistics.median(first["bare"]), 3),
        "text_mismatches": mismatches,
        "targets": {"decode_ratio_min": DECODE_TARGET, "ttft_ratio_cold_max": TTFT_TARGET},
        "meets_targets": decode_ratio >= DECODE_TARGET and ttft_ratio <= TTFT_TARGET,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
