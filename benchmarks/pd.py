"""Prefill/decode disaggregation against one vLLM instance, in one run: TTFT and inter-token
latency under concurrent streams with long prompts, the answers compared, memory of each side.

Starts ``edgecloud serve --engine vllm --disaggregate prefill=1,decode=1`` and a single
``edgecloud serve --engine vllm`` (the same model and flags), one after the other (a 2-core
machine cannot hold both well), and sends each ``--streams`` concurrent streamed requests (default
8) with prompts of about ``--prompt-tokens`` tokens (default 2,000), greedy, ``--tokens`` new
tokens each. Reported per setup: TTFT p50/p99, ITL p50/p99, aggregate tokens/s, peak RSS of the
server's process tree and of each vLLM instance; and whether every answer is the single
instance's (against how many of the single instance's answers a second round of the same streams
repeats: concurrent streams are batched differently from run to run, and batch shapes move
rounding). Then the decode instance is killed (SIGKILL of its process group) and the run records
how long the proxy takes to say so (``/health`` 503, a request 503 ``decode_unavailable``), how
long until the launcher has it serving again, and whether the first answer after it is the same.
A 2-core machine shows no speed-up (both sides share the cores); what it shows is that the split
runs, streams, answers the same and survives a side restarting.

``--quant`` defaults to bf16 where the CPU has bfloat16 dot products and fp32 elsewhere (vLLM's
CPU build emulates bf16 without them, several times slower than fp32).

    python benchmarks/pd.py [--model NAME] [--streams 8] [--prompt-tokens 2000] [--tokens 32]
                            [--quant auto|fp32|bf16] [--no-restart]

Prints one JSON object; writes benchmarks/results/pd.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_lock  # noqa: E402
from serving import MemoryWatch, _percentile, delta_text, free_port, stream_chunks  # noqa: E402

from edgecloud.runtime.hardware import cpu_has_bf16  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "pd.json"
CITIES = ["Lyon", "Marseille", "Toulouse", "Nice", "Nantes", "Lille", "Bordeaux", "Rennes", "Reims", "Dijon"]


def prompt(i: int, tokens: int) -> str:
    """A distinct long prompt of about ``tokens`` tokens (a listed city and its comma are ~2.7
    tokens for Qwen's tokenizer; the run reports the prompt tokens the server counted)."""
    cities = ", ".join(CITIES[(i + j) % len(CITIES)] for j in range(tokens * 10 // 27))
    return f"Request {i}. Which country are all of these cities in? {cities}. Answer in one sentence."


async def _one(client: httpx.AsyncClient, url: str, model: str, text: str, tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    stamps, parts, prompt_tokens = [], [], None
    async for chunk in stream_chunks(client, url, body):
        prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens)
        piece = delta_text(chunk)
        if piece:
            stamps.append(time.perf_counter())
            parts.append(piece)
    return {"sent": sent, "stamps": stamps, "text": "".join(parts), "prompt_tokens": prompt_tokens}


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
    counted = [r["prompt_tokens"] for r in results if r["prompt_tokens"]]
    return {"prompt_tokens_p50": int(statistics.median(counted)) if counted else None,
            "ttft_p50_s": round(_percentile(ttft, 0.5), 3), "ttft_p99_s": round(_percentile(ttft, 0.99), 3),
            "itl_p50_s": round(_percentile(itl, 0.5), 4) if itl else None,
            "itl_p99_s": round(_percentile(itl, 0.99), 4) if itl else None,
            "tokens_per_s": round(sum(len(r["stamps"]) for r in results) / wall, 2),
            "answers": [r["text"] for r in results]}


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def serve(extra: list[str], model: str, quant: str, log: Path) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    while not all(_port_free(port + n) for n in (1, 2)):  # the instances take the ports after the proxy's
        port = free_port()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgecloud", "serve", "--engine", "vllm", "--model", model,
                                 "--quant", quant, "--ctx", "4096", "--max-batch", "8", "--port", str(port),
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


def instances(proc: subprocess.Popen[str], url: str) -> dict[str, psutil.Process]:
    """The vLLM instances the launcher started, by role (``single`` where it is one), from the
    ``--port`` on their command lines: the proxy's port + 1 is the prefill instance, + 2 decode."""
    base = int(url.rsplit(":", 1)[1])
    roles = {base: "single", base + 1: "prefill", base + 2: "decode"}
    found: dict[str, psutil.Process] = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        port = argv[argv.index("--port") + 1] if "--port" in argv[:-1] else ""
        if port.isdigit() and int(port) in roles:  # the instance's API process (its workers carry no --port)
            found.setdefault(roles[int(port)], child)
    return found


def _wait(check: Any, timeout_s: float) -> float | None:
    """Seconds until ``check()`` is true, polled every 0.25 s; None past ``timeout_s``."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        with contextlib.suppress(httpx.HTTPError):
            if check():
                return round(time.perf_counter() - start, 2)
        time.sleep(0.25)
    return None


def restart(url: str, decode: psutil.Process, model: str, expected: str, args: argparse.Namespace) -> dict[str, Any]:
    """Kill the decode instance; how long until the proxy says so, until it serves again, and
    whether the first answer after it is the one before."""
    os.killpg(os.getpgid(decode.pid), 9)
    noticed = _wait(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 503, 60)
    down = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    back = _wait(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 1800)
    after = measure(url, model, argparse.Namespace(**{**vars(args), "streams": 1}))
    code = (down.json().get("error") or {}).get("code") if down.status_code != 200 else "answered"
    return {"noticed_s": noticed, "request_while_down": f"{down.status_code} {code}",
            "serving_again_s": round((noticed or 0) + back, 2) if back is not None else None,
            "answer_after_restart_identical": after["answers"][0] == expected,
            "ttft_after_restart_s": after["ttft_p50_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--quant", choices=("auto", "fp32", "bf16"), default="auto",
                        help="auto: bf16 where the CPU has bfloat16 dot products, else fp32")
    parser.add_argument("--no-restart", dest="restart", action="store_false",
                        help="skip killing the decode instance at the end")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quant == "auto":
        args.quant = "bf16" if cpu_has_bf16() else "fp32"
    report: dict[str, Any] = {"model": args.model, "quant": args.quant, "streams": args.streams,
                              "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
                              "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                              "cpu_cores": os.cpu_count()}
    with bench_lock(), tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        for name, extra in (("single", []), ("disaggregated", ["--disaggregate", "prefill=1,decode=1"])):
            proc, url = serve(extra, args.model, args.quant, Path(tmp) / f"{name}.log")
            watch = MemoryWatch(proc.pid)
            each = {role: MemoryWatch(p.pid) for role, p in instances(proc, url).items()}
            try:
                measure(url, args.model, argparse.Namespace(**{**vars(args), "streams": 1, "tokens": 4}))  # warm-up
                report[name] = measure(url, args.model, args)
                if name == "single":  # the same streams again: how far batching alone moves greedy answers
                    again = measure(url, args.model, args)["answers"]
                    report["single_repeat_identical"] = \
                        f"{sum(a == b for a, b in zip(report[name]['answers'], again))}/{args.streams}"
                report[name].update(watch.stop())
                report[name]["instances"] = {role: w.stop() for role, w in each.items()}
                if name == "disaggregated" and args.restart and "decode" in each:
                    report["restart"] = restart(url, instances(proc, url)["decode"], args.model,
                                                report[name]["answers"][0], args)
                    print("pd: restart: " + json.dumps(report["restart"]), file=sys.stderr, flush=True)
            finally:
                watch.stop()
                os.killpg(proc.pid, 15)
                proc.wait(timeout=180)
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
