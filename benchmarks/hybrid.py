"""The hybrid client's cost over its backend, and how fast a broken cloud stream resumes on the edge.

1. **Overhead**: the same six prompts (48 new tokens, greedy) through ``EdgeCloud`` and through
   the edge backend it wraps, interleaved A/B then B/A, on the default 0.5B edge model. Three
   client set-ups: edge only; a router with a cloud configured and the cascade on (the default
   settings; rules scorer, the prompts score low, so they stay on the edge: the measured path is
   routing, failover, cost, metrics and the span); and every request through the cascade
   (a middle-band score: the edge answers off-stream, the packaged confidence check judges it,
   then it is replayed). Reported: median e2e ratio (client / direct) and median TTFT
   difference. Targets (the first two): overhead <= 2 % of e2e, <= 2 ms TTFT. The cascade holds
   the answer back by design (its TTFT is the whole answer); its e2e cost is reported.
2. **Mid-stream fallback**: a request pinned to the cloud (``route="cloud"``) streams from
   ``edgecloud serve`` (llama.cpp runtime, the 1.5B model), which is SIGKILLed after 12 chunks;
   the 0.5B edge continues. Reported: seconds from the kill to the first
   continued token, and ``resume_s`` (from the moment the client saw the failure). Target < 1 s.
3. **Async throughput**: 64 concurrent streamed requests to ``edgecloud serve`` (torch engine,
   SmolLM2, continuous batching) from ``AsyncEdgeCloud`` (native async HTTP) and from
   ``EdgeCloud`` in 64 threads. Reported: wall time, requests/s, the ratio, and the threads each
   client process added at its peak.

    python benchmarks/hybrid.py [--rounds 3] [--skip-fallback] [--skip-async]

Holds /tmp/edgecloud-bench.lock while timing; prints JSON and writes benchmarks/results/hybrid.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import DEFAULT_EDGE_MODEL, bench_lock, model_path

from edgecloud import AsyncEdgeCloud, EdgeCloud
from edgecloud.edge.llamacpp import LlamaCppBackend
from edgecloud.router.cascade import ConfidenceCheck
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
SMALL_MODEL = "smollm2-135m-instruct-q4"
CONCURRENT = 64


class _Middle:
    """Every request in the middle band: answered on the edge first, then judged."""

    name = "middle"
    bands = (0.3, 0.7)

    def score(self, request: Any) -> float:
        return 0.5


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
            policy=RoutePolicy(scorer=RulesScorer()),
        ),
        "every_request_cascaded": EdgeCloud(
            edge_model=None, edge_backend=edge, cloud_base_url="http://127.0.0.1:9", cloud_model="unused",
            policy=RoutePolicy(scorer=_Middle(), pii="off"),  # type: ignore[arg-type]
        ),
    }
    cascaded = setups["every_request_cascaded"].hybrid
    cascaded.confidence = ConfidenceCheck(threshold=0.0, coef=cascaded.confidence.coef,
                                          intercept=cascaded.confidence.intercept)  # judged, always accepted
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
    gated = [v for k, v in out.items() if k != "every_request_cascaded"]
    worst = max(v["e2e_overhead_pct_median"] for v in gated)
    worst_ttft = max(v["ttft_added_ms_median"] for v in gated)
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


def async_throughput() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from faults import ServeProcess

    messages = [[{"role": "user", "content": f"Count from 1 to {i % 5 + 3}."}] for i in range(CONCURRENT)]

    def threads_now() -> int:
        return threading.active_count()

    async def run_async(server: Any) -> tuple[float, int, int]:
        before, peak = threads_now(), threads_now()
        async with AsyncEdgeCloud(edge_model=None, cloud_base_url=server.url, cloud_model=SMALL_MODEL,
                                  cloud_api_key=server.api_key) as client:
            async def ask(m: list[dict[str, str]]) -> int:
                stream = await client.chat.completions.create(messages=m, max_tokens=16, temperature=0, stream=True)
                return len([c async for c in stream if c.text])

            start = time.perf_counter()
            tasks = [asyncio.create_task(ask(m)) for m in messages]
            while not all(t.done() for t in tasks):
                peak = max(peak, threads_now())
                await asyncio.sleep(0.01)
            wall = time.perf_counter() - start
            chunks = sum(t.result() for t in tasks)
        return wall, peak - before, chunks

    def run_threads(server: Any) -> tuple[float, int, int]:
        before, peak = threads_now(), [threads_now()]
        with EdgeCloud(edge_model=None, cloud_base_url=server.url, cloud_model=SMALL_MODEL,
                       cloud_api_key=server.api_key) as client:
            def ask(m: list[dict[str, str]]) -> int:
                peak[0] = max(peak[0], threads_now())
                return sum(1 for c in client.chat.completions.create(messages=m, max_tokens=16, temperature=0,
                                                                     stream=True) if c.text)

            start = time.perf_counter()
            with ThreadPoolExecutor(CONCURRENT) as pool:
                chunks = sum(pool.map(ask, messages))
            wall = time.perf_counter() - start
        return wall, peak[0] - before, chunks

    server = ServeProcess(str(model_path(SMALL_MODEL)), runtime="torch", ctx=1024).start(timeout=300)
    try:
        run_threads(server)  # warm the server (prefix cache, allocator) before either is timed
        rounds = []
        for r in range(2):
            order = ("async", "threads") if r % 2 == 0 else ("threads", "async")
            got = {}
            for kind in order:
                got[kind] = asyncio.run(run_async(server)) if kind == "async" else run_threads(server)
            rounds.append(got)
    finally:
        server.stop()
    a_wall = statistics.median(r["async"][0] for r in rounds)
    t_wall = statistics.median(r["threads"][0] for r in rounds)
    return {
        "concurrent": CONCURRENT, "server": "edgecloud serve --engine torch (SmolLM2, fp32)", "max_tokens": 16,
        "async_wall_s": round(a_wall, 3), "threads_wall_s": round(t_wall, 3),
        "async_requests_per_s": round(CONCURRENT / a_wall, 2), "threads_requests_per_s": round(CONCURRENT / t_wall, 2),
        "async_over_threads_throughput": round(t_wall / a_wall, 3),
        "async_extra_threads_peak": max(r["async"][1] for r in rounds),
        "threads_extra_threads_peak": max(r["threads"][1] for r in rounds),
        "content_chunks": {"async": rounds[-1]["async"][2], "threads": rounds[-1]["threads"][2]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-fallback", action="store_true")
    parser.add_argument("--skip-async", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args()
    with bench_lock():
        result: dict[str, Any] = {} if args.skip_overhead else {"overhead": overhead(args.rounds)}
        if not args.skip_fallback:
            result["midstream_fallback"] = midstream(args.rounds)
        if not args.skip_async:
            result["async_throughput"] = async_throughput()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
