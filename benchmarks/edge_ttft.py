"""Time to first token of the llama.cpp edge backend: cold, warm, and across a 10-turn chat.

Measures, on the 0.5B default edge model:

- ``cold_ms``: a fresh process loads the backend (which warms the template's system prefix
  at load) and asks one one-line question; ``cold_no_reuse_ms`` is the same with prefix reuse
  off, ``bare_cold_ms`` the same with bare llama-cpp-python;
- ``warm_ms``: one-line questions, each a new conversation after a different one, so only the
  system-prompt prefix is shared (median);
- ``bare_ms``: bare llama-cpp-python (``Llama.create_chat_completion(stream=True)``, same
  n_ctx / threads / KV settings) for the same questions in the same run, its context reset
  before each (what a new conversation costs it); ``bare_prefix_ms`` without the reset (its
  own in-context prefix match);
- ``turn_ttft_ms``: per-turn TTFT of 10-turn chats (median over three chats on different
  topics, ``THINK_S`` seconds between an answer and the next question), and
  ``turn10_over_turn1``; ``no_reuse_turn1_ms`` / ``no_reuse_turn10_ms`` are the same turns with
  prefix reuse off (the whole conversation re-read), for scale.

Targets: warm_ms <= 200 and turn 10 no slower than turn 1 (ratio <= 1.10, the run-to-run
noise here). Timing runs hold an exclusive flock on /tmp/edgecloud-bench.lock. Prints one
JSON object on stdout and writes benchmarks/results/edge_ttft.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from _common import DEFAULT_EDGE_MODEL, bench_lock, model_path, run_child

RESULTS = Path(__file__).resolve().parent / "results" / "edge_ttft.json"
WARM_TARGET_MS = 200.0
TURN_RATIO_TARGET = 1.10

QUESTION = "What does Python's zip function do?"
WARM_QUESTIONS = [
    "What does Python's zip function do?",
    "How do I reverse a list in Python?",
    "What is a mutex?",
    "Explain what a closure is in one sentence.",
    "What is the difference between TCP and UDP?",
    "How do I read a file line by line in Python?",
]
CHATS = [
    [
        "I want to write a small CLI todo app in Python.",
        "How should I store the todos?",
        "Show me the function that adds a todo.",
        "Now the function that lists them.",
        "How do I mark one as done?",
        "How would I add due dates?",
        "How do I sort by due date?",
        "How can I test this?",
        "Write one pytest test for adding a todo.",
        "Summarise the design in two sentences.",
    ],
    [
        "Let's talk about sorting algorithms.",
        "How does quicksort choose a pivot?",
        "What is its worst case?",
        "How does mergesort compare?",
        "Which one is stable?",
        "What does Python's sorted use?",
        "Why is that a good choice?",
        "How do I sort by two keys?",
        "And in reverse order for one key?",
        "Give me a one-line summary.",
    ],
    [
        "I am learning about HTTP.",
        "What is a status code?",
        "What does 404 mean?",
        "And 503?",
        "What is a header?",
        "What does Content-Type do?",
        "What is keep-alive?",
        "How does HTTP/2 differ?",
        "What is TLS for?",
        "Summarise what I learned.",
    ],
]
CHAT_MAX_TOKENS = 48
#: Seconds between a chat answer and the next question (a user reading and typing; far less
#: than real). The backend uses idle time to evaluate the next turn's header.
THINK_S = 1.0




def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def ours_ttft(backend: Any, messages: list[dict[str, str]], max_tokens: int = 8) -> tuple[float, str, int]:
    """(ms to the first content chunk, full text, cached tokens) for one streamed request."""
    from edgecloud.types import ChatRequest

    request = ChatRequest(messages=messages, temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    first = None
    parts: list[str] = []
    cached = 0
    for chunk in backend.stream(request):
        if chunk.text and first is None:
            first = time.perf_counter()
        parts.append(chunk.text)
        if chunk.usage is not None:
            cached = chunk.usage.cached_tokens
    assert first is not None, "no text generated"
    return (first - t0) * 1000.0, "".join(parts), cached


def bare_ttft(llm: Any, messages: list[dict[str, str]], *, reset: bool, max_tokens: int = 8) -> float:
    if reset:
        llm.reset()
    t0 = time.perf_counter()
    first = None
    for chunk in llm.create_chat_completion(messages=messages, temperature=0.0, max_tokens=max_tokens, stream=True):
        if chunk["choices"][0]["delta"].get("content") and first is None:
            first = time.perf_counter()
    assert first is not None, "no text generated"
    return (first - t0) * 1000.0


def child(mode: str, model: Path) -> dict[str, float]:
    """Runs in a fresh process: load (untimed), then time the first question."""
    if mode == "bare":
        import llama_cpp

        from edgecloud.edge.llamacpp import LlamaCppBackend

        settings = LlamaCppBackend(model, reuse_prefix=False)
        settings.load()  # only to learn the exact llama kwargs the backend uses
        kwargs = settings.llama_kwargs
        settings.close()
        llm = llama_cpp.Llama(model_path=str(model), verbose=False, **kwargs)
        return {"ttft_ms": bare_ttft(llm, user(QUESTION), reset=True)}
    from edgecloud.edge.llamacpp import LlamaCppBackend

    backend = LlamaCppBackend(model, reuse_prefix=(mode == "ours"))
    backend.load()
    ms, _, cached = ours_ttft(backend, user(QUESTION))
    return {"ttft_ms": ms, "cached_tokens": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_EDGE_MODEL, help="catalogue name or .gguf path")
    parser.add_argument("--child", choices=["ours", "ours-no-reuse", "bare"])
    parser.add_argument("--cold-runs", type=int, default=3)
    parser.add_argument(
        "--flash-attn", choices=["plan", "on", "off"], default="plan", help="attention kernel (default: the memory plan's)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.model = model_path(args.model)
    if args.child:
        print(json.dumps(child(args.child, args.model)))
        return

    import llama_cpp

    from edgecloud.edge.llamacpp import LlamaCppBackend

    with bench_lock():
        cold: dict[str, list[float]] = {"ours": [], "ours-no-reuse": [], "bare": []}
        for _ in range(args.cold_runs):
            for mode in cold:
                cold[mode].append(run_child(__file__, mode, args.model)["ttft_ms"])

        flash_attn = {"plan": None, "on": True, "off": False}[args.flash_attn]
        backend = LlamaCppBackend(args.model, flash_attn=flash_attn)
        backend.load()
        bare = llama_cpp.Llama(model_path=str(args.model), verbose=False, **backend.llama_kwargs)
        # one untimed request each: first-call allocations are not what "warm" measures
        ours_ttft(backend, user("Hello!"))
        bare_ttft(bare, user("Hello!"), reset=True)

        warm, bare_reset, bare_prefix, warm_cached = [], [], [], []
        for question in WARM_QUESTIONS:
            ms, _, cached = ours_ttft(backend, user(question))
            warm.append(ms)
            warm_cached.append(cached)
            bare_reset.append(bare_ttft(bare, user(question), reset=True))
        for question in WARM_QUESTIONS:
            bare_prefix.append(bare_ttft(bare, user(question), reset=False))

        per_turn: list[list[float]] = [[] for _ in range(10)]
        turn_cached: list[list[int]] = [[] for _ in range(10)]
        histories: list[list[dict[str, str]]] = []
        for chat in CHATS:
            history: list[dict[str, str]] = []
            for i, text in enumerate(chat):
                history.append({"role": "user", "content": text})
                ms, answer, cached = ours_ttft(backend, history, max_tokens=CHAT_MAX_TOKENS)
                per_turn[i].append(ms)
                turn_cached[i].append(cached)
                history.append({"role": "assistant", "content": answer})
                time.sleep(THINK_S)
            histories.append(history)
        backend.close()
        bare.close()

        # The same turn 1 and turn 10 without any prefix reuse: what the history would cost
        # if every turn re-read the whole conversation.
        fresh = LlamaCppBackend(args.model, flash_attn=flash_attn, reuse_prefix=False)
        fresh.load()
        no_reuse_turn1 = [ours_ttft(fresh, h[:1], max_tokens=4)[0] for h in histories]
        no_reuse_turn10 = [ours_ttft(fresh, h[:19], max_tokens=4)[0] for h in histories]
        fresh.close()

    turn_ms = [round(statistics.median(t), 1) for t in per_turn]
    warm_ms = statistics.median(warm)
    ratio = turn_ms[-1] / turn_ms[0]
    result = {
        "model": args.model.name,
        "n_ctx": backend.n_ctx,
        "n_threads": backend.llama_kwargs.get("n_threads"),
        "flash_attn": backend.llama_kwargs.get("flash_attn"),
        "cold_ms": round(statistics.median(cold["ours"]), 1),
        "cold_no_reuse_ms": round(statistics.median(cold["ours-no-reuse"]), 1),
        "bare_cold_ms": round(statistics.median(cold["bare"]), 1),
        "warm_ms": round(warm_ms, 1),
        "warm_ms_all": [round(x, 1) for x in warm],
        "warm_cached_tokens": warm_cached,
        "bare_ms": round(statistics.median(bare_reset), 1),
        "bare_prefix_ms": round(statistics.median(bare_prefix), 1),
        "warm_speedup_vs_bare": round(statistics.median(bare_reset) / warm_ms, 2),
        "turn_ttft_ms": turn_ms,
        "turn_cached_tokens": [statistics.median(c) for c in turn_cached],
        "turn10_over_turn1": round(ratio, 3),
        "no_reuse_turn1_ms": round(statistics.median(no_reuse_turn1), 1),
        "no_reuse_turn10_ms": round(statistics.median(no_reuse_turn10), 1),
        "turn10_speedup_vs_no_reuse": round(statistics.median(no_reuse_turn10) / turn_ms[-1], 2),
        "think_time_s": THINK_S,
        "targets": {"warm_ms_max": WARM_TARGET_MS, "turn10_over_turn1_max": TURN_RATIO_TARGET},
        "meets_targets": warm_ms <= WARM_TARGET_MS and ratio <= TURN_RATIO_TARGET,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
