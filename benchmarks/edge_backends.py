"""The edge runtimes side by side: llama.cpp, ONNX Runtime (INT4 export) and torch-CPU on one model.

Each backend runs in its own fresh process (so its peak RSS is its own) on the same model, the
same thread count and the same prompts: the first ``--tasks`` HumanEval tasks, greedy, at most
``--max-tokens`` tokens each. Per backend:

- ``ttft_ms``: median time from the request to the first text chunk;
- ``decode_tok_s``: tokens after the first over the time after the first, summed over all answers;
- ``peak_rss_mib``: the process's peak resident memory (model load included);
- ``pass_at_1``: the share of tasks whose answer passes the task's tests (run in the sandbox of
  :mod:`edgecloud.router.sandbox`);
- ``ratio_to_best``: each figure over the best backend's (1.0 = best; for TTFT and RSS lower is
  better, so the ratio is best / value).

The ONNX backend runs an ``edgecloud export onnx`` folder (``--onnx-dir``, or one built once and
cached under ``~/.cache/edgecloud/exports/``; the build is not timed). Targets for the 0.5B
model: ONNX decode >= 0.85x llama.cpp's, pass@1 within 3 points. Timing runs hold the shared
benchmark lock. Prints one JSON object; writes ``benchmarks/results/edge_backends.json`` unless
``--no-save``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import DEFAULT_EDGE_MODEL, bench_lock, model_path

RESULTS = Path(__file__).resolve().parent / "results" / "edge_backends.json"
BACKENDS = ("llamacpp", "onnx", "torch")
N_CTX = 2048
DECODE_TARGET = 0.85
PASS_POINTS_TARGET = 3.0


def _llamacpp(model: Path, onnx_dir: Path | None, threads: int) -> Any:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    return LlamaCppBackend(model, n_ctx=N_CTX, n_threads=threads)


def _onnx(model: Path, onnx_dir: Path | None, threads: int) -> Any:
    from edgecloud.edge.onnx import OnnxBackend

    assert onnx_dir is not None
    return OnnxBackend(onnx_dir, n_ctx=N_CTX, n_threads=threads)


def _torch(model: Path, onnx_dir: Path | None, threads: int) -> Any:
    import torch

    from edgecloud.edge.torch import TorchBackend

    torch.set_num_threads(threads)
    return TorchBackend(model, device="cpu", n_ctx=N_CTX)


#: Backend name -> how the child process builds it.
FACTORIES: dict[str, Callable[[Path, Path | None, int], Any]] = {"llamacpp": _llamacpp, "onnx": _onnx, "torch": _torch}


def _peak_rss_kib() -> int:
    """This process's peak resident memory in KiB.

    On Linux, VmHWM from /proc: ``ru_maxrss`` survives ``execve``, so a child started by a
    parent that once held gigabytes (an export, another backend) would report the parent's peak.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # bytes on macOS, KiB elsewhere


def child(name: str, model: Path, onnx_dir: Path | None, n_tasks: int, max_tokens: int, threads: int) -> dict[str, Any]:
    """Run one backend over the tasks in this process; returns its figures."""
    from edgecloud.router.training.tasks import grade, load_tasks
    from edgecloud.types import ChatRequest

    tasks = load_tasks(["humaneval"])[:n_tasks]
    backend = FACTORIES[name](model, onnx_dir, threads)
    start = time.perf_counter()
    backend.load()
    load_s = time.perf_counter() - start
    ttfts: list[float] = []
    decode_tokens, decode_s, passed = 0, 0.0, 0
    with backend:
        for task in tasks:
            request = ChatRequest(messages=task.messages, temperature=0, max_tokens=min(task.max_tokens, max_tokens))
            parts: list[str] = []
            first: float | None = None
            completion_tokens = 0
            start = time.perf_counter()
            for chunk in backend.stream(request):
                if chunk.text:
                    first = first if first is not None else time.perf_counter()
                    parts.append(chunk.text)
                if chunk.usage is not None:
                    completion_tokens = chunk.usage.completion_tokens
            end = time.perf_counter()
            if first is not None:
                ttfts.append(first - start)
                if completion_tokens > 1:
                    decode_tokens += completion_tokens - 1
                    decode_s += end - first
            passed += grade(task, "".join(parts))
    peak_kib = _peak_rss_kib()
    return {
        "load_s": round(load_s, 2),
        "ttft_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        "decode_tok_s": round(decode_tokens / decode_s, 2) if decode_s else None,
        "peak_rss_mib": round(peak_kib / 1024, 1),
        "pass_at_1": round(passed / len(tasks), 4) if tasks else None,
        "tasks": len(tasks),
        "decoded_tokens": decode_tokens,
    }


