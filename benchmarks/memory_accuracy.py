"""How close is the memory planner to what llama.cpp really uses?

For each model and context size: plan it (``edgecloud.edge.memory.plan(model, "this", ctx=n)``),
then in a FRESH subprocess load it through the SDK's own :class:`LlamaCppBackend` (what an app
runs: its imports, its device detection, its planned llama.cpp settings), answer one request
whose prompt fills nearly ``n`` tokens (so every KV page is written) with a few generated
tokens, and read the subprocess's peak RSS (``VmHWM``). Prints one JSON object on stdout and writes it
to ``benchmarks/results/memory_accuracy.json``.

Each measurement holds ``flock /tmp/edgecloud-bench.lock`` so it never overlaps another
benchmark timing on the same cores.

    python benchmarks/memory_accuracy.py [--models smollm2,qwen05,qwen15] [--ctx 512,2048,8192]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import bench_lock
from edgecloud.edge.memory import plan
from edgecloud.store import resolve_model

#: Short keys for --models -> catalogue names (pulled into the cache on first use).
MODELS: dict[str, str] = {
    "smollm2": "smollm2-135m-instruct-q4",
    "qwen05": "qwen2.5-coder-0.5b-instruct-q4",
    "qwen15": "qwen2.5-coder-1.5b-instruct-q4",
}
CONTEXTS = (512, 2048, 8192)
RESULTS = Path(__file__).resolve().parent / "results" / "memory_accuracy.json"
TOLERANCE = 0.10

# Runs in the fresh subprocess: the SDK's own backend loads the model as an app would, one
# request fills the context, and the process reports its peak RSS.
CHILD = r"""
import json, resource, sys
path, n_ctx = sys.argv[1], int(sys.argv[2])
def high_water_mark():
    # VmHWM belongs to this process image; ru_maxrss survives execve and would report the
    # parent's peak when the parent (e.g. a pytest run that already loaded models) is larger.
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
from edgecloud import ChatRequest
from edgecloud.edge.llamacpp import LlamaCppBackend
rss_before_load = high_water_mark()
backend = LlamaCppBackend(path, n_ctx=n_ctx, reuse_prefix=False, verbose=bool(int(sys.argv[3])))
backend.load()
words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "every bold jumping zebra near 42 old lighthouses and 17 rivers ").split()
want = n_ctx - 12  # room for 4 answer tokens
count = want
for _ in range(4):  # fit the prompt to the context: the chat template adds its own tokens
    text = " ".join(words[(i * 7) % len(words)] + str(i % 97) for i in range(count))
    got = len(backend.tokenize_chat([{"role": "user", "content": text}]))
    if got <= want and got > want - 24:
        break
    count = max(1, int(count * want / got) - (1 if got > want else 0))
request = ChatRequest(messages=[{"role": "user", "content": text}], max_tokens=4, temperature=0, ignore_eos=True)
answer = backend.complete(request)
peak = high_water_mark()
print(json.dumps({"peak_rss": peak, "rss_before_load": rss_before_load, "n_ctx": backend.n_ctx,
                  "n_past": answer.usage.prompt_tokens + answer.usage.completion_tokens,
                  "llama_kwargs": {k: v for k, v in backend.llama_kwargs.items() if isinstance(v, (int, float, str, bool))}}))
"""

def measure(path: Path, n_ctx: int, *, verbose: bool = False, timeout: float = 3600) -> dict[str, Any]:
    """Peak RSS of a fresh process whose ``LlamaCppBackend`` loads ``path`` at ``n_ctx`` and fills it."""
    with bench_lock():
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, str(path), str(n_ctx), "1" if verbose else "0"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"measurement failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if verbose:
        result["log"] = proc.stderr
    return result

def run(models: list[str], contexts: list[int]) -> dict[str, Any]:
    points = []
    for key in models:
        path = resolve_model(MODELS[key], pull=True)
        for n in contexts:
            p = plan(path, "this", ctx=n)
            started = time.perf_counter()
            got = measure(path, n)
            measured = got["peak_rss"]
            ratio = p.total_bytes / measured
            points.append(
                {
                    "model": MODELS[key],
                    "n_ctx": n,
                    "kv_cache_type": p.kv_cache_type,
                    "predicted_bytes": p.total_bytes,
                    "measured_bytes": measured,
                    "ratio": round(ratio, 4),
                    "error_pct": round((ratio - 1) * 100, 2),
                    "within_10pct": abs(ratio - 1) <= TOLERANCE,
                    "predicted": {k: getattr(p, k) for k in ("weights_bytes", "kv_bytes", "compute_bytes", "overhead_bytes")},
                    "tokens_evaluated": got["n_past"],
                    "seconds": round(time.perf_counter() - started, 1),
                }
            )
            print(f"{key} n_ctx={n}: predicted {p.total_bytes / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB "
                  f"({points[-1]['error_pct']:+.1f}%)", file=sys.stderr)
    errors = [abs(pt["error_pct"]) for pt in points]
    return {
        "benchmark": "memory_accuracy",
        "tolerance_pct": TOLERANCE * 100,
        "points": points,
        "summary": {
            "n_points": len(points),
            "max_abs_error_pct": max(errors) if errors else None,
            "mean_abs_error_pct": round(sum(errors) / len(errors), 2) if errors else None,
            "all_within": all(pt["within_10pct"] for pt in points),
        },
    }

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--ctx", default=",".join(map(str, CONTEXTS)), help="comma list of context sizes")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    contexts = [int(c) for c in args.ctx.split(",") if c.strip()]
    report = run(models, contexts)
    text = json.dumps(report, indent=2)
    print(text)
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text + "\n", encoding="utf-8")
    return 0 if report["summary"]["all_within"] else 1

if __name__ == "__main__":
    raise SystemExit(main())
