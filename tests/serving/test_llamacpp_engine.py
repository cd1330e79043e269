"""The llama.cpp serving engine on SmolLM2: concurrent requests share decode steps, slots reuse
their prefix, every request samples with its own settings, the queue answers 429 with
Retry-After, a disconnected client frees its slot, speculation keeps greedy output identical,
scoring matches the edge runtime, and a failed step fails only its own requests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from edgecloud.serving.llamacpp_engine import LlamaCppEngineBackend
from edgecloud.serving.server import create_app
from edgecloud.serving.speculative import SpecConfig
from edgecloud.edge.llamacpp import LlamaCppBackend
from edgecloud.errors import BackendError, ContextOverflowError, InvalidRequestError, RateLimitedError
from edgecloud.types import ChatRequest
from faults import running_app

QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello in Spanish."]


def ask(text: str, **options: object) -> ChatRequest:
    fields: dict[str, object] = {"messages": [{"role": "user", "content": text}], "max_tokens": 24, "temperature": 0}
    fields.update(options)
    return ChatRequest(**fields)


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Iterator[LlamaCppEngineBackend]:
    backend = LlamaCppEngineBackend(smollm2_path, n_ctx=512, max_batch=4)
    backend.load()
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def edge(smollm2_path: Path) -> Iterator[LlamaCppBackend]:
    backend = LlamaCppBackend(smollm2_path, n_ctx=512)
    yield backend
    backend.close()


def run_concurrently(engine: LlamaCppEngineBackend, requests: list[ChatRequest]) -> list[object]:
    out: list[object] = [None] * len(requests)

    def one(i: int) -> None:
        out[i] = engine.complete(requests[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_concurrent_requests_share_decode_steps(engine: LlamaCppEngineBackend) -> None:
    scheduler = engine.scheduler
    steps, rows = scheduler.steps, scheduler.rows
    answers = run_concurrently(engine, [ask(q, ignore_eos=True) for q in QUESTIONS])
    tokens = sum(a.usage.completion_tokens for a in answers)  # type: ignore[attr-defined]
    assert tokens == 4 * 24
    # one decode per step for all running sequences: far fewer steps than tokens
    assert scheduler.steps - steps < tokens / 2
    assert (scheduler.rows - rows) / (scheduler.steps - steps) > 2


def test_greedy_answers_match_the_edge_runtime_alone(engine: LlamaCppEngineBackend, edge: LlamaCppBackend) -> None:
    answers = run_concurrently(engine, [ask(q) for q in QUESTIONS])
    alone = [edge.complete(ask(q)).text for q in QUESTIONS]
    same = sum(a.text == b for a, b in zip(answers, alone))  # type: ignore[attr-defined]
    # batched kernels may round a near-tie differently from single-token ones; most answers are identical
    assert same >= 3, (alone, [a.text for a in answers])  # type: ignore[attr-defined]


def test_a_conversations_next_turn_reuses_its_slot(engine: LlamaCppEngineBackend) -> None:
    first = engine.complete(ask("Tell me a fact about owls."))
    history = [{"role": "user", "content": "Tell me a fact about owls."}, {"role": "assistant", "content": first.text},
               {"role": "user", "content": "And one about cats?"}]
    second = engine.complete(ChatRequest(messages=history, max_tokens=8, temperature=0))
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.cached_tokens >= first.usage.prompt_tokens


def busy_slots(engine: LlamaCppEngineBackend) -> list[int]:
    return [slot.index for slot in engine.scheduler.slots if slot.busy]


def running(stream: Iterator[Any]) -> Iterator[Any]:
    """``stream`` once its first token has come (its sequence holds a slot then)."""
    while not next(stream).text:
        pass
    return stream


def test_requests_run_in_the_lowest_slots_unless_a_long_prefix_is_cached(engine: LlamaCppEngineBackend) -> None:
    run_concurrently(engine, [ask(q) for q in QUESTIONS])  # every slot now holds a short cached prompt
    long_turn = [{"role": "user", "content": "Summarise this list: " + ", ".join(f"item {i}" for i in range(60))}]
    holder = running(engine.stream(ask("Count from one to fifty.", ignore_eos=True, max_tokens=200)))
    # a running request holds the lowest slot...
    try:
        assert busy_slots(engine) == [0]
        first = engine.complete(ChatRequest(messages=long_turn, max_tokens=8, temperature=0))
        # ...so the long prompt ran next to it, in slot 1, not in a scattered or least recently used one
    finally:
        holder.close()
    deadline = time.monotonic() + 10
    while engine.scheduler.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    # a new short question takes the lowest slot again (it saves nothing elsewhere)...
    short = running(engine.stream(ask("Name a fruit.", ignore_eos=True, max_tokens=200)))
    try:
        assert busy_slots(engine) == [0]
    finally:
        short.close()
    while engine.scheduler.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    # ...while the next turn of the long conversation goes back to slot 1, whose cache it reuses
    history = [*long_turn, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Thanks."}]
    second = engine.complete(ChatRequest(messages=history, max_tokens=4, temperature=0))
    assert second.usage.cached_tokens >= first.usage.prompt_tokens


def test_each_request_samples_with_its_own_settings(engine: LlamaCppEngineBackend) -> None:
    seeded = ask("Write a short poem.", temperature=1.0, seed=11, max_tokens=16)
    greedy = ask("Write a short poem.", max_tokens=16)
    a, b, c = run_concurrently(engine, [seeded, greedy, seeded])
    assert a.text == c.text  # type: ignore[attr-defined]
    assert b.text == engine.complete(greedy).text  # type: ignore[attr-defined]


def test_logprobs_logit_bias_and_grammar(engine: LlamaCppEngineBackend) -> None:
    scored = engine.complete(ask("Say yes.", logprobs=True, top_logprobs=3, max_tokens=4))
    content = scored.choices[0].logprobs.content
    assert len(content) == scored.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
    token = engine.tokenize_text(" banana")[0]
    forced = engine.complete(ask("Say yes.", logit_bias={str(token): 100}, max_tokens=3))
    assert forced.text.startswith(" banana banana") or forced.text.count("banana") >= 2
    structured = engine.complete(ask("Give me a JSON object about a cat.", response_format={"type": "json_object"},
                                     max_tokens=48, temperature=0.7, seed=1))
    if structured.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(structured.text), dict)
    else:
        assert structured.text.lstrip().startswith("{")


def test_bad_input_is_refused_before_anything_runs(engine: LlamaCppEngineBackend) -> None:
    with pytest.raises(ContextOverflowError):
        engine.complete(ask("Hi", max_tokens=10_000))
    with pytest.raises(InvalidRequestError) as info:
        engine.complete(ask("Hi", logit_bias={"99999999": 5}))
    assert info.value.param == "logit_bias"


def test_scores_match_the_edge_runtime(engine: LlamaCppEngineBackend, edge: LlamaCppBackend) -> None:
    tokens = edge.tokenize_text("The quick brown fox jumps over the lazy dog.")
    ours, nxt = engine.score(tokens, start=2, top_n=2)
    theirs, their_next = edge.score(tokens, start=2, top_n=2)
    assert [s.token for s in ours] == tokens[2:]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(ours, theirs)) < 0.05
    assert nxt.token == their_next.token


def test_ngram_speculation_keeps_greedy_output_identical(smollm2_path: Path) -> None:
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    request = ask(f"Repeat this code exactly:\n{text}", max_tokens=40)
    plain = LlamaCppEngineBackend(smollm2_path, n_ctx=512, max_batch=2)
    spec = LlamaCppEngineBackend(smollm2_path, n_ctx=512, max_batch=2, speculative=SpecConfig(mode="ngram", adaptive=False, k_max=4))
    try:
        expected = plain.complete(request)
        got = spec.complete(request)
    finally:
        plain.close()
        spec.close()
    assert got.text == expected.text
    summary = got.usage.speculative
    assert summary is not None and summary["num_draft_tokens"] > 0
    assert summary["num_accepted_tokens"] > 0


@pytest.fixture()
def small(smollm2_path: Path) -> Iterator[LlamaCppEngineBackend]:
    backend = LlamaCppEngineBackend(smollm2_path, n_ctx=512, max_batch=1, max_queue=0)
    backend.load()
    yield backend
    backend.close()


def test_a_full_slot_table_is_a_429_with_retry_after(small: LlamaCppEngineBackend) -> None:
    with running_app(create_app(small, model_name="m")) as url:
        body = {"messages": [{"role": "user", "content": "Count to one hundred."}], "max_tokens": 200,
                "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/chat/completions", json=body) as busy:
            assert busy.status_code == 200
            next(busy.iter_lines())
            refused = client.post(f"{url}/v1/chat/completions", json={**body, "stream": False})
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["Retry-After"]) >= 1
    deadline = time.monotonic() + 30
    while small.scheduler.num_running and time.monotonic() < deadline:  # the closed stream's slot comes free
        time.sleep(0.05)
    params = small._params(ask("x"), [1, 2, 3])
    first = small.scheduler.submit([1, 2, 3], params)
    try:
        with pytest.raises(RateLimitedError) as info:
            small.scheduler.submit([1, 2, 3], params)
        assert info.value.retry_after is not None and info.value.retry_after >= 1
    finally:
        first.cancel()


def test_a_client_disconnect_frees_its_slot(small: LlamaCppEngineBackend) -> None:
    with running_app(create_app(small, model_name="m")) as url:
        body = {"messages": [{"role": "user", "content": "Count to one thousand."}], "max_tokens": 400,
                "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as first:
                lines = first.iter_lines()
                for _ in range(3):
                    next(lines)
            # the connection is closed: the slot must come free without the 400 tokens being made
            deadline = time.monotonic() + 30
            while small.scheduler.num_running and time.monotonic() < deadline:
                time.sleep(0.05)
            assert small.scheduler.num_running == 0
            answer = client.post(f"{url}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        metrics = httpx.get(f"{url}/metrics").text
        assert 'finished_reason="cancelled"' in metrics


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(small: LlamaCppEngineBackend,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    context = small._context
    real = context.decode
    calls = {"n": 0}

    def fail_once() -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected decode failure")
        real()

    monkeypatch.setattr(context, "decode", fail_once)
    with pytest.raises(BackendError) as info:
        small.complete(ask("Name a planet.", max_tokens=8))
    assert info.value.cause == "runtime_error"
    again = small.complete(ask("Name a planet.", max_tokens=8))
    assert again.usage.completion_tokens == 8 or again.choices[0].finish_reason == "stop"
    assert small.health() is None


def test_a_prompt_is_read_in_one_pass_alone_and_in_chunks_beside_a_decoding_answer(smollm2_path: Path) -> None:
    engine = LlamaCppEngineBackend(smollm2_path, n_ctx=512, max_batch=2, max_prefill_tokens=8)
    long_turn = [{"role": "user", "content": "Summarise this list: " + ", ".join(f"item {i}" for i in range(30))}]
    scheduler = engine.scheduler
    try:
        steps = scheduler.steps
        alone = engine.complete(ChatRequest(messages=long_turn, max_tokens=1, temperature=0))
        assert alone.usage.prompt_tokens > 8 * 8
        assert scheduler.steps - steps == 1  # nothing else decodes: the prompt and its first token in one pass
        holder = running(engine.stream(ask("Count from one to fifty.", ignore_eos=True, max_tokens=200)))
        try:
            steps = scheduler.steps
            other_turn = [{"role": "user", "content": "Now: " + long_turn[0]["content"]}]
            beside = engine.complete(ChatRequest(messages=other_turn, max_tokens=1, temperature=0))
            # a decoding answer waits at most one chunk of it per step
            read = beside.usage.prompt_tokens - (beside.usage.cached_tokens or 0)
            assert read > 8 * 4 and scheduler.steps - steps >= -(-read // 8)
        finally:
            holder.close()
    finally:
        engine.close()


def test_scoring_longer_than_a_batch_is_split(smollm2_path: Path, edge: LlamaCppBackend) -> None:
    tokens = edge.tokenize_text("A long sentence about caches, buffers and queues. " * 10)
    assert len(tokens) > 90
    engine = LlamaCppEngineBackend(smollm2_path, n_ctx=512, max_batch=2, n_batch=32)
    try:
        ours, nxt = engine.score(tokens, start=50, top_n=1)
        prompt, _ = engine.score(tokens[:40], start=39, top_n=1)  # a shorter context first: a slot to reuse
        again, _ = engine.score(tokens, start=50, top_n=1)
    finally:
        engine.close()
    theirs, their_next = edge.score(tokens, start=50, top_n=1)  # one batch: only the rounding differs
    assert len(ours) == len(again) == len(tokens) - 50 and len(prompt) == 1
    for run in (ours, again):
        diffs = [abs(a.logprob - b.logprob) for a, b in zip(run, theirs)]
        assert sum(diffs) / len(diffs) < 0.03 and max(diffs) < 0.3
        assert sum(a.argmax == b.argmax for a, b in zip(run, theirs)) >= 0.95 * len(run)
    assert nxt.token == their_next.token


AGENT_SYSTEM = "You are an agent with tools for a warehouse. " + " ".join(
    f"Tool {i}: moves pallet {i} from aisle {i % 9} to dock {i % 4}." for i in range(40))


def _session(name: str, turn: str, before: list[dict[str, str]] | None = None) -> ChatRequest:
    messages = before or [{"role": "system", "content": f"Session {name}. {AGENT_SYSTEM}"}]
    return ChatRequest(messages=[*messages, {"role": "user", "content": turn}], max_tokens=8, temperature=0)


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_session_whose_slot_was_taken_gets_its_prefix_back(smollm2_path: Path, tmp_path: Path, tier: str) -> None:
    # one slot, two agent sessions taking turns: each turn of one evicts the other's prefix
    ram = 64 * 2**20 if tier == "ram" else 12 * 2**20  # "disk": RAM holds one state, the other spills
    with LlamaCppEngineBackend(smollm2_path, n_ctx=1024, max_batch=1, kv_ram_bytes=ram, kv_disk_bytes=2**30,
                               kv_dir=tmp_path) as engine:
        a1 = engine.complete(_session("A", "Move pallet 3."))
        engine.complete(_session("B", "Move pallet 5."))
        engine.complete(_session("C", "Move pallet 7."))  # C evicts B, so RAM holds C and B (or B spilled)
        engine.flush_kv()
        history = [*_session("A", "Move pallet 3.").message_dicts(), {"role": "assistant", "content": a1.text}]
        a2 = engine.complete(_session("A", "Now pallet 4.", history))
        assert a2.usage is not None and a1.usage is not None
        assert a2.usage.cached_tokens >= a1.usage.prompt_tokens - 1  # A's prefix came back, not recomputed
        metrics = engine.metrics.render().decode()
        if tier == "disk":
            assert list(tmp_path.glob("*/*.kv"))
            assert 'tier="disk"' in metrics and 'event="hit"' in metrics
    with LlamaCppEngineBackend(smollm2_path, n_ctx=1024, max_batch=1) as plain:  # the same without a KV store
        plain.complete(_session("A", "Move pallet 3."))
        plain.complete(_session("B", "Move pallet 5."))
        again = plain.complete(_session("A", "Now pallet 4.", history))
        assert again.usage is not None and again.usage.cached_tokens < a1.usage.prompt_tokens // 2
