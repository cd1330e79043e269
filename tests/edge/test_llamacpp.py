"""The llama.cpp edge backend, against the real SmolLM2-135M GGUF model.

What is specific to llama.cpp (the streaming / stop / cancel / seed contract every edge
backend keeps is ``test_backend_contract.py``). Every test asserts observable behaviour
(chunks, text, usage, errors); none measures time.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from edgecloud.edge.llamacpp import LlamaCppBackend
from edgecloud.runtime.prefix_cache import PrefixCache, SavedPrefix
from edgecloud.runtime.text_stream import TextStream
from edgecloud.errors import BackendUnavailableError, ContextOverflowError, ModelIntegrityError, ModelNotFoundError
from edgecloud.types import ChatCompletionChunk, ChatRequest

N_CTX = 1024
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
]


@pytest.fixture(scope="module")
def model_path(smollm2_path: Path) -> Path:
    return smollm2_path


@pytest.fixture(scope="module")
def backend(model_path: Path) -> Iterator[LlamaCppBackend]:
    b = LlamaCppBackend(model_path, n_ctx=N_CTX)
    b.load()
    yield b
    b.close()


@pytest.fixture(scope="module")
def fresh_backend(model_path: Path) -> Iterator[LlamaCppBackend]:
    """Same model without any prefix reuse: every prompt evaluated from scratch."""
    b = LlamaCppBackend(model_path, n_ctx=N_CTX, reuse_prefix=False)
    yield b
    b.close()


@pytest.fixture(scope="module")
def bare(model_path: Path, backend: LlamaCppBackend) -> Iterator[object]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model_path), verbose=False, **backend.llama_kwargs)
    yield llm
    llm.close()


def ask(text: str, **fields: object) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": text}], **fields)


def run(backend: LlamaCppBackend, request: ChatRequest) -> list[ChatCompletionChunk]:
    return list(backend.stream(request))


def test_prompt_tokens_match_llama_cpp_python_formatter(backend: LlamaCppBackend, bare: object) -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    llm = bare
    eos = llm._model.token_get_text(llm.token_eos())
    bos = llm._model.token_get_text(llm.token_bos()) if llm.token_bos() != -1 else ""
    formatter = Jinja2ChatFormatter(
        template=llm.metadata["tokenizer.chat_template"], eos_token=eos, bos_token=bos
    )
    conversation = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Héllo — ça va? 🙂"},
        {"role": "assistant", "content": "Oui."},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    for messages in (conversation, conversation[1:2]):
        result = formatter(messages=messages)
        expected = llm.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True)
        assert backend.tokenize_chat(messages) == expected


@pytest.mark.parametrize("question", QUESTIONS)
def test_greedy_output_matches_bare_llama_cpp_python(backend: LlamaCppBackend, bare: object, question: str) -> None:
    messages = [{"role": "user", "content": question}]
    bare.reset()
    expected = bare.create_chat_completion(messages=messages, temperature=0.0, max_tokens=48)
    ours = backend.complete(ask(question, temperature=0, max_tokens=48))
    assert ours.text == expected["choices"][0]["message"]["content"]
    assert ours.usage.completion_tokens == expected["usage"]["completion_tokens"]
    assert ours.usage.prompt_tokens == expected["usage"]["prompt_tokens"]


def test_frequency_penalty_reduces_repetition(backend: LlamaCppBackend) -> None:
    prompt = "Write the word 'cat' forty times, separated by spaces."
    plain = backend.complete(ask(prompt, temperature=0, max_tokens=40)).text
    penalised = backend.complete(ask(prompt, temperature=0, max_tokens=40, frequency_penalty=2.0)).text
    assert penalised != plain
    assert penalised.lower().count("cat") < plain.lower().count("cat")


def test_logprobs_one_per_token_sorted_alternatives(backend: LlamaCppBackend) -> None:
    completion = backend.complete(ask(QUESTIONS[0], temperature=0, max_tokens=16, logprobs=True, top_logprobs=3))
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens > 0
    assert "".join(t.token for t in content).startswith(completion.text[:5])
    for entry in content:
        assert entry.logprob <= 0.0
        alts = [t.logprob for t in entry.top_logprobs]
        assert len(alts) == 3 and alts == sorted(alts, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(alts[0])


def test_no_logprobs_unless_asked(backend: LlamaCppBackend) -> None:
    completion = backend.complete(ask(QUESTIONS[0], temperature=0, max_tokens=4))
    assert completion.choices[0].logprobs is None


def test_prompt_longer_than_context_raises_before_evaluating(backend: LlamaCppBackend) -> None:
    evaluated = backend.stats.prefill_tokens
    with pytest.raises(ContextOverflowError) as info:
        backend.complete(ask("word " * 2000, max_tokens=8))
    assert info.value.prompt_tokens > N_CTX
    assert info.value.context_tokens == N_CTX
    assert backend.stats.prefill_tokens == evaluated
    assert backend.complete(ask(QUESTIONS[0], temperature=0, max_tokens=4)).text


def test_next_turn_reuses_prefix_and_matches_fresh_evaluation(
    backend: LlamaCppBackend, fresh_backend: LlamaCppBackend
) -> None:
    turn1 = [{"role": "user", "content": "Name three fruits."}]
    first = backend.complete(ChatRequest(messages=turn1, temperature=0, max_tokens=24))
    turn2 = turn1 + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Which of them is the sweetest?"},
    ]
    request = ChatRequest(messages=turn2, temperature=0, max_tokens=24)
    second = backend.complete(request)
    assert second.usage.cached_tokens >= first.usage.prompt_tokens
    cold = fresh_backend.complete(request)
    assert cold.usage.cached_tokens == 0
    assert second.text == cold.text


def test_alternating_conversations_resume_from_saved_state(backend: LlamaCppBackend) -> None:
    history_a = [
        {"role": "system", "content": "You are a terse assistant about astronomy. " * 4},
        {"role": "user", "content": "What is a pulsar?"},
    ]
    history_b = [
        {"role": "system", "content": "You are a cheerful assistant about cooking. " * 4},
        {"role": "user", "content": "How do I boil an egg?"},
    ]
    a1 = backend.complete(ChatRequest(messages=history_a, temperature=0, max_tokens=16))
    backend.complete(ChatRequest(messages=history_b, temperature=0, max_tokens=16))
    restores = backend.stats.restores
    history_a += [{"role": "assistant", "content": a1.text}, {"role": "user", "content": "And a magnetar?"}]
    a2 = backend.complete(ChatRequest(messages=history_a, temperature=0, max_tokens=16))
    assert backend.stats.restores == restores + 1
    assert a2.usage.cached_tokens >= a1.usage.prompt_tokens


def test_first_question_reuses_warm_system_prefix(model_path: Path) -> None:
    with LlamaCppBackend(model_path, n_ctx=256) as b:
        first = b.complete(ask(QUESTIONS[0], temperature=0, max_tokens=2))
        assert first.usage.cached_tokens > 0


def test_astream_yields_the_same_answer(backend: LlamaCppBackend) -> None:
    request = ask(QUESTIONS[0], temperature=0, max_tokens=16)

    async def collect() -> list[ChatCompletionChunk]:
        return [chunk async for chunk in backend.astream(request)]

    chunks = asyncio.run(collect())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.text for c in chunks) == backend.complete(request).text


def test_close_is_idempotent_and_final(model_path: Path) -> None:
    b = LlamaCppBackend(model_path, n_ctx=256)
    b.complete(ask("Hi", temperature=0, max_tokens=2))
    b.close()
    b.close()
    assert not b.loaded
    with pytest.raises(BackendUnavailableError):
        b.complete(ask("Hi", max_tokens=2))


def test_missing_runtime_says_how_to_install(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'edgecloud\[edge\]'"):
        LlamaCppBackend(model_path).load()


def test_llama_cpp_warnings_reach_stderr_only_when_verbose(model_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # A vocabulary-only load (the torch engine's tokenizer) makes llama.cpp warn about its
    # context; llama-cpp-python's own callback printed that warning despite verbose=False.
    pytest.importorskip("torch")
    from edgecloud.engine import Tokenizer
    from edgecloud.runtime.llama_cpp import import_llama_cpp

    Tokenizer(model_path).close()
    assert capfd.readouterr().err == ""
    llama_cpp = import_llama_cpp()
    llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=True).close()
    err = capfd.readouterr().err
    assert "llama_model_loader" in err and "n_ctx_train" in err  # info and the warning, when asked for


def test_missing_and_truncated_model_files(model_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        LlamaCppBackend(tmp_path / "absent.gguf").load()
    truncated = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as src, open(truncated, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
        dst.truncate(4 << 20)
    with pytest.raises(ModelIntegrityError):
        LlamaCppBackend(truncated, n_ctx=256).load()


# ---------------------------------------------------------------------- pure helpers


def test_text_stream_never_splits_a_character_or_emits_a_stop_prefix() -> None:
    stream = TextStream(["END"])
    data = "né🙂".encode()
    out = [stream.push(data[i : i + 1]) for i in range(len(data))]
    assert "".join(out) == "né🙂" and all("\ufffd" not in piece for piece in out)
    assert stream.push(b" E") == " "  # "E" may start "END": held back
    assert stream.push(b"ND and more") == ""
    assert stream.stopped
    held = TextStream(["END"])
    assert held.push(b"x EN") == "x "
    assert held.flush() == "EN"


def test_prefix_cache_is_bounded_and_prefers_longest_match() -> None:
    import numpy as np

    cache = PrefixCache(capacity_bytes=100)
    system = SavedPrefix(tokens=np.array([1, 2, 3], dtype=np.intc), state=b"s", nbytes=30, pinned=True)
    conv_a = SavedPrefix(tokens=np.array([1, 2, 3, 4, 5], dtype=np.intc), state=b"a", nbytes=40)
    conv_b = SavedPrefix(tokens=np.array([1, 2, 3, 9, 9, 9], dtype=np.intc), state=b"b", nbytes=40)
    assert cache.put(system) and cache.put(conv_a)
    assert cache.best_match([1, 2, 3, 4, 5, 6]) == (conv_a, 5)
    assert cache.put(conv_b)  # evicts conv_a (LRU, unpinned), keeps the pinned system prefix
    assert cache.best_match([1, 2, 3, 4]) == (system, 3)
    assert cache.nbytes == 70 and len(cache) == 2
    assert not cache.put(SavedPrefix(tokens=np.array([7], dtype=np.intc), state=b"x", nbytes=101))


def test_idle_time_after_an_answer_prefetches_the_next_turn_header(backend: LlamaCppBackend) -> None:
    import time

    turn1 = [{"role": "user", "content": "Name one colour of the rainbow."}]
    before = backend.stats.prefetched_tokens
    first = backend.complete(ChatRequest(messages=turn1, temperature=0, max_tokens=8))
    for _ in range(100):  # the prefetch runs on a worker thread once the stream is done
        if backend.stats.prefetched_tokens > before:
            break
        time.sleep(0.05)
    assert backend.stats.prefetched_tokens > before
    turn2 = turn1 + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And another one?"},
    ]
    second = backend.complete(ChatRequest(messages=turn2, temperature=0, max_tokens=8))
    # more than prompt + answer is reused: the turn boundary after the answer was already there
    assert second.usage.cached_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_a_context_llama_cpp_pads_is_bounded_by_the_python_buffers(smollm2_path: Path) -> None:
    # llama.cpp rounds n_ctx up to a multiple of 256; a prompt between the two sizes once
    # crashed llama-cpp-python's buffers ("could not broadcast") instead of being refused
    from edgecloud.errors import ContextOverflowError

    with LlamaCppBackend(smollm2_path, n_ctx=100, reuse_prefix=False) as backend:
        backend.load()
        assert backend.n_ctx == 100
        with pytest.raises(ContextOverflowError):
            backend.complete(ChatRequest(messages=[{"role": "user", "content": "word " * 150}], max_tokens=2))
        assert backend.complete(ChatRequest(messages=[{"role": "user", "content": "Hi"}], max_tokens=2)).text is not None
