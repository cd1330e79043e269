"""Router scoring latency: p50/p99 per request for the rules and learned scorers and the full policy.

Requests: every task prompt of the router's suites (HumanEval, code, maths, facts, long
prompts up to ~3,000 tokens) plus odd inputs (empty, 1 MB, binary junk, mixed scripts).
The learned scorer is trained here on synthetic labels (its cost does not depend on what it
learned). Prints JSON; the target is p99 <= 1 ms for the learned scorer on task prompts.

    python benchmarks/router_latency.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import bench_lock  # noqa: E402

from edgecloud.router.policy import RoutePolicy  # noqa: E402
from edgecloud.router.scorers import LearnedScorer, RulesScorer, train_scorer  # noqa: E402
from edgecloud.router.tasks import load_tasks  # noqa: E402


def _timings(fn, requests: list, repeat: int) -> dict:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        for request in requests:
            start = time.perf_counter()
            fn(request)
            times.append(time.perf_counter() - start)
    ms = np.array(times) * 1000
    return {"n": len(times), "p50_ms": round(float(np.percentile(ms, 50)), 4),
            "p99_ms": round(float(np.percentile(ms, 99)), 4), "max_ms": round(float(ms.max()), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tasks = load_tasks()
    requests = [{"messages": t.messages, "max_tokens": t.max_tokens} for t in tasks]
    rng = random.Random(0)
    rows = [{**r, "edge_pass": rng.random() < 0.5, "cloud_pass": True} for r in requests]
    learned = LearnedScorer(train_scorer(rows, c=1.0))
    odd = ["", "x" * 1_000_000, bytes(range(256)).decode("latin-1") * 200, "混合 scripts ünïcode 😀 " * 500]
    odd_requests = [{"messages": [{"role": "user", "content": text}]} for text in odd]
    policy = RoutePolicy(scorer=learned)
    with bench_lock():
        out = {
            "benchmark": "router_latency",
            "requests": len(requests),
            "rules": _timings(RulesScorer().score, requests, args.repeat),
            "learned": _timings(learned.score, requests, args.repeat),
            "policy_learned": _timings(policy.decide, requests, args.repeat),
            "odd_inputs_learned": _timings(learned.score, odd_requests, 1),
        }
    out["target_p99_ms"] = 1.0
    out["met"] = out["learned"]["p99_ms"] <= 1.0
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
