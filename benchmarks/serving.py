"""Every serving engine on the same prompts in one run: tokens/s, TTFT, inter-token latency, memory.

Engines (each a real server process on 127.0.0.1):

- ``llamacpp``: ``edgecloud serve --engine llamacpp`` (the GGUF's own INT4 weights, continuous batching);
- ``torch-bf16`` / ``torch-fp32``: ``edgecloud serve --engine torch --quant bf16|fp32``;
- ``vllm-bf16`` / ``vllm-fp32``: vLLM's own OpenAI server started directly (its module, the
  checkpoint converted from the same GGUF, the CPU settings edgecloud's launcher uses);
- ``vllm-launcher``: ``edgecloud serve --engine vllm --quant bf16`` (the launcher's overhead is
  ``vllm-launcher`` against ``vllm-bf16``; the launcher is not in the data path).

The machine drifts by tens of per cent over the half hour a run takes (measured: the same vLLM
server at 91 tokens/s in one round and 69 in the next), so engines measured one after the
other carry that drift. ``--interleave`` (what the README's figures use) starts every listed
engine at once and has them take turns run by run, the order rotating each repeat: the drift
then weighs on all of them alike. They must fit in memory together (vLLM takes about 10 GB:
pair ``vllm-bf16`` with one other vLLM at most, or lower ``VLLM_CPU_KVCACHE_SPACE``). Without
it, ``--rounds 2`` runs the list twice, the second time in reverse.

For each engine and each concurrency level (``--concurrency``, default 1, 8 and 16): that many
streamed chat requests at once, greedy, ``--tokens`` new tokens each (``ignore_eos``), every
request with a prompt of its own (no exact prompt repeats in a run: prefix caches see the
shared chat template only). Levels run ``--repeats`` times (the JSON has every run, their
median and the best). Reported per level: aggregate tokens/s (all completion tokens over the
wall time from the first request to the last token), tokens/s of one stream (median), TTFT
p50/p99, inter-token latency p50/p99 (of the best run); per engine: start-up seconds and the
peak memory of the server's process tree over its whole life (RSS every 0.25 s; PSS, which
counts shared pages once, every 10 s: reading it costs a core's worth at vLLM's size). Every
run starts once the machine is quiet (:func:`settle`): vLLM keeps a core busy for about a second
after its last request, which cost the engine measured after it up to 1 s of TTFT.

Ratios against ``vllm-bf16`` (when it ran; medians of runs) are under ``ratios``, with the
issue's targets under ``targets``. Prints a table and the JSON; writes ``benchmarks/results/serving.json`` and
``serving.png`` (aggregate tokens/s against concurrency).

    python benchmarks/serving.py [--model NAME] [--engines llamacpp,torch-bf16,vllm-bf16,vllm-launcher]
                                 [--concurrency 1,8,16] [--tokens 64] [--repeats 2] [--vllm-python PATH]
                                 [--interleave] [--rounds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from _common import bench_lock, model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from faults import free_port  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "serving.json"
PLOT = RESULTS.with_suffix(".png")
DEFAULT_ENGINES = "llamacpp,torch-bf16,torch-fp32,vllm-bf16,vllm-fp32,vllm-launcher"
TARGETS = {
    "best_8_streams_vs_vllm_bf16": 1.0,
    "best_peak_memory_vs_vllm_bf16": 0.25,
    "best_1_stream_vs_vllm_bf16": 1.5,
    "torch_bf16_8_streams_vs_vllm_bf16": 0.8,
    "launcher_overhead_pct": 2.0,
}
_TASKS = [
    "Write a Python function that {}.", "Explain in two sentences how to {}.", "Write a shell one-liner that {}.",
    "List three pitfalls when you {}.", "Write a JavaScript function that {}.", "Describe a unit test that checks code which {}.",
]
_SUBJECTS = [
    "checks whether a number is prime", "reverses the words of a sentence", "counts the lines of every .py file",
    "merges two sorted lists", "parses an ISO date", "removes duplicates from a list while keeping order",
    "computes a running median", "validates an email address", "flattens a nested list",
    "converts Celsius to Fahrenheit",
]
#: One distinct prompt per request of a run (60).
PROMPTS = [task.format(subject) for subject in _SUBJECTS for task in _TASKS]


@dataclass
class Engine:
    """How to start one server and what it answers to."""

    name: str
    argv: list[str]
    env: dict[str, str]
    model: str
    startup_timeout: float


def _edgecloud(engine: str, model: str, port: int, ctx: int, max_batch: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "edgecloud", "serve", "--engine", engine, "--model", model, "--port", str(port),
            "--ctx", str(ctx), "--max-batch", str(max_batch), "--log-level", "warning", *extra]


def build_engines(names: list[str], model: str, *, ctx: int, max_batch: int, vllm_python: str | None) -> list[Engine]:
    """The servers to measure, in order (vLLM ones only when vLLM is found)."""
    from edgecloud.serving.vllm import VLLMSettings, vllm_command, vllm_environment
    from edgecloud.serving.vllm_launch import find_vllm, vllm_sources

    engines: list[Engine] = []
    install = find_vllm(vllm_python) if any(n.startswith("vllm") for n in names) else None
    for name in names:
        port = free_port()
        if name == "llamacpp":
            engines.append(Engine(name, _edgecloud("llamacpp", model, port, ctx, max_batch), dict(os.environ), model, 300))
        elif name.startswith("torch-"):
            quant = name.removeprefix("torch-")
            engines.append(Engine(name, _edgecloud("torch", model, port, ctx, max_batch, "--quant", quant),
                                  dict(os.environ), model, 600))
        elif name.startswith("vllm"):
            if install is None or install.problem:
                print(f"serving: skipping {name}: vLLM not usable ({install.problem if install else 'not installed'})",
                      file=sys.stderr)
                continue
            if name == "vllm-launcher":
                argv = _edgecloud("vllm", model, port, ctx, max_batch, "--quant", "bf16", "--vllm-python", install.python)
                engines.append(Engine(name, argv, dict(os.environ), model, 900))
                continue
            settings = VLLMSettings(model, port=port, quant=name.removeprefix("vllm-"), max_batch=max_batch,  # type: ignore[arg-type]
                                    ctx=ctx, tensor_parallel_size=1)
            source, _ = vllm_sources(settings)
            argv = vllm_command(settings, source, python=install.python, module=install.module)
            engines.append(Engine(name, argv, vllm_environment(settings, cpu=install.cpu), model, 900))
        else:
            raise SystemExit(f"unknown engine {name!r}; known: {DEFAULT_ENGINES}")
    return engines


class MemoryWatch:
    """Peak RSS and PSS of a process and all its descendants, sampled on a thread.

    RSS comes from ``/proc/PID/statm`` every ``every`` seconds (cheap); PSS needs the kernel to
    walk the page tables (``smaps_rollup``), which for vLLM's 10 GB took most of a core at four
    samples a second (perturbing the very servers being measured), so it is sampled every
    ``pss_every`` seconds only, and the process tree is listed again every 2 s.
    """

    def __init__(self, pid: int, every: float = 0.25, pss_every: float = 10.0) -> None:
        self.root = psutil.Process(pid)
        self.every, self.pss_every = every, pss_every
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[psutil.Process]:
        return [self.root, *self.root.children(recursive=True)]

    def _run(self) -> None:
        listed = pss_at = 0.0
        procs: list[psutil.Process] = []
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now - listed >= 2.0:
                    procs, listed = self._tree(), now
            except psutil.Error:
                return
            rss = pss = 0
            full = now - pss_at >= self.pss_every
            for proc in procs:
                try:
                    if full:
                        info = proc.memory_full_info()
                        pss += getattr(info, "pss", info.rss)
                    else:
                        info = proc.memory_info()
                    rss += info.rss
                except psutil.Error:
                    continue
            self.peak_rss = max(self.peak_rss, rss)
            if full:
                self.peak_pss, pss_at = max(self.peak_pss, pss), now
            self._stop.wait(self.every)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(timeout=5)
        return {"peak_rss_gb": round(self.peak_rss / 1e9, 3), "peak_pss_gb": round(self.peak_pss / 1e9, 3)}


async def stream_chunks(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed chat completion, parsed, as they arrive (an error status raises)."""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def delta_text(chunk: dict[str, Any]) -> str | None:
    """The text a chunk adds, if any."""
    choices = chunk.get("choices") or []
    return (choices[0].get("delta") or {}).get("content") if choices else None


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, Any] | None = None
    async for chunk in stream_chunks(client, url, body):
        usage = chunk.get("usage") or usage
        if delta_text(chunk):
            stamps.append(time.perf_counter())
    if usage is None or not stamps:
        raise RuntimeError("a stream ended without text or usage")
    return {"sent": sent, "stamps": stamps, "tokens": int(usage["completion_tokens"])}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def measure_level(url: str, model: str, prompts: list[str], tokens: int) -> dict[str, Any]:
    """All ``prompts`` at once; the level's figures."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*[_one(client, url, model, p, tokens) for p in prompts])
    ended = max(r["stamps"][-1] for r in results)
    total = sum(r["tokens"] for r in results)
    ttft = [r["stamps"][0] - r["sent"] for r in results]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    per_stream = [(r["tokens"] - 1) / (r["stamps"][-1] - r["stamps"][0]) for r in results if r["stamps"][-1] > r["stamps"][0]]
    return {
        "streams": len(prompts),
        "tokens": total,
        "seconds": round(ended - started, 3),
        "tokens_per_s": round(total / (ended - started), 2),
        "stream_tokens_per_s_p50": round(statistics.median(per_stream), 2) if per_stream else None,
        "ttft_p50_s": round(_percentile(ttft, 0.5), 3),
        "ttft_p99_s": round(_percentile(ttft, 0.99), 3),
        "itl_p50_s": round(_percentile(itl, 0.5), 4) if itl else None,
        "itl_p99_s": round(_percentile(itl, 0.99), 4) if itl else None,
    }


def settle(quiet: float = 15.0, window: float = 0.25, limit: float = 10.0) -> float:
    """Wait until the machine is quiet (under ``quiet`` per cent of its CPU busy over ``window``
    s, at most ``limit`` s); the seconds waited. vLLM keeps a core busy for about a second after its
    last request (measured: 50 % of 2 cores for 1.0 s), which took a core from whichever engine
    ran next: the llama.cpp engine's prefill, whose threads wait on each other, then took 1.1 s
    instead of 0.15 s."""
    started = time.monotonic()
    while time.monotonic() - started < limit and psutil.cpu_percent(interval=window) >= quiet:
        pass
    return time.monotonic() - started


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} while starting")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not become healthy within {timeout:.0f} s")


class Running:
    """A started, warmed-up server: its process, memory watch and URL (:meth:`start`, :meth:`stop`)."""

    def __init__(self, engine: Engine, log: Path) -> None:
        self.engine = engine
        self.log = log
        port = next(engine.argv[i + 1] for i, a in enumerate(engine.argv) if a == "--port")
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(engine.argv, env=engine.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.watch = MemoryWatch(self.proc.pid)
        self.report: dict[str, Any] = {"command": " ".join(engine.argv[1:8]) + " ..."}
        #: Prompts handed out so far (every request of a run gets one of its own).
        self.cursor = 0

    @classmethod
    def start(cls, engine: Engine, log: Path) -> Running | None:
        """Start ``engine`` and warm it up; None (with the error in its report, printed) if it fails."""
        running = cls(engine, log)
        try:
            running.report["startup_s"] = round(_wait_healthy(running.proc, running.url, engine.startup_timeout), 1)
            asyncio.run(measure_level(running.url, engine.model, ["Say hello.", "Name a colour."], 8))  # compiles, caches
        except Exception as exc:  # noqa: BLE001 - one engine failing must not lose the others' figures
            running.fail(exc)
            return None
        return running

    def measure(self, level: int, tokens: int) -> bool:
        """One run of ``level`` concurrent streams, added to the report; False if the engine failed."""
        prompts = [PROMPTS[(self.cursor + i) % len(PROMPTS)] for i in range(level)]
        self.cursor += level
        settle()  # the previous run's servers quiet first (vLLM polls for a second after a request)
        try:
            run = asyncio.run(measure_level(self.url, self.engine.model, prompts, tokens))
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
            return False
        self.report.setdefault("runs", {}).setdefault(str(level), []).append(run)
        print(f"serving: {self.engine.name} c={level}: {run['tokens_per_s']} tok/s, TTFT p50 {run['ttft_p50_s']} s",
              file=sys.stderr, flush=True)
        return True

    def fail(self, exc: Exception) -> None:
        self.report["error"] = f"{type(exc).__name__}: {exc} (log: {self.log})"
        print(f"serving: {self.engine.name} failed: {self.report['error']}", file=sys.stderr, flush=True)

    def stop(self) -> dict[str, Any]:
        """Stop the server; its report: per level the best run, every run's tokens/s and their median."""
        self.report.update(self.watch.stop())
        try:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, 9)
        return summarise(self.report)


