"""How close is the memory planner to what llama.cpp really uses?

For each model and context size: plan it (``edgecloud.edge.memory.plan(model, "this", ctx=n)``),
then in a FRESH subprocess load the model with exactly ``plan.llama_kwargs()``, evaluate a
prompt of nearly ``n`` tokens (so every KV page is written) plus a few generated tokens, and
read the subprocess's peak RSS (``VmHWM``). Prints one JSON object on stdout and writes it
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

# Runs in the fresh subprocess: load, fill the context, report peak RSS and llama.cpp's log.
CHILD = r"""
import json, resource, sys
path, kwargs = sys.argv[1], json.loads(sys.argv[2])
import llama_cpp
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
rss_before_load = high_water_mark()
llm = llama_cpp.Llama(model_path=path, verbose=bool(int(sys.argv[3])), **kwargs)
n_ctx = llm.n_ctx()
words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "every bold jumping zebra near 42 old lighthouses and 17 rivers ").split()
text = " ".join(words[(i * 7) % len(words)] + str(i % 97) for i in range(n_ctx * 2))
tokens = llm.tokenize(text.encode())[: max(1, n_ctx - 8)]
llm.eval(tokens)
for _ in range(4):
    tok = llm.sample(temp=0.0)
    llm.eval([tok])
peak = high_water_mark()
print(json.dumps({"peak_rss": peak, "rss_before_load": rss_before_load, "n_ctx": n_ctx, "n_past": llm.n_tokens}))
"""

def measure(path: Path, kwargs: dict[str, Any], *, verbose: bool = False, timeout: float = 3600) -> dict[str, Any]:
    """Peak RSS of a fresh process that loads ``path`` with ``kwargs`` and fills its context."""
    with bench_lock():
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, str(path), json.dumps(kwargs), "1" if verbose else "0"],
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
            got = measure(path, p.llama_kwargs())
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
