"""The edge model's quantization: how fast each choice decodes here, and how well it still drafts.

The published 0.5B file ("Q4_K_M") is mostly Q5_0 with a Q8_0 output head: its 896-wide rows
fit no K-quant, so llama.cpp's quantizer fell back to older types. Requantized with every tensor
as one 4-bit type (``edgecloud.store.requantize``), it reads far fewer bytes per token. What
that costs is measured where the edge's picks matter: verified mode keeps a drafted token only
where it equals the cloud's greedy pick, so the rate at which each file's greedy pick equals
the 1.5B's, over the 128 traced answers of ``draft_stop.py`` (8 families), is the acceptance a
draft can have. All-edge answers (route="edge", privacy-pinned requests) are graded on the
corpus too (``quality``).

    python benchmarks/edge_quant.py speed      # ms per decoded token, 1 and 2 threads (~2 min)
    python benchmarks/edge_quant.py agree      # greedy picks against the cloud's, by family (~4 min)
    python benchmarks/edge_quant.py quality --per-family 16   # all-edge answers graded (~10 min)
    python benchmarks/edge_quant.py report     # the table, and the type chosen held out by family

Results: ``results/edge_quant.json``. The type is chosen leave-one-family-out: among the types
at least 1.3x as fast as the published file, the one with the highest agreement on the other
seven families, scored on the eighth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "src"))

from _live import _sample  # noqa: E402
from chat_only import OUTCOMES, RESULTS, _rows  # noqa: E402

OUT = RESULTS / "edge_quant.json"
TRACES = RESULTS / "draft_stop_traces.jsonl"
BASE = "qwen2.5-coder-0.5b-instruct-q4"
#: The uniform 4-bit types tried (both repacked for AVX2/AVX-512 matmuls by llama.cpp).
TYPES = ("Q4_0", "IQ4_NL")
#: A type must decode at least this much faster than the published file to be worth making.
MIN_SPEEDUP = 1.3


def _files() -> dict[str, Path]:
    """The published file and each type made from it (the catalogue's default edge model for
    IQ4_NL; the others made once, kept beside it in the cache)."""
    from edgecloud.store import DEFAULT_DRAFT_MODEL, resolve_model
    from edgecloud.store.catalogue import require_entry
    from edgecloud.store.requantize import make

    base = resolve_model(BASE)
    files = {"published": base}
    for kind in TYPES:
        if kind == require_entry(DEFAULT_DRAFT_MODEL).source.type:
            files[kind] = resolve_model(DEFAULT_DRAFT_MODEL)
            continue
        dest = base.with_name(f"{BASE}.{kind.lower()}.bench.gguf")
        if not dest.exists():
            entry = require_entry(BASE).model_copy(update={"source": require_entry(BASE).source.model_copy(
                update={"kind": "requantized", "base": BASE, "type": kind})})
            make(entry, base, dest)
        files[kind] = dest
    return files


def _load() -> dict[str, Any]:
    return json.loads(OUT.read_text(encoding="utf-8")) if OUT.exists() else {}


def _save(data: dict[str, Any]) -> None:
    OUT.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def speed(args: argparse.Namespace) -> None:
    import llama_cpp
    import numpy as np

    out: dict[str, Any] = {}
    for name, path in _files().items():
        out[name] = {"bytes": path.stat().st_size}
        for threads in (1, 2):
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                                  verbose=False)
            prompt = llm.tokenize(b"def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n" * 16,
                                  add_bos=False)[:256]
            started = time.perf_counter()
            llm.eval(prompt)
            prefill = time.perf_counter() - started
            steps, n_vocab = [], llm.n_vocab()
            token = prompt[-1]
            for _ in range(80):  # greedy decoding deep in a context, as a draft runs
                started = time.perf_counter()
                llm.eval([token])
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
                token = int(logits.argmax())
                steps.append(time.perf_counter() - started)
            llm.close()
            out[name][f"decode_ms_{threads}t"] = round(1000 * statistics.median(steps[10:]), 2)
            out[name][f"prefill_256_ms_{threads}t"] = round(1000 * prefill, 1)
        print(name, out[name], file=sys.stderr)
    data = _load()
    data["speed"] = out
    _save(data)


def agree(args: argparse.Namespace) -> None:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    rows = {r["id"]: r for r in _rows(OUTCOMES)}
    traces = [json.loads(line) for line in TRACES.read_text(encoding="utf-8").splitlines()]
    out: dict[str, Any] = {}
    for name, path in _files().items():
        by_family: dict[str, list[int]] = {}
        with LlamaCppBackend(str(path), n_threads=2) as edge:
            for trace in traces:
                prompt = edge.tokenize_chat(rows[trace["id"]]["messages"])
                scores, _ = edge.score(prompt + trace["cloud"], start=len(prompt), top_n=1)
                counts = by_family.setdefault(trace["family"], [0, 0, 0])
                counts[0] += sum(s.argmax == c for s, c in zip(scores, trace["cloud"]))
                counts[1] += sum(s.argmax == e for s, e in zip(scores, trace["edge"]))
                counts[2] += len(scores)
        out[name] = {family: {"agree_with_cloud": round(a / n, 4), "same_as_published": round(s / n, 4), "tokens": n}
                     for family, (a, s, n) in sorted(by_family.items())}
        print(name, {f: v["agree_with_cloud"] for f, v in out[name].items()}, file=sys.stderr)
    data = _load()
    data["agree"] = out
    _save(data)


def quality(args: argparse.Namespace) -> None:
    from edgecloud.edge.llamacpp import LlamaCppBackend
    from edgecloud.router.training.corpus import load_corpus
    from edgecloud.router.training.tasks import grade
    from edgecloud.types import ChatRequest

    tasks = {t.id: t for t in load_corpus(full=True)}
    sample = _sample(_rows(OUTCOMES), args.per_family)
    out: dict[str, Any] = {}
    for name, path in _files().items():
        if name != "published" and name not in args.types.split(","):
            continue
        with LlamaCppBackend(str(path)) as edge:
            for row in sample:
                request = ChatRequest(messages=row["messages"], max_tokens=row["max_tokens"], temperature=0.0)
                text = "".join(c.choices[0].delta.content or "" for c in edge.stream(request) if c.choices)
                out.setdefault(row["id"], {"family": row["suite"]})[name] = bool(grade(tasks[row["id"]], text))
        print(name, sum(r[name] for r in out.values()), "of", len(out), file=sys.stderr)
    data = _load()
    data["quality"] = out
    _save(data)


def report(args: argparse.Namespace) -> None:
    data = _load()
    data["report"] = _report(data)
    _save(data)
    print(json.dumps(data["report"], indent=1))


def _report(data: dict[str, Any]) -> dict[str, Any]:
    """The table, the type chosen held out by family, and the paired all-edge grades."""
    speeds, agreement = data["speed"], data["agree"]
    fast = [t for t in TYPES if speeds["published"]["decode_ms_2t"] / speeds[t]["decode_ms_2t"] >= MIN_SPEEDUP]
    families = sorted(agreement["published"])

    def rate(name: str, keep: list[str]) -> float:
        cells = [agreement[name][f] for f in keep]
        return sum(c["agree_with_cloud"] * c["tokens"] for c in cells) / sum(c["tokens"] for c in cells)

    held_out = {}
    for family in families:
        rest = [f for f in families if f != family]
        chosen = max(fast, key=lambda t: rate(t, rest))
        held_out[family] = {"chosen": chosen, "agree_with_cloud": round(rate(chosen, [family]), 4),
                            "published": round(rate("published", [family]), 4)}
    table = {name: {"decode_ms_2t": speeds[name]["decode_ms_2t"], "decode_ms_1t": speeds[name]["decode_ms_1t"],
                    "speedup_2t": round(speeds["published"]["decode_ms_2t"] / speeds[name]["decode_ms_2t"], 2),
                    "mib": round(speeds[name]["bytes"] / 2**20), "agree_with_cloud": round(rate(name, families), 4)}
             for name in speeds}
    graded = data.get("quality", {})
    for name in table:
        rows = [r for r in graded.values() if name in r]
        if rows:
            table[name]["edge_pass"] = f"{sum(r[name] for r in rows)}/{len(rows)}"
    made = [n for n in TYPES if graded and all(n in r for r in graded.values())]
    paired = {n: {"only_published_passed": sum(r["published"] and not r[n] for r in graded.values()),
                  "only_this_passed": sum(r[n] and not r["published"] for r in graded.values())} for n in made}
    return {"table": table, "held_out": held_out, "all_edge_paired": paired,
            "mean_of_families_held_out": round(statistics.fmean(v["agree_with_cloud"] for v in held_out.values()), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="phase", required=True)
    sub.add_parser("speed")
    sub.add_parser("agree")
    q = sub.add_parser("quality")
    q.add_argument("--per-family", type=int, default=16)
    q.add_argument("--types", default="IQ4_NL", help="comma-separated: the made types to grade beside the published")
    sub.add_parser("report")
    args = parser.parse_args()
    {"speed": speed, "agree": agree, "quality": quality, "report": report}[args.phase](args)


if __name__ == "__main__":
    main()