def level_entry(best: dict[str, Any], speeds: list[float]) -> dict[str, Any]:
    """One level's entry: the best run's figures, every run's tokens/s and their median."""
    return {**best, "runs_tokens_per_s": speeds, "median_tokens_per_s": round(statistics.median(speeds), 2)}


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with its ``runs`` folded into one entry per level (see :meth:`Running.stop`)."""
    out = {k: v for k, v in report.items() if k != "runs"}
    for level, runs in report.get("runs", {}).items():
        out[level] = level_entry(max(runs, key=lambda r: r["tokens_per_s"]), [r["tokens_per_s"] for r in runs])
    return out


def run_engine(engine: Engine, levels: list[int], tokens: int, repeats: int, log: Path) -> dict[str, Any]:
    """Start ``engine``, measure every level ``repeats`` times, stop it."""
    running = Running.start(engine, log)
    if running is None:
        return {}
    for level in levels:
        for _ in range(repeats):
            if not running.measure(level, tokens):
                return running.stop()
    return running.stop()


def run_interleaved(engines: list[Engine], levels: list[int], tokens: int, repeats: int, logs: Path) -> dict[str, Any]:
    """Every engine started at once, then each run of each level taken in turn by every engine,
    the order rotating: a machine that drifts weighs on all of them alike (they must fit in
    memory together)."""
    started = [r for r in (Running.start(e, logs / f"{e.name}.log") for e in engines) if r is not None]
    try:
        for repeat in range(repeats):
            for level in levels:
                order = started[repeat % len(started):] + started[: repeat % len(started)] if started else []
                for running in order:
                    if "error" not in running.report:
                        running.measure(level, tokens)
    finally:
        reports = {r.engine.name: r.stop() for r in started}
    return reports


def speed(engine: dict[str, Any], level: int) -> float:
    """An engine's tokens/s at ``level`` for the ratios: the median of its runs (the best run
    where an older result lists no runs)."""
    entry = engine[str(level)]
    runs = entry.get("runs_tokens_per_s")
    return float(statistics.median(runs)) if runs else float(entry["tokens_per_s"])


def ratios(engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's figures as ratios against vLLM CPU bf16 measured in this run (medians of runs)."""
    vllm = engines.get("vllm-bf16")
    if not vllm or "8" not in vllm:
        return {}
    ours = {n: e for n, e in engines.items() if not n.startswith("vllm") and "8" in e}
    if not ours:
        return launcher_overhead(engines)
    best = max(ours, key=lambda n: speed(ours[n], 8))
    out: dict[str, Any] = {
        "best_engine_at_8": best,
        "best_8_streams_vs_vllm_bf16": round(speed(ours[best], 8) / speed(vllm, 8), 3),
        "best_peak_memory_vs_vllm_bf16": round(ours[best]["peak_rss_gb"] / vllm["peak_rss_gb"], 3),
        "best_1_stream_vs_vllm_bf16": round(speed(ours[best], 1) / speed(vllm, 1), 3)
        if "1" in ours[best] and "1" in vllm else None,
    }
    for name, engine in ours.items():
        out[f"{name}_8_streams_vs_vllm_bf16"] = round(speed(engine, 8) / speed(vllm, 8), 3)
        out[f"{name}_1_stream_vs_vllm_bf16"] = round(speed(engine, 1) / speed(vllm, 1), 3) \
            if "1" in engine and "1" in vllm else None
        out[f"{name}_16_streams_vs_vllm_bf16"] = round(speed(engine, 16) / speed(vllm, 16), 3) \
            if "16" in engine and "16" in vllm else None
        out[f"{name}_peak_memory_vs_vllm_bf16"] = round(engine["peak_rss_gb"] / vllm["peak_rss_gb"], 3)
    out.update(launcher_overhead(engines))
    return out


