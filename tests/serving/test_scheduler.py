"""The continuous-batching scheduler on a real model (SmolLM2, fp32, oneDNN-packed layers).

Batching must not change answers: every greedy sequence run alongside others, joining or
leaving mid-batch, prefilled in chunks or from the prefix cache, gives exactly the tokens
it gives alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

from edgecloud.engine import Tokenizer, Transformer, generate, packing_supported
from edgecloud.serving.scheduler import SamplingParams, Scheduler
from edgecloud.errors import ContextOverflowError, RateLimitedError
from edgecloud.observability import ServerMetrics

QUESTIONS = [
    "Write a haiku about rust.",
    "What is 2+2?",
    "Name three colours.",
    "Explain TCP in one sentence.",
    "Say hi.",
    "List two prime numbers.",
]


@pytest.fixture(scope="module")
def prompts(engine: tuple[Transformer, Tokenizer]) -> list[list[int]]:
    _, tokenizer = engine
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def alone(engine: tuple[Transformer, Tokenizer], prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy answer (24 tokens at most) without the scheduler."""
    model, tokenizer = engine
    return [list(generate(model, tokenizer, p, 24, temperature=0)) for p in prompts]


def _scheduler(engine: tuple[Transformer, Tokenizer], **kwargs: object) -> Scheduler:
    model, tokenizer = engine
    return Scheduler(model, eog_ids=tokenizer.eog_ids, **kwargs)  # type: ignore[arg-type]


def test_packed_layers_keep_greedy_answers(smollm2_path: Path, engine: tuple[Transformer, Tokenizer],
                                           prompts: list[list[int]], alone: list[list[int]]) -> None:
    if not packing_supported():
        pytest.skip("this torch build has no oneDNN weight packing")
    plain = Transformer.from_gguf(smollm2_path)
    _, tokenizer = engine
    assert [list(generate(plain, tokenizer, p, 24, temperature=0)) for p in prompts[:3]] == alone[:3]


def test_batched_answers_equal_answers_alone(engine: tuple[Transformer, Tokenizer], prompts: list[list[int]],
                                             alone: list[list[int]]) -> None:
    scheduler = _scheduler(engine, max_batch=4)
    try:
        seqs = [scheduler.submit(p, SamplingParams(24)) for p in prompts]  # 6 sequences, 4 slots: 2 wait
        outputs = [list(s) for s in seqs]
    finally:
        scheduler.close()
    assert outputs == alone
    assert all(s.finish_reason in ("stop", "length") for s in seqs)
    # Sequences shared steps: fewer steps than tokens scored one sequence at a time.
    assert scheduler.steps < sum(len(a) + 1 for a in alone)


def test_sequences_join_and_leave_at_token_granularity(engine: tuple[Transformer, Tokenizer],
                                                       prompts: list[list[int]], alone: list[list[int]]) -> None:
    scheduler = _scheduler(engine, max_batch=8)
    try:
        short = scheduler.submit(prompts[0], SamplingParams(3))
        long = scheduler.submit(prompts[1], SamplingParams(24))
        assert list(short) == alone[0][:3] and short.finish_reason == "length"
        # Joins while `long` is mid-answer; a small prefill budget splits its prompt over steps.
        late = scheduler.submit(prompts[2], SamplingParams(24))
        assert list(long) == alone[1]
        assert list(late) == alone[2]
    finally:
        scheduler.close()


def test_chunked_prefill_gives_the_same_answer(engine: tuple[Transformer, Tokenizer], prompts: list[list[int]],
                                               alone: list[list[int]]) -> None:
    scheduler = _scheduler(engine, max_prefill_tokens=7)
    try:
        assert [list(scheduler.submit(p, SamplingParams(24))) for p in prompts[:2]] == alone[:2]
    finally:
        scheduler.close()


