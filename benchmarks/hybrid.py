"""The hybrid client's cost over its backend, and how fast a broken cloud stream resumes on the edge.

1. **Overhead**: the same six prompts (48 new tokens, greedy) through ``EdgeCloud`` and through
   the edge backend it wraps, interleaved A/B then B/A, on the default 0.5B edge model. Two
   client set-ups: edge only, and a router with a cloud configured (rules scorer; the prompts
   score low, so they stay on the edge; the cascade is off so the measured path is routing,
   failover, cost, metrics and the span). Reported: median e2e ratio (client / direct) and
   median TTFT difference. Targets: overhead <= 2 % of e2e, <= 2 ms TTFT.
2. **Mid-stream fallback**: a request pinned to the cloud (``route="cloud"``) streams from
   ``edgecloud serve`` (llama.cpp runtime, the 1.5B model), which is SIGKILLed after 12 chunks;
   the 0.5B edge continues. Reported: seconds from the kill to the first
   continued token, and ``resume_s`` (from the moment the client saw the failure). Target < 1 s.

    python benchmarks/hybrid.py [--rounds 3] [--skip-fallback]

Holds /tmp/edgecloud-bench.lock while timing; prints JSON and writes benchmarks/results/hybrid.json.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import DEFAULT_EDGE_MODEL, bench_lock, model_path

from edgecloud import EdgeCloud
from edgecloud.edge.llamacpp import LlamaCppBackend
from edgecloud.router.policy import RoutePolicy
from edgecloud.router.scorers import RulesScorer
from edgecloud.types import ChatRequest

RESULTS = Path(__file__).resolve().parent / "results" / "hybrid.json"
CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct-q4"
MAX_TOKENS = 48
PROMPTS = [
    "What is the capital of Italy?",
    "Say hello in French.",
    "What is 12 plus 30?",
    "Name a colour of the rainbow.",
    "Is a tomato a fruit?",
    "Give me a synonym for happy.",
]
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def _timed(chunks: Any) -> tuple[float | None, float]:
    start = time.perf_counter()
    ttft = None
    for chunk in chunks:
        if ttft is None and chunk.text:
            ttft = time.perf_counter() - start
    return ttft, time.perf_counter() - start


def overhead(rounds: int) -> dict[str, Any]:
    edge = LlamaCppBackend(str(model_path(DEFAULT_EDGE_MODEL)))
    edge.load()
    setups = {
        "edge_only": EdgeCloud(edge_model=None, edge_backend=edge),
        "router_with_cloud": EdgeCloud(
            edge_model=None, edge_backend=edge, cloud_base_url="http://127.0.0.1:9", cloud_model="unused",
            config={"router": {"cascade": False}}, policy=RoutePolicy(scorer=RulesScorer()),
        ),
    }
    out: dict[str, Any] = {}
    for name, client in setups.items():
        direct_e2e, client_e2e, ttft_delta = [], [], []
        for r in range(rounds):
            for i, prompt in enumerate(PROMPTS):
                messages = [{"role": "user", "content": prompt}]
                request = ChatRequest(messages=messages, max_tokens=MAX_TOKENS, temperature=0)
                runs = {}
                order = ("direct", "client") if (r + i) % 2 == 0 else ("client", "direct")
                for side in order:
                    if side == "direct":
                        runs[side] = _timed(edge.stream(request))
                    else:
                        chunks = client.chat.completions.create(messages=messages, max_tokens=MAX_TOKENS,
                                                                temperature=0, stream=True)
                        runs[side] = _timed(chunks)
                direct_e2e.append(runs["direct"][1])
                client_e2e.append(runs["client"][1])
                if runs["direct"][0] is not None and runs["client"][0] is not None:
                    ttft_delta.append(runs["client"][0] - runs["direct"][0])
        ratios = [c / d for c, d in zip(client_e2e, direct_e2e)]
        out[name] = {
            "requests": len(ratios),
            "direct_e2e_median_s": round(statistics.median(direct_e2e), 4),
            "client_e2e_median_s": round(statistics.median(client_e2e), 4),
            "e2e_overhead_pct_median": round((statistics.median(ratios) - 1) * 100, 3),
            "ttft_added_ms_median": round(statistics.median(ttft_delta) * 1000, 3),
            "answered_on_edge": client.hybrid.totals.snapshot()["edge_requests"],
        }
    edge.close()
    worst = max(v["e2e_overhead_pct_median"] for v in out.values())
    worst_ttft = max(v["ttft_added_ms_median"] for v in out.values())
    out["targets"] = {"e2e_overhead_pct_max": 2.0, "ttft_added_ms_max": 2.0,
                      "met": worst <= 2.0 and worst_ttft <= 2.0}
    return out


def midstream(rounds: int) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from faults import ServeProcess  # the test suite's server harness: a real child process

    edge = LlamaCppBackend(str(model_path(DEFAULT_EDGE_MODEL)))
    edge.load()
    trials = []
    for _ in range(rounds):
        server = ServeProcess(CLOUD_MODEL, ctx=2048).start(timeout=300)
        with EdgeCloud(edge_model=None, edge_backend=edge, cloud_base_url=server.url, cloud_api_key=server.api_key,
                       cloud_model=CLOUD_MODEL, config={"fallback": {"max_retries": 0}},
                       ) as client:
            killed_at = None
            first_after = None
            seen = 0
            last = None
            for chunk in client.chat.completions.create(messages=STORY, max_tokens=96, temperature=0, stream=True,
                                                        route="cloud"):
                last = chunk
                if chunk.text:
                    seen += 1
                    if killed_at is not None and first_after is None and chunk.route.target == "edge":
                        first_after = time.perf_counter() - killed_at
                if seen == 12 and killed_at is None:
                    server.proc.send_signal(signal.SIGKILL)
                    killed_at = time.perf_counter()
            server.kill()
        switch = last.route.fallbacks[0] if last is not None and last.route and last.route.fallbacks else {}
        trials.append({"kill_to_next_token_s": round(first_after, 4) if first_after else None,
                       "resume_s": switch.get("resume_s"), "cause": switch.get("cause"),
                       "at_chars": switch.get("at_chars"), "continued_on": last.route.target if last else None})
    edge.close()
    values = [t["kill_to_next_token_s"] for t in trials if t["kill_to_next_token_s"] is not None]
    return {"trials": trials, "median_kill_to_next_token_s": round(statistics.median(values), 4) if values else None,
            "target_s": 1.0, "met": bool(values) and statistics.median(values) < 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-fallback", action="store_true")
    args = parser.parse_args()
    with bench_lock():
        result: dict[str, Any] = {"overhead": overhead(args.rounds)}
        if not args.skip_fallback:
            result["midstream_fallback"] = midstream(args.rounds)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
