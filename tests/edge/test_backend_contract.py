"""The edge-backend contract, run against every edge runtime on SmolLM2-135M: llama.cpp (the GGUF),
torch (the engine on this device) and ONNX Runtime (its ``edgecloud export onnx`` folder).

What any Backend must do whatever runs it: a role chunk, text chunks, then a finish chunk with
usage and route; the stream collected is the non-streamed answer (greedy); ``max_tokens`` ends
with ``length``, a stop string with ``stop`` and never appears; closing the stream stops
generation and the backend serves the next request; the same seed gives the same sample.
Every test asserts observable behaviour; none measures time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from edgecloud.backend import Backend
from edgecloud.types import ChatRequest

N_CTX = 1024
QUESTION = "Write a Python function that reverses a string."


def _llamacpp(request: pytest.FixtureRequest) -> Backend:
    pytest.importorskip("llama_cpp")
    from edgecloud.edge.llamacpp import LlamaCppBackend

    return LlamaCppBackend(request.getfixturevalue("smollm2_path"), n_ctx=N_CTX, n_threads=1)


def _torch(request: pytest.FixtureRequest) -> Backend:
    torch = pytest.importorskip("torch")
    pytest.importorskip("llama_cpp")  # the engine tokenizes with llama.cpp
    from edgecloud.edge.torch import TorchBackend

    # one thread: on a shared 2-core machine a 2-thread step waits on the busy core
    torch.set_num_threads(1)
    return TorchBackend(request.getfixturevalue("smollm2_path"), n_ctx=N_CTX)


def _onnx(request: pytest.FixtureRequest) -> Backend:
    pytest.importorskip("onnxruntime_genai")
    from edgecloud.edge.onnx import OnnxBackend

    return OnnxBackend(request.getfixturevalue("smollm2_onnx"), n_ctx=N_CTX, n_threads=1)


#: Backend name -> how to build it on SmolLM2-135M.
BACKENDS: dict[str, Callable[[pytest.FixtureRequest], Backend]] = {
    "llamacpp": _llamacpp,
    "torch": _torch,
    "onnx": _onnx,
}


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    b = BACKENDS[request.param](request)
    b.load()
    yield b
    b.close()


def ask(text: str, **fields: object) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": text}], **fields)


def test_stream_is_role_then_text_then_finish_with_usage_and_route(backend: Backend) -> None:
    chunks = list(backend.stream(ask(QUESTION, temperature=0, max_tokens=24)))
    first, middle, last = chunks[0], chunks[1:-1], chunks[-1]
    assert first.choices[0].delta.role == "assistant"
    assert middle and all(c.choices[0].delta.content for c in middle)
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert last.choices[0].finish_reason in ("stop", "length")
    usage = last.usage
    assert usage is not None and usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert last.route is not None and last.route.target == "edge" and last.route.backend == backend.name
    assert len({c.id for c in chunks}) == 1


def test_stream_collected_is_the_greedy_answer(backend: Backend) -> None:
    request = ask(QUESTION, temperature=0, max_tokens=32)
    streamed = "".join(c.text for c in backend.stream(request))
    completion = backend.complete(request)
    assert streamed and completion.text == streamed
    assert completion.usage is not None and completion.usage.completion_tokens > 0


def test_max_tokens_finishes_with_length(backend: Backend) -> None:
    completion = backend.complete(ask("Count from one to one hundred in words.", temperature=0, max_tokens=5))
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 5


def test_stop_string_ends_the_answer_before_it(backend: Backend) -> None:
    full = backend.complete(ask(QUESTION, temperature=0, max_tokens=48)).text
    assert len(full) > 20
    stop = full[12:17]  # starts mid-answer, likely spanning tokens
    answer = backend.complete(ask(QUESTION, temperature=0, max_tokens=48, stop=[stop, "\u2603never"]))
    assert answer.text == full[: full.index(stop)]
    assert answer.choices[0].finish_reason == "stop"


def test_closing_the_stream_stops_generation_and_the_next_request_is_served(backend: Backend) -> None:
    stats = backend.stats  # type: ignore[attr-defined]  # every edge backend counts its tokens
    before = stats.completion_tokens
    stream = backend.stream(ask("Write a long essay about the sea.", temperature=0, max_tokens=200))
    for i, _ in enumerate(stream):
        if i == 1:
            break
    stream.close()
    assert backend.stats.completion_tokens - before <= 2  # type: ignore[attr-defined]
    after = backend.complete(ask("What is the capital of France?", temperature=0, max_tokens=8))
    assert after.text and after.usage is not None and after.usage.completion_tokens > 0


def test_closing_the_async_stream_stops_generation(backend: Backend) -> None:
    async def first_chunks() -> int:
        stream = backend.astream(ask("Write a long essay about the sea.", temperature=0, max_tokens=200))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()  # type: ignore[attr-defined]
        return seen

    before = backend.stats.completion_tokens  # type: ignore[attr-defined]
    assert asyncio.run(first_chunks()) == 2
    assert backend.stats.completion_tokens - before < 200  # type: ignore[attr-defined]
    assert backend.complete(ask("Say hi.", temperature=0, max_tokens=4)).text


def test_same_seed_same_sample(backend: Backend) -> None:
    assert backend.supports_seed
    texts = [
        backend.complete(ask("Tell me a short story about a fox.", temperature=1.0, top_p=0.95, seed=s, max_tokens=32)).text
        for s in (7, 7, 8, 9)
    ]
    assert texts[0] == texts[1]
    assert len(set(texts)) > 1
