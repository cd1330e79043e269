"""The Core ML backend: a clear refusal off macOS; its answer loop (sampling, chunks, logprobs) over the
traced decoder the package is converted from, against the engine; and, on macOS 15+ only, generation
from an exported package."""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("coremltools")

import torch

from edgecloud.engine import Tokenizer, Transformer, generate
from edgecloud.runtime.chunks import AnswerChunks
from edgecloud.edge.coreml import CoreMLBackend, Step, coreml_unavailable_reason, stream_answer
from edgecloud.errors import BackendUnavailableError
from edgecloud.quant.export_coreml import StatefulDecoder, causal_mask, trace_decoder
from edgecloud.types import ChatCompletionChunk, ChatRequest, RouteInfo

#: tests/conftest.py cannot be imported by name (other conftest.py files share the name)
SMOLLM2 = "smollm2-135m-instruct-q4"

CONTEXT = 64
MESSAGES = [{"role": "user", "content": "Count from one to five."}]


@pytest.fixture(scope="module")
def engine_and_prompt(smollm2_path: Path) -> Iterator[tuple[Transformer, Tokenizer, list[int]]]:
    torch.set_num_threads(1)
    model = Transformer.from_gguf(smollm2_path, dtype=torch.float32)
    tokenizer = Tokenizer(smollm2_path)
    yield model, tokenizer, tokenizer.encode_chat(MESSAGES)
    tokenizer.close()


@pytest.fixture(scope="module")
def traced_step(engine_and_prompt: tuple[Transformer, Tokenizer, list[int]]) -> Step:
    """The graph the package is converted from, driven exactly as CoreMLBackend drives predict().

    Reused across answers: each prefill rewrites the slots it reads, as on a fresh state.
    """
    traced = trace_decoder(StatefulDecoder(engine_and_prompt[0], CONTEXT))

    def step(tokens: Sequence[int], filled: int) -> np.ndarray:
        n = len(tokens)
        with torch.no_grad():
            logits = traced(torch.tensor([tokens], dtype=torch.int32), torch.from_numpy(causal_mask(n, filled + n)))
        return logits[0, -1].numpy()

    return step


def _answer(step: Step, request: ChatRequest, prompt: list[int], max_new: int, tokenizer: Tokenizer,
            is_eog: Callable[[int], bool] | None = None) -> list[ChatCompletionChunk]:
    route = RouteInfo(target="edge", backend="coreml", reason="the traced decoder")
    answer = AnswerChunks(request, SMOLLM2, route, lambda t: tokenizer.token_to_piece(t, special=False),
                          is_eog or tokenizer.is_eog)
    return list(stream_answer(step, request, prompt, max_new, answer))


def _text(chunks: list[ChatCompletionChunk]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks)


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the refusal off macOS")
def test_backend_says_core_ml_prediction_needs_macos(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        CoreMLBackend(tmp_path / "m.mlpackage")
    message = str(info.value)
    assert message.startswith(f"Core ML prediction needs macOS 15+ (this is {platform.system()})")  # "Linux" here
    assert "can be built here with `edgecloud export coreml` and copied to a Mac" in message
    assert coreml_unavailable_reason() == message


def test_answer_over_the_traced_decoder_is_the_engines_greedy_answer(
    engine_and_prompt: tuple[Transformer, Tokenizer, list[int]], traced_step: Step
) -> None:
    model, tokenizer, prompt = engine_and_prompt
    expected = list(generate(model, tokenizer, prompt, 12, temperature=0.0, stop_at_eog=False))
    request = ChatRequest(messages=MESSAGES, temperature=0, ignore_eos=True)
    chunks = _answer(traced_step, request, prompt, 12, tokenizer)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].route is not None
    assert _text(chunks) == tokenizer.decode(expected, special=False).decode("utf-8")
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length"
    assert last.usage is not None and (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 12)


def test_answer_stops_before_an_end_token(
    engine_and_prompt: tuple[Transformer, Tokenizer, list[int]], traced_step: Step
) -> None:
    model, tokenizer, prompt = engine_and_prompt
    full = list(generate(model, tokenizer, prompt, 6, temperature=0.0, stop_at_eog=False))
    cut = next(i for i in range(1, len(full)) if full[i] not in full[:i])  # a token that first comes later
    request = ChatRequest(messages=MESSAGES, temperature=0)
    chunks = _answer(traced_step, request, prompt, 6, tokenizer, is_eog=lambda t: t == full[cut])
    assert _text(chunks) == tokenizer.decode(full[:cut], special=False).decode("utf-8")
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == cut


def test_answer_carries_logprobs_and_seeded_sampling_repeats(
    engine_and_prompt: tuple[Transformer, Tokenizer, list[int]], traced_step: Step
) -> None:
    _, tokenizer, prompt = engine_and_prompt
    request = ChatRequest(messages=MESSAGES, temperature=0, logprobs=True, top_logprobs=2, ignore_eos=True)
    chunks = _answer(traced_step, request, prompt, 4, tokenizer)
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens == 4
    for entry in entries:  # greedy: the chosen token is the most likely one
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token

    sampled = ChatRequest(messages=MESSAGES, temperature=0.9, seed=7, ignore_eos=True)
    first, second = (_text(_answer(traced_step, sampled, prompt, 6, tokenizer)) for _ in range(2))
    assert first == second


@pytest.mark.skipif(coreml_unavailable_reason() is not None, reason="Core ML prediction needs macOS")
def test_backend_generates_from_an_exported_package(tmp_path: Path) -> None:
    from edgecloud.quant.export_coreml import export_coreml

    package = export_coreml(SMOLLM2, tmp_path / "m.mlpackage", context=CONTEXT).path
    with CoreMLBackend(package) as backend:
        chunks = list(backend.stream(ChatRequest(messages=MESSAGES, max_tokens=4, temperature=0)))
        answer = backend.complete(ChatRequest(messages=MESSAGES, max_tokens=4, temperature=0))
    assert chunks[0].choices[0].delta.role == "assistant"
    last = chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length") and last.usage is not None
    assert 1 <= last.usage.completion_tokens <= 4 and last.route.backend == "coreml"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text and answer.choices[0].message.content == text  # greedy: the same answer twice
