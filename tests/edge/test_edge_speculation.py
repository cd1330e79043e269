"""Speculative decoding on the device, with real models: the text is the model's own (greedy:
token for token; sampled with a seed: the same draws), drafts are used where the answer copies
its prompt, and logprobs, grammars and settings keep working on top of it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from edgecloud import EdgeCloud
from edgecloud.edge.llamacpp import LlamaCppBackend
from edgecloud.edge.speculation import EdgeSpeculator
from edgecloud.errors import ConfigError, EdgeCloudError
from edgecloud.types import ChatRequest

CODE = """def read_scores(path):
    scores = {}
    with open(path) as fh:
        for row in fh:
            row = row.strip()
            if not row or row.startswith(";"):
                continue
            name, score = row.split(",", 1)
            scores[name.strip()] = int(score)
    return scores
"""
COPYING = [{"role": "user", "content": f"Add a docstring to this function and return the whole code.\n```python\n{CODE}```"}]
FREE = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]


def _answer(backend: LlamaCppBackend, messages: list[dict[str, str]], **fields: object) -> ChatRequest | object:
    backend.clear_prefix_cache()  # each answer from the same start: prefill shapes alike
    return backend.complete(ChatRequest(messages=messages, max_tokens=96, **fields))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pair(qwen05_path: Path) -> Iterator[tuple[LlamaCppBackend, LlamaCppBackend, LlamaCppBackend]]:
    """The default edge model plain, with prompt lookup, and with itself as the draft model; the
    speculating ones guess every step (a fixed k: whether guessing pays is the controller's call,
    and on a CPU where a pass of k rows costs k single passes it never does). A fixed k guesses
    even where a wider pass rounds differently from one row; these prompts stay short, where the
    rows that check a guess of 2 are computed exactly as one row is (checked here first)."""
    plain = LlamaCppBackend(qwen05_path, n_ctx=1024, speculate="off", prefix_cache_bytes=0)
    ngram = LlamaCppBackend(qwen05_path, n_ctx=1024, speculate="ngram", speculate_k=2, prefix_cache_bytes=0)
    draft = LlamaCppBackend(qwen05_path, n_ctx=1024, speculate=str(qwen05_path), speculate_k=2, prefix_cache_bytes=0)
    try:
        for backend in (plain, ngram, draft):
            backend.load()
        exact, _ = ngram._rows_exact_at(ngram._llm.n_tokens, 3)
        if exact < 3:
            pytest.skip("this CPU's kernels round a pass of 3 rows differently from one row: guesses change greedy text")
        yield plain, ngram, draft
    finally:
        for backend in (plain, ngram, draft):
            backend.close()


@pytest.mark.parametrize("messages", [COPYING, FREE], ids=["copying", "free"])
def test_greedy_text_is_identical_with_and_without_drafts(pair: tuple[LlamaCppBackend, ...],
                                                          messages: list[dict[str, str]]) -> None:
    plain, ngram, draft = pair
    expected = _answer(plain, messages, temperature=0)
    for speculating in (ngram, draft):
        answer = _answer(speculating, messages, temperature=0)
        assert answer.text == expected.text  # type: ignore[attr-defined]
        assert answer.usage.completion_tokens == expected.usage.completion_tokens  # type: ignore[attr-defined]
        assert expected.usage.speculative is None  # type: ignore[attr-defined]


def test_an_answer_that_copies_its_prompt_is_written_from_accepted_drafts(pair: tuple[LlamaCppBackend, ...]) -> None:
    _, ngram, draft = pair
    for speculating in (ngram, draft):
        usage = _answer(speculating, COPYING, temperature=0).usage  # type: ignore[attr-defined]
        spec = usage.speculative
        # what is guessed from the prompt is mostly what the model writes
        assert spec is not None and spec["num_accepted_tokens"] > usage.completion_tokens / 4, spec
        assert spec["acceptance_rate"] >= 0.5, spec
        assert sum(spec["k_trace"]) == spec["num_draft_tokens"]


def test_seeded_sampling_draws_the_same_tokens(pair: tuple[LlamaCppBackend, ...]) -> None:
    plain, ngram, _ = pair
    fields = {"temperature": 0.8, "top_p": 0.95, "seed": 7}
    assert _answer(ngram, COPYING, **fields).text == _answer(plain, COPYING, **fields).text  # type: ignore[attr-defined]


def test_logprobs_and_a_grammar_hold_under_speculation(pair: tuple[LlamaCppBackend, ...]) -> None:
    plain, ngram, _ = pair
    record = {"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "city": "London"}
    messages = [{"role": "user", "content": f"Return this record as JSON, unchanged: {json.dumps(record)}"}]
    schema = {"type": "object", "properties": {k: {"type": "string" if isinstance(v, str) else "integer"}
                                               for k, v in record.items()},
              "required": list(record), "additionalProperties": False}
    fields = {"temperature": 0, "logprobs": True, "top_logprobs": 2,
              "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    expected = _answer(plain, messages, **fields)
    answer = _answer(ngram, messages, **fields)
    assert answer.text == expected.text  # type: ignore[attr-defined]
    assert set(json.loads(answer.text)) == set(record)  # type: ignore[attr-defined]
    content = answer.choices[0].logprobs.content  # type: ignore[attr-defined]
    assert len(content) == answer.usage.completion_tokens  # type: ignore[attr-defined]
    assert [c.token for c in content] == [c.token for c in expected.choices[0].logprobs.content]  # type: ignore[attr-defined]


def test_a_draft_model_with_another_vocabulary_is_refused_at_load(qwen05_path: Path, smollm2_path: Path) -> None:
    backend = LlamaCppBackend(qwen05_path, n_ctx=512, speculate=str(smollm2_path))
    try:
        with pytest.raises(ConfigError, match="vocabulary"):
            backend.load()
    finally:
        backend.close()


def test_the_setting_reaches_the_runtime_and_is_checked(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with EdgeCloud(edge_model=str(smollm2_path), edge_speculate="off") as client:
        assert client.edge.speculator is None  # type: ignore[attr-defined]
    monkeypatch.setenv("EDGECLOUD_EDGE_SPECULATE", "ngram")
    with EdgeCloud(edge_model=str(smollm2_path)) as client:
        assert client.edge.speculator is not None  # type: ignore[attr-defined]
    with pytest.raises(EdgeCloudError, match="edge_speculate"):
        EdgeCloud(edge_model=str(smollm2_path), edge_speculate=" ")
    with EdgeCloud(edge_model=str(smollm2_path), edge_runtime="torch", edge_speculate="ngram") as client:
        assert client.edge.speculator is not None  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="draft model needs the llama.cpp"):
        EdgeCloud(edge_model=str(smollm2_path), edge_runtime="torch", edge_speculate=str(smollm2_path)).edge


@pytest.fixture(scope="module")
def torch_trio(smollm2_path: Path) -> Iterator[tuple[object, object, object]]:
    """The torch runtime plain, under ``auto`` (guessing only where its probe found a pass of
    several rows exact on this machine), and guessing 2 tokens every step by prompt lookup."""
    from edgecloud.edge.torch import TorchBackend

    backends = [TorchBackend(smollm2_path, device="cpu", n_ctx=1024, speculate=mode, speculate_k=k, reuse_prefix=False)
                for mode, k in (("off", None), ("auto", None), ("ngram", 2))]
    try:
        for backend in backends:
            backend.load()
        yield tuple(backends)  # type: ignore[misc]
    finally:
        for backend in backends:
            backend.close()


def _greedy(backend: object, messages: list[dict[str, str]]) -> object:
    return backend.complete(ChatRequest(messages=messages, max_tokens=96, temperature=0))  # type: ignore[attr-defined]


def test_the_torch_runtime_under_auto_writes_its_own_greedy_text(torch_trio: tuple[object, object, object]) -> None:
    plain, auto, _ = torch_trio
    for messages in (COPYING, FREE):
        assert _greedy(auto, messages).text == _greedy(plain, messages).text  # type: ignore[attr-defined]
    if auto.speculator.disabled is None:  # type: ignore[attr-defined]  # a device where wide passes are exact
        spec = _greedy(auto, COPYING).usage.speculative  # type: ignore[attr-defined]
        assert spec is None or spec["num_draft_tokens"] >= spec["num_accepted_tokens"]
    else:
        assert _greedy(auto, COPYING).usage.speculative is None  # type: ignore[attr-defined]


def test_the_torch_runtime_writes_copied_text_from_accepted_guesses(torch_trio: tuple[object, object, object]) -> None:
    """Guessing every step (exact or not on this CPU): much of the answer comes from accepted
    guesses, and it still copies the function (rejected guesses are cut from the cache)."""
    plain, _, guessing = torch_trio
    answer = _greedy(guessing, COPYING)
    usage = answer.usage  # type: ignore[attr-defined]
    spec = usage.speculative
    assert spec is not None and spec["num_accepted_tokens"] > usage.completion_tokens / 4, spec
    assert sum(spec["k_trace"]) == spec["num_draft_tokens"]
    assert "def read_scores(path):" in answer.text  # type: ignore[attr-defined]
    assert _greedy(plain, COPYING).usage.speculative is None  # type: ignore[attr-defined]


def _speculator(pass_seconds: list[float]) -> EdgeSpeculator:
    """A prompt-lookup speculator calibrated as if passes of 1, 2, 3 rows took ``pass_seconds``."""
    spec = EdgeSpeculator()
    spec.calibrate(lambda limit: (3, [(rows, seconds) for rows, seconds in enumerate(pass_seconds, 1)] * 4))
    return spec


def test_the_controller_guesses_only_where_a_wider_pass_is_cheap() -> None:
    context = [5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7]  # the suffix 5 6 7 was followed by 8 9
    cheap, linear = _speculator([0.030, 0.031, 0.032]), _speculator([0.030, 0.060, 0.090])
    assert cheap.propose(cheap.state(), context, cap=8) == ("ngram", [8, 9])  # at most what decodes exactly
    assert linear.propose(linear.state(), context, cap=8) == ("", [])


def test_where_no_batch_decodes_exactly_nothing_is_guessed() -> None:
    spec = EdgeSpeculator()
    spec.calibrate(lambda limit: (1, [(1, 0.03), (2, 0.031)]))
    assert spec.disabled and spec.propose(spec.state(), [5, 6, 7, 8, 5, 6, 7], cap=8) == ("", [])
