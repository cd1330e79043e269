"""Agent sessions on the llama.cpp serving engine, with the slots' dropped prefixes spilled to the
RAM/disk KV tiers (``--kv-ram-mib/--kv-disk-mib``) and without.

The workload is what an agent framework sends: ``--sessions`` conversations (default 8) at once,
each ``--turns`` turns long (default 6), all sharing one system prompt of about ``--system``
tokens (default 2,000: instructions plus the tools' JSON schemas), each turn a new user message
appended to the session's own history (its earlier questions and the server's answers). The
server has fewer slots than sessions (``--slots``, default 4), so a session's next turn usually
finds its slot taken by another session: without the tiers the engine keeps only the shared
system prompt and prefills the session's history again; with them it loads the history's KV
back. Every turn is streamed, greedy, ``--tokens`` new tokens (default 48).

Both servers run one after the other on the same sessions (off first, then on, then again in the
reverse order with ``--rounds 2``, so drift weighs on both). Reported per run: TTFT p50/p99 of
every turn, of turns 2-6 alone (those a tier can serve), aggregate completion tokens/s, the
prompt tokens the server found cached, and its KV-tier counters from ``/metrics``; the ratios
on/off under ``ratios``. The answers of the two runs are compared turn by turn (greedy, same
history: restored KV gives the tokens that recomputing would, up to float-order near-ties).

    python benchmarks/kv_serving.py [--model NAME] [--sessions 8] [--turns 6] [--slots 4] [--rounds 1]

Prints one JSON object; writes benchmarks/results/kv_serving.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DEFAULT_EDGE_MODEL, bench_lock  # noqa: E402
from serving import Engine, Running, _edgecloud, _percentile, delta_text, free_port, settle, stream_chunks  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "kv_serving.json"
_TOOL_NAMES = ("read_file", "write_file", "run_tests", "search_code", "list_directory", "git_diff", "git_commit",
               "open_issue", "http_get", "run_shell", "ask_user", "python_eval")
_QUESTIONS = (
    "Look at src/{m}.py and tell me which function you would test first.",
    "Which tool would you call to check that the tests of {m} pass, and with which arguments?",
    "Summarise in two sentences what could go wrong when {m} reads a file that does not exist.",
    "Write the call to search_code that finds every use of {m}.load.",
    "Propose a commit message for a fix to {m}'s error handling.",
    "What would you ask the user before changing {m}'s public interface?",
)
_MODULES = ("parser", "scheduler", "cache", "router", "metrics", "config", "storage", "auth")


def system_prompt(target_tokens: int) -> str:
    """Agent instructions and tool schemas, about ``target_tokens`` tokens (4 characters per token)."""
    tools = []
    for i, name in enumerate(_TOOL_NAMES):
        tools.append({"type": "function", "function": {
            "name": name, "description": f"{name.replace('_', ' ').capitalize()} in the workspace; returns JSON.",
            "parameters": {"type": "object", "required": ["path"], "properties": {
                "path": {"type": "string", "description": "A path relative to the repository root."},
                "limit": {"type": "integer", "minimum": 1, "maximum": 1000 + i, "description": "Most results."},
                "pattern": {"type": "string", "description": "A regular expression, Python syntax."},
                "dry_run": {"type": "boolean", "description": "Say what would happen without doing it."}}}}})
    text = ("You are a coding agent working in a Python repository. Think before you act, call one tool at a "
            "time, read what it returns, and never invent file contents. Available tools:\n")
    rules = [f"Rule {i}: when a tool fails, report the error verbatim and propose the next step number {i}."
             for i in range(400)]
    body = text + "\n".join(json.dumps(t) for t in tools)
    for rule in rules:
        if len(body) >= 4 * target_tokens:
            break
        body += "\n" + rule
    return body


async def _turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]],
                tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async for chunk in stream_chunks(client, url, body):
        usage = chunk.get("usage") or usage
        piece = delta_text(chunk)
        if piece:
            first = first if first is not None else time.perf_counter()
            text.append(piece)
    ended = time.perf_counter()
    return {"ttft_s": (first or ended) - sent, "text": "".join(text), "completion_tokens": usage.get("completion_tokens", 0),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "ended": ended}


async def _session(client: httpx.AsyncClient, url: str, model: str, system: str, index: int, turns: int,
                   tokens: int) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": system}]
    module = _MODULES[index % len(_MODULES)]
    done = []
    for turn in range(turns):
        messages.append({"role": "user", "content": _QUESTIONS[(index + turn) % len(_QUESTIONS)].format(m=module)})
        result = await _turn(client, url, model, messages, tokens)
        messages.append({"role": "assistant", "content": result["text"]})
        done.append({**result, "session": index, "turn": turn})
    return done


def _kv_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("edgecloud:kv_cache_events_total{"):
            labels, value = line.rsplit(" ", 1)
            counters[labels.split("{", 1)[1].rstrip("}")] = float(value)
    return counters


def run(running: Running, model: str, system: str, args: argparse.Namespace) -> dict[str, Any]:
    """All sessions at once against ``running``; the run's figures and its answers."""
    async def everything() -> list[list[dict[str, Any]]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
            return await asyncio.gather(*[_session(client, running.url, model, system, i, args.turns, args.tokens)
                                          for i in range(args.sessions)])

    settle()
    started = time.perf_counter()
    sessions = asyncio.run(everything())
    turns = [t for s in sessions for t in s]
    wall = max(t["ended"] for t in turns) - started
    later = [t["ttft_s"] for t in turns if t["turn"] > 0]
    every = [t["ttft_s"] for t in turns]
    return {
        "seconds": round(wall, 2),
        "tokens_per_s": round(sum(t["completion_tokens"] for t in turns) / wall, 2),
        "ttft_p50_s": round(_percentile(every, 0.5), 3), "ttft_p99_s": round(_percentile(every, 0.99), 3),
        "later_turns_ttft_p50_s": round(_percentile(later, 0.5), 3),
        "later_turns_ttft_p99_s": round(_percentile(later, 0.99), 3),
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "cached_tokens": sum(t["cached_tokens"] for t in turns),
        "kv_events": _kv_counters(running.url),
        "answers": [[t["text"] for t in s] for s in sessions],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_EDGE_MODEL)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--system", type=int, default=2000, help="tokens of the shared system prompt")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--ctx", type=int, default=4096, help="context per slot")
    parser.add_argument("--ram-mib", type=int, default=1024)
    parser.add_argument("--disk-mib", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    system = system_prompt(args.system)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with bench_lock(), tempfile.TemporaryDirectory(prefix="kv-serving-") as tmp:
        order = ["off", "on"]
        for round_ in range(args.rounds):
            for mode in order if round_ % 2 == 0 else order[::-1]:
                extra = ([] if mode == "off" else
                         ["--kv-ram-mib", str(args.ram_mib), "--kv-disk-mib", str(args.disk_mib), "--kv-dir",
                          str(Path(tmp) / f"kv-{round_}")])
                engine = Engine(f"llamacpp-spill-{mode}",
                                _edgecloud("llamacpp", args.model, free_port(), args.ctx, args.slots, *extra),
                                dict(os.environ), args.model, 300)
                running = Running.start(engine, Path(tmp) / f"{mode}-{round_}.log")
                if running is None:
                    raise SystemExit(f"the {mode} server did not start; see its log")
                try:
                    result = run(running, args.model, system, args)
                finally:
                    memory = running.stop()
                result["peak_rss_gb"] = memory.get("peak_rss_gb")
                print(f"kv_serving: spill {mode}: TTFT p50 {result['ttft_p50_s']} s p99 {result['ttft_p99_s']} s, "
                      f"{result['tokens_per_s']} tok/s, cached {result['cached_tokens']}/{result['prompt_tokens']}",
                      file=sys.stderr, flush=True)
                runs[mode].append(result)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    answers_off, answers_on = runs["off"][0]["answers"], runs["on"][0]["answers"]
    same = sum(a == b for s_off, s_on in zip(answers_off, answers_on) for a, b in zip(s_off, s_on))
    report = {
        "model": args.model,
        "workload": {"sessions": args.sessions, "turns": args.turns, "slots": args.slots,
                     "system_prompt_chars": len(system), "tokens_per_turn": args.tokens, "rounds": args.rounds},
        "runs": {mode: [{k: v for k, v in r.items() if k != "answers"} for r in rs] for mode, rs in runs.items()},
        "ratios": {
            "ttft_p50_on_vs_off": round(med("on", "ttft_p50_s") / med("off", "ttft_p50_s"), 3),
            "ttft_p99_on_vs_off": round(med("on", "ttft_p99_s") / med("off", "ttft_p99_s"), 3),
            "later_turns_ttft_p50_on_vs_off": round(med("on", "later_turns_ttft_p50_s") / med("off", "later_turns_ttft_p50_s"), 3),
            "later_turns_ttft_p99_on_vs_off": round(med("on", "later_turns_ttft_p99_s") / med("off", "later_turns_ttft_p99_s"), 3),
            "tokens_per_s_on_vs_off": round(med("on", "tokens_per_s") / med("off", "tokens_per_s"), 3),
        },
        "answers_identical": f"{same}/{args.sessions * args.turns}",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
