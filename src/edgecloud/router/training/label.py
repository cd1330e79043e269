"""Measure where each side succeeds: run both models on the task suites and grade the answers.

``edgecloud route label`` calls :func:`label_side` once per side (the edge model, then the
cloud model, each greedy through llama.cpp on this machine), writing one JSON line per task
to ``<out>.<side>.jsonl`` as it goes, so an interrupted run resumes where it stopped; then
:func:`merge_outcomes` joins the two into the outcome file the router trains and is
evaluated on. An outcome line::

    {"id", "suite", "difficulty", "messages", "max_tokens", "prompt_tokens",
     "edge_pass", "cloud_pass", "edge_tokens", "cloud_tokens", "edge_finish", "cloud_finish",
     "edge_logprob": {"mean", "min", "p10", "tail_mean"}, "edge_answer", "cloud_answer",
     "edge_seconds", "cloud_seconds"}
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ...backend import Backend
from ...runtime.llamacpp_batch import BatchedGreedy, BatchJob, BatchResult
from ...types import ChatRequest, collect_chunks
from ..answers import logprob_summary
from .tasks import Task, grade

__all__ = ["logprob_summary", "label_side", "merge_outcomes", "side_path"]

Progress = Callable[[int, int, dict[str, Any]], None]


def side_path(out: Path, side: str) -> Path:
    """Where one side's raw results for outcome file ``out`` live."""
    return out.with_name(f"{out.stem}.{side}.jsonl")


def _read(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short when a run was killed: that task is answered again
            rows[row["id"]] = row
    return rows


def _answers(source: Backend | BatchedGreedy, todo: list[Task]) -> Iterator[tuple[Task, BatchResult]]:
    """Greedy answers to ``todo``: one request at a time on a Backend, or batched."""
    if isinstance(source, BatchedGreedy):
        by_id = {t.id: t for t in todo}
        for result in source.run(BatchJob(t.id, t.messages, t.max_tokens) for t in todo):
            yield by_id[result.key], result
        return
    for task in todo:
        request = ChatRequest(messages=task.messages, max_tokens=task.max_tokens, temperature=0.0, logprobs=True)
        started = time.perf_counter()
        answer = collect_chunks(source.stream(request))
        choice = answer.choices[0]
        yield task, BatchResult(
            key=task.id,
            text=choice.message.content or "",
            finish=choice.finish_reason or "stop",
            prompt_tokens=answer.usage.prompt_tokens if answer.usage else 0,
            tokens=answer.usage.completion_tokens if answer.usage else 0,
            logprobs=[e.logprob for e in choice.logprobs.content] if choice.logprobs else [],
            seconds=round(time.perf_counter() - started, 3),
        )


def label_side(
    source: Backend | BatchedGreedy,
    tasks: Iterable[Task],
    out: Path,
    side: str,
    *,
    progress: Progress | None = None,
) -> dict[str, dict[str, Any]]:
    """Answer every task greedily and grade it; resumes from ``<out>.<side>.jsonl``.

    ``source`` is a chat Backend (one request at a time, as a device serves them) or a
    :class:`BatchedGreedy` runner (several sequences per decode step: ~3x the throughput on
    CPU; greedy choices differ from the one-at-a-time run only at near-ties). Each row
    records ``parallel``, the number of sequences that could share a step.
    """
    path = side_path(out, side)
    done = _read(path)
    todo = [t for t in tasks if t.id not in done]
    parallel = source.parallel if isinstance(source, BatchedGreedy) else 1
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        for i, (task, answer) in enumerate(_answers(source, todo)):
            row = {
                "id": task.id,
                "pass": grade(task, answer.text),
                "answer": answer.text,
                "finish": answer.finish,
                "prompt_tokens": answer.prompt_tokens,
                "tokens": answer.tokens,
                "logprob": logprob_summary(answer.logprobs),
                "seconds": answer.seconds,
                "parallel": parallel,
            }
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            fh.flush()
            done[task.id] = row
            if progress is not None:
                progress(i + 1, len(todo), row)
    return done


def merge_outcomes(tasks: Iterable[Task], out: Path) -> int:
    """Join both sides' results into ``out`` (tasks both sides answered); returns the row count."""
    edge, cloud = _read(side_path(out, "edge")), _read(side_path(out, "cloud"))
    rows = []
    for task in tasks:
        e, c = edge.get(task.id), cloud.get(task.id)
        if e is None or c is None:
            continue
        rows.append({
            "id": task.id, "suite": task.suite, "difficulty": task.difficulty, "messages": task.messages,
            "max_tokens": task.max_tokens, "prompt_tokens": e["prompt_tokens"],
            "edge_pass": e["pass"], "cloud_pass": c["pass"], "edge_tokens": e["tokens"], "cloud_tokens": c["tokens"],
            "edge_finish": e["finish"], "cloud_finish": c["finish"], "edge_logprob": e["logprob"],
            "edge_answer": e["answer"], "cloud_answer": c["answer"],
            "edge_seconds": e["seconds"], "cloud_seconds": c["seconds"],
        })
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return len(rows)
