"""Sessions that outlive the process: TTFT of a conversation's next turn restored from the disk
tier, against recomputing it and against a RAM hit, on the real edge runtime.

For each model and history length (1k, 4k, 8k tokens) three fresh processes run:

1. **writer**: a conversation of that length is answered (greedy) with a session name, and its KV
   written to disk (``save_session``, timed: copy + write + fsync); the file's bytes are the
   disk cost.
2. **recompute**: a fresh process with an empty cache answers the next turn (history + answer +
   a new question): TTFT = prefill of everything.
3. **restore**: a fresh process with the writer's cache answers the same next turn: TTFT =
   reading the state + prefilling the new question. Then another conversation overwrites the
   context (its state goes to the RAM tier) and the next turn is asked again: the RAM hit.

The model is loaded before any clock starts (TTFT is the first token of a loaded runtime). The
state file is read through the OS page cache (it was just written), as when an app is relaunched
soon after; a cold disk adds its read time (~5 ms per 100 MB on an SSD). The restored answers
are compared with the one the first process gives when it is never stopped (the same KV must
give the same tokens), and with the recomputed one (greedy; see ``identical_to_recompute``).

Usage::

    python benchmarks/kv_tiers.py                    # 0.5B and 1.5B, 1k/4k/8k
    python benchmarks/kv_tiers.py --models qwen2.5-coder-0.5b-instruct-q4 --sizes 1000

Prints one JSON object; writes benchmarks/results/kv_tiers.json and .png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_lock, model_path  # noqa: E402

MODELS = ("qwen2.5-coder-0.5b-instruct-q4", "qwen2.5-coder-1.5b-instruct-q4")
SIZES = (1000, 4000, 8000)
N_CTX = 9216
ANSWER_TOKENS = 24
RESULTS = Path(__file__).resolve().parent / "results"
SESSION = "bench"


def _history(tokens: int, count: Any) -> list[dict[str, str]]:
    """A deterministic chat of about ``tokens`` tokens (``count(messages)`` measures it)."""
    messages = [{"role": "system", "content": "You are a careful code reviewer for a Python project."}]
    turn = 0
    while count(messages) < tokens:
        lines = "\n".join(f"    total_{turn}_{i} = compute(value_{i}, weight={i % 7}) + offset_{turn}" for i in range(12))
        messages.append({"role": "user", "content": f"Review function number {turn}:\n```python\ndef f{turn}():\n{lines}\n```"})
        messages.append({"role": "assistant", "content": f"Function {turn} repeats the same call twelve times; "
                                                         f"a loop over range(12) would be shorter and clearer."})
        turn += 1
    return messages


def _backend(model: Path, cache: Path) -> Any:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    return LlamaCppBackend(model, n_ctx=N_CTX, disk_cache_bytes=8 * 2**30, cache_dir=cache)


def _ttft(backend: Any, messages: list[dict[str, str]]) -> dict[str, Any]:
    from edgecloud.types import ChatRequest

    request = ChatRequest(messages=messages, temperature=0, max_tokens=ANSWER_TOKENS, prompt_cache_key=SESSION)
    start = time.perf_counter()
    first = None
    text: list[str] = []
    usage = None
    for chunk in backend.stream(request):
        if chunk.text and first is None:
            first = time.perf_counter() - start
        text.append(chunk.text)
        usage = chunk.usage or usage
    return {"ttft_s": first, "text": "".join(text), "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_tokens}


def _next_turn(history: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
    return [*history, {"role": "assistant", "content": answer},
            {"role": "user", "content": "Which of these functions would you rewrite first, and why?"}]


def child(mode: str, model: Path, cache: Path, size: int) -> dict[str, Any]:
    backend = _backend(model, cache)
    backend.load()
    count = lambda m: len(backend.tokenize_chat(m))  # noqa: E731
    history = _history(size, count)
    try:
        if mode == "writer":
            first = _ttft(backend, history)
            start = time.perf_counter()
            saved = backend.save_session(SESSION)
            write_s = time.perf_counter() - start
            files = list(cache.glob("*/*.kv"))
            # what a killed process leaves: the state as saved, before this process goes on
            shutil.copytree(cache, cache.parent / "snapshot")
            live = _ttft(backend, _next_turn(history, first["text"]))  # the same process, never stopped
            return {"history_tokens": first["prompt_tokens"], "answer": first["text"], "saved_tokens": saved,
                    "write_s": write_s, "file_bytes": max(f.stat().st_size for f in files), "live": live}
        answer = json.loads((cache.parent / "answer.json").read_text())["answer"]
        turn = _next_turn(history, answer)
        result = {"next_turn": _ttft(backend, turn)}
        if mode == "restore":
            result["disk_restores"] = backend.stats.disk_restores
            _ttft(backend, [{"role": "user", "content": "Unrelated: write a haiku about rain."}])
            restores = backend.stats.restores
            result["ram_hit"] = _ttft(backend, turn)
            result["ram_restores"] = backend.stats.restores - restores
        return result
    finally:
        backend.close()


def _run_child(mode: str, model: Path, cache: Path, size: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--model", str(model), "--cache", str(cache),
                          "--size", str(size)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(name: str, size: int) -> dict[str, Any]:
    model = model_path(name)
    with tempfile.TemporaryDirectory(prefix="kv-bench-") as tmp:
        written, empty = Path(tmp) / "written" / "kv", Path(tmp) / "empty" / "kv"
        written.mkdir(parents=True)
        empty.mkdir(parents=True)
        writer = _run_child("writer", model, written, size)
        for folder in (written, empty):
            (folder.parent / "answer.json").write_text(json.dumps({"answer": writer["answer"]}))
        recompute = _run_child("recompute", model, empty, size)["next_turn"]
        restored = _run_child("restore", model, written.parent / "snapshot", size)
    disk, ram = restored["next_turn"], restored["ram_hit"]
    tokens = writer["saved_tokens"]
    return {
        "model": name, "history_tokens": writer["history_tokens"], "next_turn_prompt_tokens": disk["prompt_tokens"],
        "ttft_recompute_s": recompute["ttft_s"], "ttft_disk_s": disk["ttft_s"], "ttft_ram_s": ram["ttft_s"],
        "disk_vs_recompute": disk["ttft_s"] / recompute["ttft_s"], "ram_vs_recompute": ram["ttft_s"] / recompute["ttft_s"],
        "cached_tokens_disk": disk["cached_tokens"], "cached_tokens_ram": ram["cached_tokens"],
        "cached_tokens_recompute": recompute["cached_tokens"],
        "disk_restores": restored["disk_restores"], "ram_restores": restored["ram_restores"],
        "state_tokens": tokens, "file_bytes": writer["file_bytes"],
        "disk_bytes_per_1k_tokens": writer["file_bytes"] / tokens * 1000, "write_s": writer["write_s"],
        # restored KV is the KV the first process held: the answer is the one it would have given
        "identical_to_uninterrupted": disk["text"] == ram["text"] == writer["live"]["text"],
        # recomputing evaluates the answer's tokens in one batch instead of one by one: float
        # sums in another order, and a greedy 0.5B answer may turn at a near tie
        "identical_to_recompute": disk["text"] == recompute["text"],
        "answers": {"uninterrupted": writer["live"]["text"], "disk": disk["text"], "ram": ram["text"],
                    "recompute": recompute["text"]},
    }


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == name]
        xs = range(len(mine))
        for offset, (key, label) in enumerate((("ttft_recompute_s", "recompute"), ("ttft_disk_s", "restore from disk"),
                                                ("ttft_ram_s", "RAM hit"))):
            ax.bar([x + (offset - 1) * 0.27 for x in xs], [r[key] for r in mine], width=0.27, label=label)
        ax.set_xticks(list(xs), [f"{r['history_tokens']:,}" for r in mine])
        ax.set_yscale("log")
        ax.set_xlabel("history tokens")
        ax.set_ylabel("TTFT of the next turn (s, log)")
        ax.set_title(name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--cache", type=Path)
    parser.add_argument("--size", type=int)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_tiers.json")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.cache, args.size)))
        return
    rows = []
    with bench_lock():
        for name in args.models:
            for size in args.sizes:
                row = measure(name, size)
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    four_k = [r for r in rows if 3000 <= r["history_tokens"] <= 5000]
    report = {
        "rows": rows,
        "targets": {
            "disk_restore_at_4k_vs_recompute_max": max((r["disk_vs_recompute"] for r in four_k), default=None),
            "disk_restore_target": 0.1,
            "ram_hit_vs_recompute_max": max((r["ram_vs_recompute"] for r in rows), default=None),
            "ram_hit_target": 0.05,
            "identical_to_uninterrupted": all(r["identical_to_uninterrupted"] for r in rows),
            "identical_to_recompute": sum(r["identical_to_recompute"] for r in rows),
            "rows": len(rows),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(rows, args.out.with_suffix(".png"))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
