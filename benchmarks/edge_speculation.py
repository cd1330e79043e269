"""Speculative decoding on the device against the same runtime decoding plainly, in one run.

For each model (default: the 0.5B and the 1.5B), two edge runtimes are loaded (llama.cpp, or
with ``--runtime torch`` the torch one on ``--device``) — one with ``speculate="off"``, one with
the default (``"auto"``: prompt lookup) — and every prompt is
answered by both, greedy, from a cleared context (the prefill is the same work for both), the two
taking turns prompt by prompt so the machine's drift weighs on both alike. Prompts come in three
kinds:

- **edit**: the answer copies from the prompt — rename in a given function, fix a given bug, add
  a docstring, JSON from a given record, a given paragraph rewritten with one change;
- **prose**: free text the prompt does not contain;
- **code**: a function written from scratch.

Per answer: TTFT, decode tokens/s (tokens after the first over the time after the first), and
whether the text is identical. Per kind: the median ratio speculating / plain of decode tokens/s
and of TTFT; the targets (edit >= 2.0x, prose and code >= 0.95x, TTFT <= 1.05x, identical text
everywhere) under ``targets``. ``--repeats`` answers each prompt that many times per runtime
(the median is kept).

    python benchmarks/edge_speculation.py [--models NAME ...] [--tokens 192] [--repeats 1] [--fixed-k K --out F]
                                          [--runtime llamacpp|torch] [--device cuda]

``--fixed-k`` guesses K tokens every step instead of letting the controller decide (what guessing
costs where the controller would not guess). The calibration (how many rows one pass verifies
exactly, the fitted cost of a pass) is in each model's entry.

Prints one JSON object; writes benchmarks/results/edge_speculation.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_lock, model_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "edge_speculation.json"
MODELS = ("qwen2.5-coder-0.5b-instruct-q4", "qwen2.5-coder-1.5b-instruct-q4")

_CONFIG = '''def parse_config(path):
    with open(path) as fh:
        lines = fh.readlines()
    result = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        result[key.strip()] = value.strip()
    return result
'''
_MEAN = '''def mean_of_positive(values):
    total = 0
    count = 0
    for value in values:
        if value > 0:
            total += value
            count += 1
    return total / len(values)
'''
_CLASS = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity):
        if name in self.items:
            self.items[name] += quantity
        else:
            self.items[name] = quantity

    def remove(self, name, quantity):
        if name not in self.items:
            raise KeyError(name)
        self.items[name] -= quantity
        if self.items[name] <= 0:
            del self.items[name]

    def total(self):
        return sum(self.items.values())
'''
_RECORD = {"id": 4182, "name": "Ada Lovelace", "born": 1815, "died": 1852, "fields": ["mathematics", "computing"],
           "city": "London", "known_for": "the first published algorithm for a computing machine"}
_PARAGRAPH = ("The river rises in the northern hills, where snow melts slowly through the spring. It runs south "
              "through three valleys, turning the wheels of old mills, and widens near the town of Ashford before "
              "it reaches the sea. Fishermen say the water is coldest in May, when the last snow comes down from "
              "the hills, and warmest in late August.")

PROMPTS: dict[str, list[str]] = {
    "edit": [
        f"Rename the function parse_config to load_settings and the variable result to settings. Return the whole "
        f"code.\n```python\n{_CONFIG}```",
        f"This function divides by the wrong count. Fix the bug and return the whole corrected function.\n```python\n{_MEAN}```",
        f"Add type hints to every method of this class and return the whole class.\n```python\n{_CLASS}```",
        f"Return this record as JSON with the same keys and values, pretty-printed with two-space indentation:\n"
        f"{json.dumps(_RECORD)}",
        f"Rewrite this paragraph, changing only 'Ashford' to 'Bramley'. Return the whole paragraph.\n\n{_PARAGRAPH}",
        f"Add a docstring to the method remove and return the whole class.\n```python\n{_CLASS}```",
    ],
    "prose": [
        "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain to a new programmer why version control matters, in a few paragraphs.",
        "Describe a walk through a forest in autumn.",
    ],
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
        "Write a Python class for a bounded queue with put, get and a size limit.",
        "Write a JavaScript function that debounces another function.",
    ],
}
TARGETS = {"edit_min": 2.0, "other_min": 0.95, "ttft_max": 1.05}


def _answer(backend: Any, prompt: str, tokens: int) -> dict[str, Any]:
    from edgecloud.edge.llamacpp import LlamaCppBackend
    from edgecloud.types import ChatRequest

    if isinstance(backend, LlamaCppBackend):  # the torch runtime here keeps no prefix (reuse_prefix=False)
        backend.clear_prefix_cache()
    request = ChatRequest(messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=tokens)
    start = time.perf_counter()
    stamps: list[float] = []
    text: list[str] = []
    usage = None
    for chunk in backend.stream(request):
        if chunk.text:
            stamps.append(time.perf_counter())
            text.append(chunk.text)
        usage = chunk.usage or usage
    generated = usage.completion_tokens if usage is not None else 0
    decode = (generated - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else None
    spec = usage.speculative if usage is not None else None
    return {"ttft_s": stamps[0] - start if stamps else None, "decode_tokens_per_s": decode, "tokens": generated,
            "text": "".join(text),
            "accepted": spec["num_accepted_tokens"] if spec else 0, "drafted": spec["num_draft_tokens"] if spec else 0}


def _backend(runtime: str, path: Path, device: str, speculate: str, fixed_k: int | None) -> Any:
    """One edge runtime on ``path``, each answer from a cleared context (the prefill is the same work for both)."""
    if runtime == "torch":
        from edgecloud.edge.torch import TorchBackend

        return TorchBackend(path, device=device, n_ctx=2048, speculate=speculate, speculate_k=fixed_k,
                            reuse_prefix=False)
    from edgecloud.edge.llamacpp import LlamaCppBackend

    return LlamaCppBackend(path, n_ctx=2048, speculate=speculate, speculate_k=fixed_k, prefix_cache_bytes=0)


def measure(name: str, tokens: int, repeats: int, fixed_k: int | None = None, runtime: str = "llamacpp",
            device: str = "auto") -> dict[str, Any]:
    path = model_path(name)
    plain = _backend(runtime, path, device, "off", None)
    spec = _backend(runtime, path, device, "auto", fixed_k)  # the default
    rows = []
    try:
        plain.load()
        spec.load()
        assert spec.speculator is not None
        calibration = {"k_limit": spec.speculator.k_limit, "disabled": spec.speculator.disabled,
                       "pass_seconds_a_b": spec.speculator.cost.coefficients()}
        print(json.dumps({"model": name, "calibration": calibration}), file=sys.stderr, flush=True)
        _answer(spec, "Say hello.", 16)  # the controller's first measurements of a pass
        for kind, prompts in PROMPTS.items():
            for i, prompt in enumerate(prompts):
                runs: dict[str, list[dict[str, Any]]] = {"plain": [], "spec": []}
                for r in range(repeats):
                    order = [("plain", plain), ("spec", spec)]
                    for label, backend in order if (i + r) % 2 == 0 else order[::-1]:
                        runs[label].append(_answer(backend, prompt, tokens))
                p, s = runs["plain"], runs["spec"]
                row = {
                    "kind": kind, "prompt": i, "tokens": s[0]["tokens"],
                    "plain_decode_tokens_per_s": statistics.median(x["decode_tokens_per_s"] for x in p),
                    "spec_decode_tokens_per_s": statistics.median(x["decode_tokens_per_s"] for x in s),
                    "plain_ttft_s": statistics.median(x["ttft_s"] for x in p),
                    "spec_ttft_s": statistics.median(x["ttft_s"] for x in s),
                    "accepted_share": s[0]["accepted"] / max(1, s[0]["tokens"]),
                    "identical": all(x["text"] == p[0]["text"] for x in p + s),
                }
                row["speedup"] = row["spec_decode_tokens_per_s"] / row["plain_decode_tokens_per_s"]
                row["ttft_ratio"] = row["spec_ttft_s"] / row["plain_ttft_s"]
                print(json.dumps({"model": name, **row}), file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        plain.close()
        spec.close()
    kinds = {}
    for kind in PROMPTS:
        mine = [r for r in rows if r["kind"] == kind]
        kinds[kind] = {"speedup_median": round(statistics.median(r["speedup"] for r in mine), 3),
                       "speedup_min": round(min(r["speedup"] for r in mine), 3),
                       "ttft_ratio_median": round(statistics.median(r["ttft_ratio"] for r in mine), 3),
                       "accepted_share_median": round(statistics.median(r["accepted_share"] for r in mine), 3),
                       "identical": f"{sum(r['identical'] for r in mine)}/{len(mine)}"}
    return {"model": name, "runtime": runtime, "fixed_k": fixed_k, "calibration": calibration, "kinds": kinds, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--fixed-k", type=int, default=None, help="guess this many tokens every step (no controller)")
    parser.add_argument("--runtime", choices=("llamacpp", "torch"), default="llamacpp")
    parser.add_argument("--device", default="auto", help="torch only: cuda, mps, cpu or auto")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with bench_lock():
        models = [measure(name, args.tokens, args.repeats, args.fixed_k, args.runtime, args.device)
                  for name in args.models]
    report = {
        "benchmark": "edge_speculation", "tokens": args.tokens, "repeats": args.repeats, "models": models,
        "targets": {
            **TARGETS,
            "edit_median_speedup": {m["model"]: m["kinds"]["edit"]["speedup_median"] for m in models},
            "prose_code_min_median": {m["model"]: min(m["kinds"]["prose"]["speedup_median"],
                                                      m["kinds"]["code"]["speedup_median"]) for m in models},
            "ttft_ratio_max_median": {m["model"]: max(k["ttft_ratio_median"] for k in m["kinds"].values())
                                      for m in models},
            "identical": all(r["identical"] for m in models for r in m["rows"]),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
