"""BatchedGreedy: many greedy chats per llama.cpp decode step, on a real GGUF model."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgecloud.edge.llamacpp import LlamaCppBackend
from edgecloud.runtime.llamacpp_batch import BatchedGreedy, BatchJob
from edgecloud.errors import ContextOverflowError, InvalidRequestError
from edgecloud.router.training.label import label_side
from edgecloud.router.training.tasks import Task
from edgecloud.types import ChatRequest, collect_chunks

pytest.importorskip("llama_cpp")

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Name three colours.",
    "Say hello.",
    "What is 2 + 2?",
]


def _jobs(max_tokens: int = 24) -> list[BatchJob]:
    return [BatchJob(f"q{i}", [{"role": "user", "content": q}], max_tokens) for i, q in enumerate(QUESTIONS)]


def test_one_sequence_matches_the_backend_token_for_token(smollm2_path: Path) -> None:
    with BatchedGreedy(smollm2_path, parallel=1, n_ctx=1024) as runner:
        results = {r.key: r for r in runner.run(_jobs())}
    with LlamaCppBackend(str(smollm2_path), n_ctx=1024, reuse_prefix=False) as backend:
        for job in _jobs():
            answer = collect_chunks(
                backend.stream(ChatRequest(messages=job.messages, max_tokens=24, temperature=0.0, logprobs=True))
            )
            got = results[job.key]
            assert got.text == answer.choices[0].message.content
            assert got.finish == answer.choices[0].finish_reason
            assert (got.prompt_tokens, got.tokens) == (answer.usage.prompt_tokens, answer.usage.completion_tokens)
            want = [e.logprob for e in answer.choices[0].logprobs.content]
            assert got.logprobs == pytest.approx(want, abs=0.2)


def test_more_jobs_than_slots_all_finish_and_slots_are_reused(smollm2_path: Path) -> None:
    jobs = _jobs(16) * 2  # ten jobs through three slots
    jobs = [BatchJob(f"{j.key}-{i}", j.messages, j.max_tokens) for i, j in enumerate(jobs)]
    with BatchedGreedy(smollm2_path, parallel=3, n_ctx=3 * 512) as runner:
        results = list(runner.run(jobs))
        again = {r.key: r for r in runner.run(jobs[:3])}  # a second run on the same runner
    assert sorted(r.key for r in results) == sorted(j.key for j in jobs)
    for r in results:
        assert 1 <= r.tokens <= 16 and r.finish in {"stop", "length"}
        assert (r.finish == "length") == (r.tokens == 16)
        assert len(r.logprobs) == r.tokens and all(lp <= 0.0 for lp in r.logprobs)
    first = {r.key: r.text for r in results}
    # the same prompt answered in the same batch shape gives the same greedy text
    assert [again[j.key].text for j in jobs[:3]] == [first[j.key] for j in jobs[:3]]


def test_bad_jobs_are_refused_with_typed_errors(smollm2_path: Path) -> None:
    with BatchedGreedy(smollm2_path, parallel=2, n_ctx=512) as runner:
        huge = BatchJob("big", [{"role": "user", "content": "word " * 400}], 32)
        with pytest.raises(ContextOverflowError, match="big"):
            list(runner.run([huge]))
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            list(runner.run([BatchJob("zero", [{"role": "user", "content": "hi"}], 0)]))
        # the runner still works after refusing
        assert [r.key for r in runner.run(_jobs(4)[:1])] == ["q0"]
    with pytest.raises(InvalidRequestError, match="parallel"):
        BatchedGreedy(smollm2_path, parallel=0)


def test_label_side_batched_writes_resumable_rows(smollm2_path: Path, tmp_path: Path) -> None:
    tasks = [
        Task(f"t{i}", "facts", [{"role": "user", "content": q}], "text", {"answers": ["paris"]}, max_tokens=12)
        for i, q in enumerate(QUESTIONS[:3])
    ]
    out = tmp_path / "outcomes.jsonl"
    with BatchedGreedy(smollm2_path, parallel=2, n_ctx=1024) as runner:
        rows = label_side(runner, tasks[:2], out, "edge")
        assert set(rows) == {"t0", "t1"} and all(r["parallel"] == 2 for r in rows.values())
        seen: list[str] = []
        rows = label_side(runner, tasks, out, "edge", progress=lambda i, n, row: seen.append(row["id"]))
    assert seen == ["t2"] and set(rows) == {"t0", "t1", "t2"}  # only the new task ran
    assert len((tmp_path / "outcomes.edge.jsonl").read_text().splitlines()) == 3
