"""A lone request's first token on ``edgecloud serve``'s llama.cpp engine: its prompt read in one
pass, against the same prompt split in chunks of ``max_prefill_tokens`` (256).

The engine caps each step's prompt chunk so a long prompt never holds up answers that are
decoding; with none decoding, a prompt of up to ``n_batch`` (512) tokens is now read in one
pass. The split read of before is what an engine with ``n_batch`` 256 does to a lone prompt,
so the two are measured in one run, in-process, on the cloud model (1.5B, 2 threads), greedy,
one token asked: the median of ``--reps`` prompts of each length (distinct token ids, no prefix
reuse), the first dropped as a warm-up. Prints JSON; writes ``results/prefill_alone.json``.

    python benchmarks/prefill_alone.py [--lengths 200,300,450] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from chat_only import CLOUD_MODEL, RESULTS


def _first_token_ms(n_batch: int, lengths: list[int], reps: int) -> dict[str, float]:
    from edgecloud.runtime.completions import CompletionRequest
    from edgecloud.serving.llamacpp_engine import LlamaCppEngineBackend
    from edgecloud.store import resolve_model

    engine = LlamaCppEngineBackend(resolve_model(CLOUD_MODEL), n_ctx=2048, threads=2, n_batch=n_batch, max_batch=4)
    engine.load()
    out: dict[str, float] = {}
    try:
        for n in lengths:
            times = []
            for rep in range(reps + 1):
                prompt = [1000 + (n_batch + rep * 7919 + i * 13) % 20000 for i in range(n)]
                request = CompletionRequest.parse({"model": CLOUD_MODEL, "prompt": prompt, "max_tokens": 1,
                                                   "temperature": 0})
                started = time.perf_counter()
                list(engine.stream_completion(request))
                times.append(time.perf_counter() - started)
            out[str(n)] = round(1000 * statistics.median(times[1:]), 1)
    finally:
        engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="200,300,450")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    one_pass = _first_token_ms(512, lengths, args.reps)
    split = _first_token_ms(256, lengths, args.reps)
    out = {"model": CLOUD_MODEL, "threads": 2, "reps": args.reps, "first_token_ms_one_pass": one_pass,
           "first_token_ms_split_at_256": split,
           "one_pass_vs_split": {n: round(one_pass[n] / split[n], 3) for n in one_pass}}
    (RESULTS / "prefill_alone.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