def launcher_overhead(engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the launcher costs at 8 streams, against vLLM started directly: from the median of
    every run (the best run of a noisy pair differs by more than the 2 % the target allows;
    the median of four runs each does not), and from the best run as the other ratios are."""
    vllm, launcher = engines.get("vllm-bf16"), engines.get("vllm-launcher")
    if not vllm or not launcher or "8" not in vllm or "8" not in launcher:
        return {}
    return {
        "launcher_overhead_pct": round((1 - speed(launcher, 8) / speed(vllm, 8)) * 100, 2),
        "launcher_overhead_pct_best_run": round((1 - launcher["8"]["tokens_per_s"] / vllm["8"]["tokens_per_s"]) * 100, 2),
    }


def merge(old: dict[str, Any] | None, new: dict[str, Any], levels: list[int]) -> dict[str, Any]:
    """One engine over several rounds: the best run per level, every run's tokens/s, the highest peak memory."""
    if old is None:
        return new
    out = {**old}
    for level in map(str, levels):
        if level in new:
            runs = old.get(level, {}).get("runs_tokens_per_s", []) + new[level]["runs_tokens_per_s"]
            best = new[level] if new[level]["tokens_per_s"] > old.get(level, {}).get("tokens_per_s", -1) else old[level]
            out[level] = level_entry(best, runs)
    for key in ("peak_rss_gb", "peak_pss_gb"):
        out[key] = max(old.get(key, 0), new.get(key, 0))
    if "error" in new:
        out["error"] = new["error"]
    return out


def plot(report: dict[str, Any], levels: list[int], path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, engine in report["engines"].items():
        xs = [c for c in levels if str(c) in engine]
        if xs:
            ax.plot(xs, [engine[str(c)]["tokens_per_s"] for c in xs], marker="o", label=name)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_xticks(levels)
    ax.set_title(f"{report['model']} on {report['machine']['cores']} cores, greedy, {report['tokens']} tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4")
    parser.add_argument("--engines", default=DEFAULT_ENGINES)
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=2048, help="context per request, every engine")
    parser.add_argument("--vllm-python", default=None, help="the Python that has vLLM (default: $EDGECLOUD_VLLM_PYTHON or this one)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the engine list this many times, every other round reversed (A B B A), best run per level kept")
    parser.add_argument("--interleave", action="store_true",
                        help="start every engine at once and take turns run by run (they must fit in memory together)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON to write (the PNG goes beside it)")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    model = args.model
    model_path(model)  # pulled and verified before anything is timed
    engines = build_engines(args.engines.split(","), model, ctx=args.ctx, max_batch=max(levels),
                            vllm_python=args.vllm_python)
    report: dict[str, Any] = {
        "benchmark": "serving",
        "model": model,
        "tokens": args.tokens,
        "concurrency": levels,
        "repeats": args.repeats,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "memory_gb": round(psutil.virtual_memory().total / 1e9, 1)},
        "targets": TARGETS,
        "engines": {},
    }
    logs = RESULTS.parent / "serving-logs"
    logs.mkdir(parents=True, exist_ok=True)
    report["rounds"] = args.rounds
    report["interleaved"] = args.interleave
    with bench_lock():
        if args.interleave:
            report["engines"] = run_interleaved(engines, levels, args.tokens, args.repeats * args.rounds, logs)
        for round_ in range(0 if args.interleave else args.rounds):
            # every other round in reverse: this machine drifts by tens of per cent over half an
            # hour, and an engine measured always first (or last) would carry that drift
            for engine in engines if round_ % 2 == 0 else engines[::-1]:
                measured = run_engine(engine, levels, args.tokens, args.repeats, logs / f"{engine.name}.log")
                report["engines"][engine.name] = merge(report["engines"].get(engine.name), measured, levels)
    report["ratios"] = ratios(report["engines"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    plot(report, levels, args.out.with_suffix(".png"))
    header = f"{'engine':15s} {'1 stream':>9s} {'TTFT':>6s} " + " ".join(f"{f'{c} streams':>10s}" for c in levels[1:]) + \
             f" {'ITL p99@8':>9s} {'peak RSS':>9s} {'start':>6s}"
    print(header, file=sys.stderr)
    for name, e in report["engines"].items():
        cells = [f"{e.get(str(c), {}).get('tokens_per_s', '-'):>10}" for c in levels[1:]]
        print(f"{name:15s} {e.get('1', {}).get('tokens_per_s', '-'):>9} {e.get('1', {}).get('ttft_p50_s', '-'):>6} "
              + " ".join(cells) + f" {e.get('8', {}).get('itl_p99_s', '-'):>9} {e.get('peak_rss_gb', '-'):>8}G"
              f" {e.get('startup_s', '-'):>5}s", file=sys.stderr)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