def ratios(results: dict[str, dict[str, Any]]) -> None:
    """Add ``ratio_to_best`` to each backend's figures (1.0 = the best backend for that figure)."""
    higher_is_better = {"decode_tok_s": True, "pass_at_1": True, "ttft_ms": False, "peak_rss_mib": False}
    for key, higher in higher_is_better.items():
        values = {name: r[key] for name, r in results.items() if r.get(key)}
        if not values:
            continue
        best = max(values.values()) if higher else min(values.values())
        for name, value in values.items():
            results[name].setdefault("ratio_to_best", {})[key] = round(value / best if higher else best / value, 3)


def _run_child(name: str, args: argparse.Namespace, model: Path, onnx_dir: Path | None) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--child", name, "--model", str(model), "--tasks", str(args.tasks),
        "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
    ]
    if onnx_dir is not None:
        command += ["--onnx-dir", str(onnx_dir)]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout)


def main() -> None:
    from edgecloud.edge.device import detect_device

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_EDGE_MODEL, help="catalogue name or .gguf path")
    parser.add_argument("--tasks", type=int, default=40, help="HumanEval tasks (the first N)")
    parser.add_argument("--max-tokens", type=int, default=512, help="most tokens per answer")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated subset of {','.join(BACKENDS)}")
    parser.add_argument("--threads", type=int, default=int(detect_device().cpu_threads), help="CPU threads, every backend")
    parser.add_argument("--onnx-dir", type=Path, help="an `edgecloud export onnx` folder of --model (default: built and cached)")
    parser.add_argument("--no-save", action="store_true", help=f"do not write {RESULTS.name}")
    parser.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, Path(args.model), args.onnx_dir, args.tasks, args.max_tokens, args.threads)))
        return
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    model = model_path(args.model)
    onnx_dir = args.onnx_dir
    if "onnx" in names and onnx_dir is None:
        from edgecloud.quant.export_onnx import cached_export
        from edgecloud.store.cache import home_dir

        onnx_dir = cached_export(model, home_dir() / "exports")
    results: dict[str, dict[str, Any]] = {}
    with bench_lock():
        for name in names:
            results[name] = _run_child(name, args, model, onnx_dir)
    ratios(results)
    summary: dict[str, Any] = {
        "model": model.stem,
        "tasks": args.tasks,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "n_ctx": N_CTX,
        "cpu_count": os.cpu_count(),
        "backends": results,
    }
    onnx, llama = results.get("onnx", {}), results.get("llamacpp", {})
    if onnx.get("decode_tok_s") and llama.get("decode_tok_s"):
        speed = onnx["decode_tok_s"] / llama["decode_tok_s"]
        points = 100 * abs(onnx["pass_at_1"] - llama["pass_at_1"])
        summary["onnx_vs_llamacpp"] = {
            "decode_ratio": round(speed, 3),
            "decode_target_met": speed >= DECODE_TARGET,
            "pass_at_1_points_apart": round(points, 1),
            "pass_at_1_target_met": points <= PASS_POINTS_TARGET,
        }
    text = json.dumps(summary, indent=2)
    print(text)
    if not args.no_save:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
