"""Load held: a fixed request rate for minutes against ``edgecloud serve`` and against the hybrid
client's metrics server, with latency, errors and memory watched over the run.

An open-loop generator (requests start on a fixed schedule whatever the latency, as locust's
``constant_throughput`` does, so a slow server meets the queue instead of a slower client):

1. **edgecloud serve** (torch engine, SmolLM2, a real child process): streamed chat requests at
   ``--rate`` per second for ``--seconds``, 16 tokens each, a bounded queue. Every request must
   end as a 200 whose stream finished exactly once (one finish chunk, one ``[DONE]``), or a 429
   past the queue limit; nothing else.
2. **The hybrid client's metrics server** (``start_metrics_server`` of an ``EdgeCloud`` whose
   edge answers a steady trickle of chat requests meanwhile): ``GET /metrics`` at ``--metrics-rate``.

Reported per target: requests, status counts, p50/p99 latency over the first and the last third
of the run (stable means the last third is not worse by more than 50 %), and the server's RSS
at start and end (from ``/proc``). Prints JSON and writes ``benchmarks/results/load.json``.

    python benchmarks/load.py [--seconds 120] [--rate 2] [--metrics-rate 20] [--targets serve,client_metrics]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from _common import bench_lock, model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from faults import ServeProcess  # noqa: E402 - the test suite's server harness: a real child process

from edgecloud import EdgeCloud  # noqa: E402
from edgecloud.observability.client_metrics import start_metrics_server  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "load.json"
MODEL = "smollm2-135m-instruct-q4"
KEY = "sk-load"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


async def _open_loop(rate: float, seconds: float, send: Any, pid: int,
                     rss: list[float]) -> list[tuple[float, float, Any]]:
    """Start ``send()`` every ``1/rate`` s for ``seconds``; (start offset, latency, outcome) of each.
    Meanwhile the RSS of process ``pid`` is sampled every tenth of the run into ``rss`` (MiB)."""
    results: list[tuple[float, float, Any]] = []
    start = time.perf_counter()

    async def sample() -> None:
        while time.perf_counter() - start < seconds:
            rss.append(round(_rss(pid) / 2**20, 1))
            await asyncio.sleep(seconds / 10)

    sampler = asyncio.create_task(sample())

    async def one(at: float) -> None:
        began = time.perf_counter()
        outcome = await send()
        results.append((at, time.perf_counter() - began, outcome))

    # only unfinished tasks are kept: the generator runs in the measured client's process, and
    # holding thousands of finished tasks would show up as the client's memory growth
    pending: set[asyncio.Task[None]] = set()
    n = 0
    while (at := n / rate) < seconds:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        task = asyncio.create_task(one(at))
        pending.add(task)
        task.add_done_callback(pending.discard)
        n += 1
    await asyncio.gather(*pending, sampler)
    return results


def _summary(results: list[tuple[float, float, Any]], seconds: float, ok: Any) -> dict[str, Any]:
    statuses = Counter(str(outcome[0]) for _, _, outcome in results)
    third = seconds / 3
    first = [lat for at, lat, o in results if at < third and ok(o)]
    last = [lat for at, lat, o in results if at >= 2 * third and ok(o)]
    p99_first, p99_last = _percentile(first, 0.99), _percentile(last, 0.99)
    return {
        "requests": len(results),
        "statuses": dict(statuses),
        "p50_s": _percentile([lat for _, lat, o in results if ok(o)], 0.5),
        "p99_s": _percentile([lat for _, lat, o in results if ok(o)], 0.99),
        "p99_first_third_s": p99_first,
        "p99_last_third_s": p99_last,
        "p99_stable": p99_first is not None and p99_last is not None and p99_last <= 1.5 * p99_first + 0.05,
    }


def serve_load(seconds: float, rate: float) -> dict[str, Any]:
    server = ServeProcess(str(model_path(MODEL)), runtime="torch", ctx=512, api_key=KEY).start(timeout=300)
    try:
        for _ in range(4):  # warm-up (allocator, caches): memory is compared from here on
            httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                       json={"messages": [{"role": "user", "content": "Count from one to ten."}], "max_tokens": 16})
        rss_start = _rss(server.proc.pid)

        async def run() -> list[tuple[float, float, Any]]:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
            async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits,
                                         headers={"Authorization": f"Bearer {KEY}"}) as client:
                async def send() -> tuple[Any, int, int]:
                    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to ten."}],
                            "max_tokens": 16, "temperature": 0, "stream": True}
                    try:
                        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
                            finishes = dones = 0
                            async for line in reply.aiter_lines():
                                if line == "data: [DONE]":
                                    dones += 1
                                elif line.startswith("data: ") and '"finish_reason":"' in line.replace(" ", ""):
                                    finishes += 1
                            return reply.status_code, finishes, dones
                    except httpx.HTTPError as exc:
                        return type(exc).__name__, 0, 0

                return await _open_loop(rate, seconds, send, server.proc.pid, samples)

        samples: list[float] = []
        results = asyncio.run(run())
        rss_end = _rss(server.proc.pid)
    finally:
        server.stop()
    out = _summary(results, seconds, lambda o: o[0] == 200)
    answered = [o for _, _, o in results if o[0] == 200]
    out.update(
        target="edgecloud serve --engine torch (SmolLM2, fp32, max-batch 8, max-queue 64)", rate_per_s=rate,
        seconds=seconds, max_tokens=16,
        answered_exactly_once=all(o[1] == 1 and o[2] == 1 for o in answered),
        errors_other_than_429=sum(1 for _, _, o in results if o[0] not in (200, 429)),
        rss_start_mib=round(rss_start / 2**20, 1), rss_end_mib=round(rss_end / 2**20, 1), rss_samples_mib=samples,
    )
    return out


def metrics_load(seconds: float, rate: float) -> dict[str, Any]:
    import os

    stop = threading.Event()
    with EdgeCloud(edge_model=str(model_path(MODEL)), n_ctx=512) as client:
        metrics_server = start_metrics_server(metrics=client.metrics)
        chats = [0]

        def trickle() -> None:  # the client keeps working, so the metrics keep changing
            while not stop.is_set():
                client.chat.completions.create(messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
                chats[0] += 1
                stop.wait(0.5)

        client.chat.completions.create(messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)  # loads the edge
        rss_start = _rss(os.getpid())
        worker = threading.Thread(target=trickle, daemon=True)
        worker.start()
        url = f"http://127.0.0.1:{metrics_server.port}/metrics"

        async def run() -> list[tuple[float, float, Any]]:
            async with httpx.AsyncClient(timeout=30) as http:
                async def send() -> tuple[Any, int]:
                    try:
                        reply = await http.get(url)
                        return reply.status_code, len(reply.content)
                    except httpx.HTTPError as exc:
                        return type(exc).__name__, 0

                return await _open_loop(rate, seconds, send, os.getpid(), samples)

        samples: list[float] = []
        results = asyncio.run(run())
        rss_end = _rss(os.getpid())
        stop.set()
        worker.join(timeout=60)
        metrics_server.close()
    out = _summary(results, seconds, lambda o: o[0] == 200)
    out.update(target="EdgeCloud client metrics server (start_metrics_server), edge answering meanwhile",
               rate_per_s=rate, seconds=seconds, chats_answered_meanwhile=chats[0],
               errors=sum(1 for _, _, o in results if o[0] != 200),
               rss_start_mib=round(rss_start / 2**20, 1), rss_end_mib=round(rss_end / 2**20, 1),
               rss_samples_mib=samples)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--rate", type=float, default=2.0, help="chat requests per second to edgecloud serve")
    parser.add_argument("--metrics-rate", type=float, default=20.0, help="GET /metrics per second")
    parser.add_argument("--targets", default="serve,client_metrics", help="comma list of serve, client_metrics "
                        "(the others keep their last result in the results file)")
    args = parser.parse_args()
    runs = {"serve": lambda: serve_load(args.seconds, args.rate),
            "client_metrics": lambda: metrics_load(args.seconds, args.metrics_rate)}
    chosen = [name.strip() for name in args.targets.split(",") if name.strip()]
    if unknown := [name for name in chosen if name not in runs]:
        parser.error(f"unknown target(s) {unknown}; choose from {', '.join(runs)}")
    result = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    with bench_lock():
        for name in chosen:
            result[name] = runs[name]()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