def test_prefix_cache_reuses_a_shared_prefix(engine: tuple[Transformer, Tokenizer], prompts: list[list[int]],
                                             alone: list[list[int]]) -> None:
    metrics = ServerMetrics("smollm2")
    scheduler = _scheduler(engine, metrics=metrics)
    try:
        first = scheduler.submit(prompts[0], SamplingParams(24))
        assert list(first) == alone[0] and first.cached_tokens == 0
        again = scheduler.submit(prompts[0], SamplingParams(24))
        assert list(again) == alone[0]
        assert again.cached_tokens == len(prompts[0]) - 1  # the last prompt token is re-scored for its logits
        # A follow-up turn shares the conversation so far, answer included.
        _, tokenizer = engine
        convo = [{"role": "user", "content": QUESTIONS[0]},
                 {"role": "assistant", "content": tokenizer.decode(alone[0]).decode()},
                 {"role": "user", "content": "Another one."}]
        follow = scheduler.submit(tokenizer.encode_chat(convo), SamplingParams(4))
        list(follow)
        assert follow.cached_tokens >= len(prompts[0])
    finally:
        scheduler.close()
    text = metrics.render().decode()
    assert "edgecloud:prefix_cache_hits_total" in text
    hits = metrics.prefix_hits.labels("smollm2")._value.get()
    assert hits == again.cached_tokens + follow.cached_tokens


def test_cancel_frees_the_slot(engine: tuple[Transformer, Tokenizer], prompts: list[list[int]],
                               alone: list[list[int]]) -> None:
    metrics = ServerMetrics("smollm2")
    scheduler = _scheduler(engine, max_batch=1, metrics=metrics)
    try:
        hog = scheduler.submit(prompts[0], SamplingParams(2000, stop_at_eog=False))
        tokens = iter(hog)
        next(tokens)
        waiting = scheduler.submit(prompts[1], SamplingParams(24))
        hog.cancel()
        assert list(waiting) == alone[1]  # it only ran because the cancelled one left
        assert len(list(tokens)) < 2000 and hog.finish_reason == "cancelled"
    finally:
        scheduler.close()
    assert scheduler.num_running == 0
    assert metrics.running.labels("smollm2")._value.get() == 0


def test_full_queue_is_rate_limited(engine: tuple[Transformer, Tokenizer], prompts: list[list[int]]) -> None:
    scheduler = _scheduler(engine, max_batch=1, max_queue=1)
    try:
        running = scheduler.submit(prompts[0], SamplingParams(2000, stop_at_eog=False))
        next(iter(running))  # admitted
        queued = scheduler.submit(prompts[1], SamplingParams(4))
        with pytest.raises(RateLimitedError) as info:
            scheduler.submit(prompts[2], SamplingParams(4))
        assert info.value.status_code == 429 and info.value.retry_after and info.value.retry_after >= 1
        running.cancel()
        assert len(list(queued)) > 0
    finally:
        scheduler.close()


def test_seeded_sampling_is_reproducible_inside_a_batch(engine: tuple[Transformer, Tokenizer],
                                                       prompts: list[list[int]]) -> None:
    scheduler = _scheduler(engine)
    try:
        solo = list(scheduler.submit(prompts[3], SamplingParams(16, temperature=0.9, seed=7)))
        together = [scheduler.submit(prompts[3], SamplingParams(16, temperature=0.9, seed=7)),
                    scheduler.submit(prompts[4], SamplingParams(16, temperature=0.9, seed=8))]
        assert list(together[0]) == solo
        list(together[1])
    finally:
        scheduler.close()


def test_context_overflow_is_refused_before_queueing(engine: tuple[Transformer, Tokenizer],
                                                     prompts: list[list[int]]) -> None:
    scheduler = _scheduler(engine, max_context=64)
    try:
        with pytest.raises(ContextOverflowError) as info:
            scheduler.submit(prompts[0], SamplingParams(60))
        assert info.value.context_tokens == 64
    finally:
        scheduler.close()


def test_async_consumers(engine: tuple[Transformer, Tokenizer], prompts: list[list[int]],
                         alone: list[list[int]]) -> None:
    scheduler = _scheduler(engine)

    async def run() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        seqs = [scheduler.submit(p, SamplingParams(24), loop=loop) for p in prompts[:3]]

        async def collect(seq: object) -> list[int]:
            return [t async for t in seq]  # type: ignore[attr-defined]

        return list(await asyncio.gather(*(collect(s) for s in seqs)))

    try:
        assert asyncio.run(run()) == alone[:3]
    finally:
        scheduler.close()


def test_closing_fails_open_sequences(engine: tuple[Transformer, Tokenizer], prompts: list[list[int]]) -> None:
    from edgecloud.errors import BackendUnavailableError

    scheduler = _scheduler(engine, max_batch=1)
    seq = scheduler.submit(prompts[0], SamplingParams(2000, stop_at_eog=False))
    next(iter(seq))
    scheduler.close()
    with pytest.raises(BackendUnavailableError):
        for _ in seq:
            pass
    with pytest.raises(BackendUnavailableError):
        scheduler.submit(prompts[0], SamplingParams(4))
