"""Speculation on the torch edge runtime against the same runtime decoding plainly, in one run.

Two :class:`~edgecloud.edge.torch.TorchBackend` on one device, ``speculate="off"`` and
``"auto"`` (prompt lookup, guessing only within the rows its load-time probe found to evaluate
bitwise like single steps: on a CPU that is usually none, on a CUDA GPU several). Each prompt is
answered twice by each (the first answer warms the prompt's shapes), greedy, and the second is
kept: decode tokens/s (tokens after the first over the time after the first), TTFT, whether the
text is identical, and the answer's ``usage.speculative``. Prompt kinds as in
``benchmarks/edge_speculation.py``: edit (copies the prompt), prose, code from scratch.

    python benchmarks/torch_edge_speculation.py [--model NAME] [--device cuda|cpu|mps] [--tokens 160] [--out F]

Prints one JSON object; writes benchmarks/results/torch_edge_speculation.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import model_path  # noqa: E402

from edgecloud.edge.torch import TorchBackend  # noqa: E402
from edgecloud.types import ChatRequest  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "torch_edge_speculation.json"

CODE = '''def read_scores(path):
    scores = {}
    with open(path) as fh:
        for row in fh:
            row = row.strip()
            if not row or row.startswith(";"):
                continue
            name, score = row.split(",", 1)
            scores[name.strip()] = int(score)
    return scores
'''
RECORD = {"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "city": "London", "known_for": "the first program"}
PROMPTS = {
    "edit": [f"Add a docstring to this function and return the whole code.\n```python\n{CODE}```",
             f"Rename the variable scores to totals in this function and return the whole code.\n```python\n{CODE}```",
             f"Return this record as JSON, unchanged: {json.dumps(RECORD)}"],
    "prose": ["Tell me a short story about a lighthouse keeper.", "Explain why the sky is blue."],
    "code": ["Write a Python function that checks whether a number is prime."],
}


def run(backend: TorchBackend, text: str, tokens: int) -> dict[str, Any]:
    req = ChatRequest(messages=[{"role": "user", "content": text}], max_tokens=tokens, temperature=0)
    sent = time.perf_counter(); stamps = []; parts = []; last = None
    for chunk in backend.stream(req):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter()); parts.append(chunk.choices[0].delta.content)
        last = chunk
    usage = last.usage
    n = usage.completion_tokens
    decode = (n - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else None
    return {"text": "".join(parts), "tokens": n, "ttft_s": stamps[0] - sent if stamps else None, "decode_tok_s": decode,
            "speculative": usage.speculative}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct-q4")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    path = model_path(args.model)
    backends = {m: TorchBackend(path, device=args.device, n_ctx=2048, speculate=m, reuse_prefix=False) for m in ("off", "auto")}
    report: dict[str, Any] = {"model": args.model, "device": args.device, "torch": __import__("torch").__version__}
    for m, b in backends.items():
        b.load()
        if b.speculator is not None:
            report["calibration"] = {"k_limit": b.speculator.k_limit, "disabled": b.speculator.disabled,
                                     "pass_cost_a_b": b.speculator.cost.coefficients()}
    rows: list[dict[str, Any]] = []
    for kind, texts in PROMPTS.items():
        for i, text in enumerate(texts):
            for rep in range(2):  # first: warm-up of this prompt's shapes
                plain, spec = run(backends["off"], text, args.tokens), run(backends["auto"], text, args.tokens)
            rows.append({"kind": kind, "prompt": i, "tokens": plain["tokens"], "plain_tok_s": plain["decode_tok_s"],
                         "spec_tok_s": spec["decode_tok_s"], "speedup": spec["decode_tok_s"] / plain["decode_tok_s"],
                         "ttft_ratio": spec["ttft_s"] / plain["ttft_s"], "identical": plain["text"] == spec["text"],
                         "speculative": spec["speculative"]})
            print(json.dumps(rows[-1]), flush=True)
    report["rows"] = rows
    for kind in PROMPTS:
        rs = [r for r in rows if r["kind"] == kind]
        report[kind] = {"speedup_median": sorted(r["speedup"] for r in rs)[len(rs) // 2],
                        "identical": f"{sum(r['identical'] for r in rs)}/{len(rs)}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("calibration", *PROMPTS) if k in report}))
    for backend in backends.values():
        backend.close()


if __name__ == "__main__":
    main()
