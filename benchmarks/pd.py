"""Prefill/decode disaggregation against one vLLM instance, in one run: TTFT and inter-token
latency under concurrent streams with long prompts, the answers compared, memory of each side.

Starts ``edgecloud serve --engine vllm --disaggregate prefill=1,decode=1`` and a single
``edgecloud serve --engine vllm`` (the same model and flags), one after the other (a 2-core
machine cannot hold both well), and sends each ``--streams`` concurrent streamed requests (default
8) with prompts of about ``--prompt-tokens`` tokens (default 2,000), greedy, ``--tokens`` new
tokens each. Reported per setup: TTFT p50/p99, ITL p50/p99, aggregate tokens/s, peak RSS of the
server's process tree; and whether every answer is the single instance's. A 2-core machine shows
no speed-up (both sides share the cores); what it shows is that the split runs, streams and
answers the same.

    python benchmarks/pd.py [--model NAME] [--streams 8] [--prompt-tokens 2000] [--tokens 32]

Prints one JSON object; writes benchmarks/results/pd.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_lock  # noqa: E402
from serving import MemoryWatch, _percentile, delta_text, free_port, stream_chunks  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "pd.json"
CITIES = ["Lyon", "Marseille", "Toulouse", "Nice", "Nantes", "Lille", "Bordeaux", "Rennes", "Reims", "Dijon"]


def prompt(i: int, tokens: int) -> str:
    """A distinct long prompt (about ``tokens`` tokens: ~2 per listed city)."""
    cities = ", ".join(CITIES[(i + j) % len(CITIES)] for j in range(tokens // 2))
    return f"Request {i}. Which country are all of these cities in? {cities}. Answer in one sentence."


async def _one(client: httpx.AsyncClient, url: str, model: str, text: str, tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens, "temperature": 0,
            "stream": True}
    sent = time.perf_counter()
    stamps, parts = [], []
    async for chunk in stream_chunks(client, url, body):
        piece = delta_text(chunk)
        if piece:
            stamps.append(time.perf_counter())
            parts.append(piece)
    return {"sent": sent, "stamps": stamps, "text": "".join(parts)}


def measure(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
            return await asyncio.gather(*[_one(client, url, model, prompt(i, args.prompt_tokens), args.tokens)
                                          for i in range(args.streams)])

    started = time.perf_counter()
    results = asyncio.run(run())
    ttft = [r["stamps"][0] - r["sent"] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    wall = max(r["stamps"][-1] for r in results if r["stamps"]) - started
    return {"ttft_p50_s": round(_percentile(ttft, 0.5), 3), "ttft_p99_s": round(_percentile(ttft, 0.99), 3),
            "itl_p50_s": round(_percentile(itl, 0.5), 4) if itl else None,
            "itl_p99_s": round(_percentile(itl, 0.99), 4) if itl else None,
            "tokens_per_s": round(sum(len(r["stamps"]) for r in results) / wall, 2),
            "answers": [r["text"] for r in results]}


def serve(extra: list[str], model: str, log: Path) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgecloud", "serve", "--engine", "vllm", "--model", model,
                                 "--quant", "bf16", "--ctx", "4096", "--max-batch", "8", "--port", str(port),
                                 "--vllm-arg=--enforce-eager", *extra],
                                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1200
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
        if time.monotonic() > deadline:
            raise SystemExit(f"the server did not serve within 1200 s; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    report: dict[str, Any] = {"model": args.model, "streams": args.streams, "prompt_tokens": args.prompt_tokens,
                              "tokens": args.tokens}
    with bench_lock(), tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        for name, extra in (("single", []), ("disaggregated", ["--disaggregate", "prefill=1,decode=1"])):
            proc, url = serve(extra, args.model, Path(tmp) / f"{name}.log")
            watch = MemoryWatch(proc.pid)
            try:
                measure(url, args.model, argparse.Namespace(**{**vars(args), "streams": 1, "tokens": 4}))  # warm-up
                report[name] = measure(url, args.model, args)
            finally:
                memory = watch.stop()
                os.killpg(proc.pid, 15)
                proc.wait(timeout=120)
            report[name].update(memory)
            print(f"pd: {name}: " + json.dumps({k: v for k, v in report[name].items() if k != 'answers'}),
                  file=sys.stderr, flush=True)
    single, split = report["single"], report["disaggregated"]
    report["answers_identical"] = f"{sum(a == b for a, b in zip(single['answers'], split['answers']))}/{args.streams}"
    report["ratios"] = {k: round(split[k] / single[k], 3) for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                                                                   "tokens_per_s") if single.get(k) and split.get(k)}
    for name in ("single", "disaggregated"):
        report[name].pop("answers")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
