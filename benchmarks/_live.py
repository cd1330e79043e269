"""What the live benchmarks share: a real ``edgecloud serve`` on its own core (its llama.cpp engine,
or vLLM launched by it), the server's own pass counter, and one streamed answer through the public
client with what it cost."""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["_answer", "_check_ms", "_fresh", "_interleave", "_median_ms", "_sample", "_serve", "_server_passes",
           "_start_server"]


#: vLLM's interpreter for ``engine="vllm"`` (what ``make test`` installs).
VLLM_PYTHON = ".venv-vllm/bin/python"


def _serve(model: str, port: int, threads: int, core: int | None, engine: str = "llamacpp") -> Any:
    """``edgecloud serve`` on ``core`` (None: every core). ``engine="vllm"``: vLLM launched by it
    (with its checks plugin; eager, no compile warm-up)."""
    import os
    import subprocess

    import httpx

    command = [sys.executable, "-m", "edgecloud", "serve", "--model", model, "--port", str(port), "--threads",
               str(threads), "--ctx", "2048" if engine == "llamacpp" else "4096", "--log-level", "warning",
               "--engine", engine]
    env = dict(os.environ)
    if engine == "vllm":
        command += ["--vllm-python", VLLM_PYTHON, "--vllm-arg=--enforce-eager"]
        if core is not None:  # vLLM binds its OpenMP threads itself: to the core it was given
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + (300 if engine == "llamacpp" else 1200)
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("edgecloud serve did not become healthy")


def _server_passes(port: int) -> float:
    """The server's own forward passes (read past the proxies, from its /metrics):
    ``edgecloud:forward_passes_total``, or vLLM's engine steps (``vllm:iteration_tokens_total``'s
    count: one pass per step when one request runs at a time)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("edgecloud:forward_passes_total", "vllm:iteration_tokens_total_count")))


def _median_ms(seconds: list[float]) -> float:
    """The median of ``seconds``, in milliseconds to 0.1."""
    import statistics

    return round(1000 * statistics.median(seconds), 1)


def _check_ms(cloud: Any, ks: Iterable[int], reps: int) -> dict[str, float]:
    """Median milliseconds of a check of ``k`` drafted tokens through ``cloud`` (a
    :class:`~edgecloud.remote.client.CloudBackend`), for each ``k``: a token session that holds a
    300-token context, then the last round's cloud token and ``k`` drafts, one pass."""
    from edgecloud.runtime.scoring import TokenSession

    session, context = TokenSession(), list(range(1000, 1300))
    cloud.score_in(session, context, start=len(context) - 1)
    out: dict[str, float] = {}
    for k in ks:
        times = []
        for rep in range(reps):
            tokens = context + [2000 + 20 * rep + j for j in range(k + 1)]
            session.keep(len(context))
            started = time.perf_counter()
            cloud.score_in(session, tokens, start=len(context) + 1)
            times.append(time.perf_counter() - started)
        out[str(k)] = _median_ms(times)
    return out


def _fresh(messages: list[dict[str, str]], tag: str) -> list[dict[str, str]]:
    """``messages`` with ``tag`` at the head of the first user message: no policy reads the KV that
    another policy's request of the same task left in a prefix cache (the server's or the edge's)."""
    out, tagged = [], False
    for m in messages:
        if m["role"] == "user" and not tagged:
            m, tagged = {**m, "content": f"[{tag}] {m['content']}"}, True
        out.append(m)
    return out


def _answer(client: Any, row: dict[str, Any], tag: str = "", **params: Any) -> dict[str, Any]:
    """One streamed answer (greedy unless ``params`` says ``temperature``) and what it cost."""
    started, first, text = time.perf_counter(), None, ""
    messages = _fresh(row["messages"], tag) if tag else row["messages"]
    params.setdefault("temperature", 0)
    try:
        chunks = client.chat.completions.create(messages=messages, max_tokens=row["max_tokens"], stream=True, **params)
        final = None
        for chunk in chunks:
            if chunk.text and first is None:
                first = time.perf_counter() - started
            text += chunk.text
            final = chunk
    except Exception as exc:  # noqa: BLE001 - counted: the bar is that nothing raises
        return {"raised": f"{type(exc).__name__}: {exc}"[:300]}
    cost = final.cost if final is not None else None
    return {"ttft": first, "seconds": time.perf_counter() - started, "text": text,
            "text_sha": hashlib.sha256(text.encode()).hexdigest()[:16],
            "collab": final.route.collab if final is not None else None,
            "billed": cost.vs_all_cloud if cost is not None else None,
            "cloud_out": cost.cloud_output_tokens if cost is not None else 0,
            "cloud_calls": final.route.cloud_calls if final is not None else 0,
            "client_passes": cost.cloud_passes if cost is not None else 0,
            "tokens": final.usage.completion_tokens if final is not None and final.usage else 0,
            "fallbacks": len(final.route.fallbacks) if final is not None else 0,
            "notes": [n.code for n in final.route.notes] if final is not None else []}



def _sample(outcomes: list[dict[str, Any]], per_family: int, skip: int = 0) -> list[dict[str, Any]]:
    """``per_family`` labelled tasks of each family (after the first ``skip``), families in order."""
    sample = []
    for family in sorted({r["suite"] for r in outcomes}):
        sample += [r for r in outcomes if r["suite"] == family][skip: skip + per_family]
    return sample


def _start_server(model: str, split: bool, engine: str = "llamacpp") -> tuple[Any, int]:
    """``edgecloud serve`` for ``model`` and its port: with ``split``, this process on core 0 and
    the server with one thread on core 1 (as on two machines), else both on every core."""
    import os

    if split:
        os.sched_setaffinity(0, {0})
    port = 18000 + os.getpid() % 1000
    return _serve(model, port, 1 if split else 2, 1 if split else None, engine), port


def _interleave(sample: list[dict[str, Any]], policies: tuple[str, ...], port: int,
                answer: Callable[[str, dict[str, Any], str], dict[str, Any]],
                grade: Callable[[dict[str, Any], str], bool]) -> dict[str, list[dict[str, Any]]]:
    """Each task answered by every policy (``answer(policy, row, tag)``), the policies in a rotating
    order (each first as often as the others), with the server's passes per answer and the grade."""
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for i, row in enumerate(sample):
        order = policies[i % len(policies):] + policies[:i % len(policies)]
        for name in order:
            before = _server_passes(port)
            out = answer(name, row, f"{i}-{name}")
            time.sleep(0.2)  # a closed stream's last step lands on the counter
            out["server_passes"] = _server_passes(port) - before
            out.update(id=row["id"], family=row["suite"])
            if "text" in out:
                out["pass"] = grade(row, out.pop("text"))
            results[name].append(out)
        print(f"{i + 1}/{len(sample)} {row['id']}", file=sys.stderr)
    return results
