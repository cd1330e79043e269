"""The torch edge backend and its per-op CPU fallback, against the real SmolLM2-135M GGUF model.

Every test asserts observable behaviour (chunks, text, logits, counts, errors); none measures time.
On this CPU-only machine a fallback "moves" tensors by copying them, so the declared ops
really take the CPU path, in-place write-back included.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

from engine.test_engine import _check_parity  # the engine's llama.cpp parity check, reused

from edgecloud.engine import generate
from edgecloud.edge.op_fallback import CpuFallback, DeviceCaps, device_caps
from edgecloud.edge.torch import TorchBackend
from edgecloud.errors import BackendError, ConfigError, ContextOverflowError, InvalidRequestError
from edgecloud.types import ChatCompletionChunk, ChatRequest

# One thread: on this shared 2-core machine a 2-thread decode step waits on the busy core at
# every parallel region (measured 1.8 s per SmolLM2 step with 2 threads, 0.07 s with 1).
torch.set_num_threads(1)

N_CTX = 512
ATTENTION = "scaled_dot_product_attention"
QUESTION = "What is the capital of France?"
#: Teacher-forced after the chat prompt: 200 tokens of it are scored with and without fallback.
TEACHER = (
    "The edge runs small models on the device itself, close to the user, while the cloud runs large "
    "models on shared accelerators far away. A router decides, for every question, which side should "
    "answer: short questions and private data stay on the device, long or hard ones go to the cloud. "
    "When the device lacks a kernel for some operation, that one operation can run on the CPU instead, "
    "with its inputs copied over and its result copied back, while everything else stays on the GPU. "
    "def fallback(op, *args):\n    moved = [a.cpu() for a in args]\n    return op(*moved).to(args[0].device)\n"
    "Counting every such fallback tells the developer what the device is missing and what it costs. "
    "The logits must not change: the CPU computes the same function, only somewhere else, so the "
    "most likely next token is the same at every position of the text that is being scored here. "
    "A benchmark prints how much slower the fallback is, so nobody has to guess."
)
N_TEACHER = 200


def ask(text: str, **fields: object) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": text}], **fields)


@pytest.fixture(scope="module")
def backend(smollm2_path: Path) -> Iterator[TorchBackend]:
    b = TorchBackend(smollm2_path, device="auto", n_ctx=N_CTX)
    b.load()
    yield b
    b.close()


@pytest.fixture(scope="module")
def fallback_backend(smollm2_path: Path) -> Iterator[TorchBackend]:
    """Attention declared unsupported on this device: every attention call runs on the CPU path."""
    b = TorchBackend(smollm2_path, device="cpu", n_ctx=N_CTX, unsupported_ops={ATTENTION}, reuse_prefix=False)
    b.load()
    yield b
    b.close()


@pytest.fixture(scope="module")
def teacher_forced(backend: TorchBackend) -> list[int]:
    prompt = backend.tokenize_chat([{"role": "user", "content": "Explain the edge-cloud split."}])
    teacher = backend.tokenizer.encode(TEACHER)
    assert len(teacher) >= N_TEACHER
    return prompt + teacher[:N_TEACHER]


# ---------------------------------------------------------------------- the backend


def test_cpu_machine_runs_on_cpu_in_float32(backend: TorchBackend) -> None:
    assert (backend.device, backend.dtype) == ("cpu", torch.float32)
    assert backend.caps.unsupported == frozenset() and backend.fallbacks == {}
    assert backend.n_ctx == N_CTX and backend.name == "torch" and backend.target == "edge"


def test_stream_yields_role_then_text_then_finish_with_usage(backend: TorchBackend) -> None:
    chunks = list(backend.stream(ask(QUESTION, temperature=0, max_tokens=24)))
    first, last = chunks[0], chunks[-1]
    assert first.choices[0].delta.role == "assistant" and first.object == "chat.completion.chunk"
    middle = chunks[1:-1]
    assert middle and all(c.choices[0].delta.content for c in middle)
    assert "Paris" in "".join(c.text for c in chunks)
    assert last.choices[0].finish_reason == "stop"
    assert last.usage is not None and last.usage.prompt_tokens > 0
    assert 0 < last.usage.completion_tokens < 24
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert last.route is not None and (last.route.target, last.route.backend) == ("edge", "torch")
    assert last.route.reason == "on cpu with torch (float32)"
    assert len({c.id for c in chunks}) == 1


def test_greedy_answer_is_the_engines_greedy_generation(backend: TorchBackend, fallback_backend: TorchBackend) -> None:
    """With attention on the CPU path, the answer is token for token the engine's own (no fallback)."""
    prompt = backend.tokenize_chat([{"role": "user", "content": "Write a Python function that reverses a string."}])
    expected = list(generate(backend.transformer, backend.tokenizer, prompt, 32))
    before = fallback_backend.fallbacks.get(ATTENTION, 0)
    ours = fallback_backend.complete(ask("Write a Python function that reverses a string.", temperature=0, max_tokens=32))
    assert ours.text == backend.tokenizer.decode(expected, special=False).decode("utf-8")
    assert ours.usage.completion_tokens == len(expected) == 32
    # 32 tokens = a prefill and 31 decode steps, each with one attention call per layer
    n_layer = backend.transformer.args.n_layer
    assert fallback_backend.fallbacks[ATTENTION] - before == 32 * n_layer
    assert ours.route.reason == f"on cpu with torch (float32); {32 * n_layer} ops fell back to the CPU ({ATTENTION} {32 * n_layer})"


def test_agrees_with_llama_cpp_with_attention_on_the_cpu(smollm2_path: Path, fallback_backend: TorchBackend) -> None:
    with fallback_backend.fallback_scope():
        _check_parity(smollm2_path, fallback_backend.transformer, fallback_backend.tokenizer)
    assert fallback_backend.fallbacks[ATTENTION] > 0


def test_next_turn_reuses_the_cached_prefix_and_answers_the_same(
    backend: TorchBackend, fallback_backend: TorchBackend
) -> None:
    first = backend.complete(ask(QUESTION, temperature=0, max_tokens=12))
    turn = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And of Italy?"}]
    again = backend.complete(ChatRequest(messages=turn, temperature=0, max_tokens=12))
    fresh = fallback_backend.complete(ChatRequest(messages=turn, temperature=0, max_tokens=12))
    assert again.usage.cached_tokens >= first.usage.prompt_tokens
    assert fresh.usage.cached_tokens == 0
    assert again.text == fresh.text


def test_astream_yields_the_same_answer(fallback_backend: TorchBackend) -> None:
    async def collect() -> list[ChatCompletionChunk]:
        return [c async for c in fallback_backend.astream(ask(QUESTION, temperature=0, max_tokens=8))]

    chunks = asyncio.run(collect())
    assert "".join(c.text for c in chunks) == fallback_backend.complete(ask(QUESTION, temperature=0, max_tokens=8)).text


def test_logprobs_refused_options_and_overflow(backend: TorchBackend) -> None:
    answer = backend.complete(ask(QUESTION, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2))
    entries = answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens
    # greedy: each chosen token is the most likely one, and it is listed first among the alternatives
    assert all(e.logprob <= 0 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5) for e in entries)
    assert "".join(e.token for e in entries).strip() == answer.text.strip()
    with pytest.raises(InvalidRequestError) as info:
        backend.complete(ask(QUESTION, presence_penalty=0.5))
    assert info.value.param == "presence_penalty"
    with pytest.raises(ContextOverflowError):
        backend.complete(ask("word " * 2000, max_tokens=8))
    assert backend.complete(ask(QUESTION, temperature=0, max_tokens=4)).text


# ---------------------------------------------------------------------- the fallback


def test_attention_on_the_cpu_path_keeps_every_logit(
    backend: TorchBackend, fallback_backend: TorchBackend, teacher_forced: list[int]
) -> None:
    before = fallback_backend.fallbacks[ATTENTION]
    plain = backend.score(teacher_forced)
    fallen = fallback_backend.score(teacher_forced)
    assert fallback_backend.fallbacks[ATTENTION] - before == backend.transformer.args.n_layer
    taught = slice(len(teacher_forced) - N_TEACHER - 1, -1)  # the positions that predict the teacher's tokens
    agreement = (plain[taught].argmax(-1) == fallen[taught].argmax(-1)).float().mean().item()
    assert agreement == 1.0
    assert (plain - fallen).abs().max().item() <= 1e-5


def test_kv_cache_writes_on_the_cpu_path_are_written_back(backend: TorchBackend, teacher_forced: list[int]) -> None:
    """``cache.k[layer, a:b] = k`` is an in-place ``__setitem__``: run on a CPU copy, copied back."""
    model = backend.transformer
    caps = device_caps("cpu", torch.float32).declaring({"__setitem__"})
    seq, steps = teacher_forced[:-4], teacher_forced[-4:]
    with torch.inference_mode():
        plain_cache = model.new_cache(len(teacher_forced))
        plain = [model(torch.tensor(seq), None, plain_cache)[-1]] + [
            model(torch.tensor([t]), None, plain_cache)[0] for t in steps
        ]
        fallback, cache = CpuFallback(caps), model.new_cache(len(teacher_forced))
        with fallback:
            fallen = [model(torch.tensor(seq), None, cache)[-1]]
        for t in steps:  # entered per step, as the backend does
            with fallback:
                fallen.append(model(torch.tensor([t]), None, cache)[0])
    assert fallback.counts == {"__setitem__": 2 * model.args.n_layer * (1 + len(steps))}
    assert torch.equal(cache.k[:, : len(teacher_forced)], plain_cache.k[:, : len(teacher_forced)])
    assert max((a - b).abs().max().item() for a, b in zip(plain, fallen)) <= 1e-5


def test_in_place_and_out_ops_write_back_and_keep_identity() -> None:
    caps = DeviceCaps("cpu", torch.float32, unsupported=frozenset({"index_copy", "add"}))
    x = torch.zeros(4, 3)
    out = torch.empty(2)
    with CpuFallback(caps) as fallback:
        returned = x.index_copy_(0, torch.tensor([2, 0]), torch.ones(2, 3))
        summed = torch.add(torch.ones(2), torch.ones(2), out=out)
        plain = torch.index_copy(torch.zeros(2), 0, torch.tensor([1]), torch.ones(1))
    assert returned is x and summed is out
    assert x.sum(-1).tolist() == [3.0, 0.0, 3.0, 0.0]
    assert out.tolist() == [2.0, 2.0] and plain.tolist() == [0.0, 1.0]
    assert fallback.counts == {"index_copy_": 1, "add": 1, "index_copy": 1}


def test_fallback_counts_only_declared_ops_and_restores_dtype() -> None:
    caps = DeviceCaps("cpu", torch.float16, unsupported=frozenset({"isin", "softmax"}),
                      cpu_upcast={torch.float16: torch.float32})
    with CpuFallback(caps) as fallback:
        mask = torch.isin(torch.tensor([1, 2, 3]), torch.tensor([2]))
        probs = torch.softmax(torch.tensor([1.0, 2.0], dtype=torch.float16), dim=-1)
        torch.arange(3) * 2  # not declared: runs where it is, uncounted
    assert mask.tolist() == [False, True, False]
    assert probs.dtype == torch.float16 and abs(probs.float().sum().item() - 1) < 1e-3
    assert fallback.counts == {"isin": 1, "softmax": 1}


def test_built_in_table() -> None:
    mps_half = device_caps("mps", torch.float16, torch_version=(2, 3))
    assert {ATTENTION, "isin", "index_copy"} <= mps_half.unsupported
    assert all(mps_half.reasons[op] for op in mps_half.unsupported)
    assert mps_half.cpu_upcast == {torch.float16: torch.float32}
    assert "isin" not in device_caps("mps", torch.float16, torch_version=(2, 4)).unsupported
    assert ATTENTION not in device_caps("mps", torch.float32).unsupported
    assert "14" in device_caps("mps", torch.bfloat16, macos_major=13).dtype_problem
    assert not device_caps("mps", torch.bfloat16, macos_major=14).dtype_problem
    for device in ("cpu", "cuda:0"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            caps = device_caps(device, dtype)
            assert caps.unsupported == frozenset() and not caps.dtype_problem


@pytest.mark.parametrize("op", ["to", "copy_", "resize_", "view", "__getitem__", "transpose"])
def test_ops_the_fallback_cannot_honour_are_refused(op: str) -> None:
    with pytest.raises(ConfigError, match=op.strip("_")):
        TorchBackend(device="cpu", unsupported_ops={op})


# ---------------------------------------------------------------------- bad input


def test_op_missing_on_device_and_cpu_is_a_backend_error_naming_it(smollm2_path: Path) -> None:
    caps = DeviceCaps("cpu", torch.float32, unsupported=frozenset({ATTENTION}), cpu_unsupported=frozenset({ATTENTION}))
    with TorchBackend(smollm2_path, device="cpu", n_ctx=64, unsupported_ops=caps) as broken:
        stream = broken.stream(ask(QUESTION, max_tokens=4))
        with pytest.raises(BackendError, match=ATTENTION):
            next(stream)  # fails on the prefill, before the first chunk
        assert broken.fallbacks == {}


def test_op_failing_on_the_cpu_path_is_a_backend_error_naming_it() -> None:
    with CpuFallback(DeviceCaps("cpu", torch.float32, unsupported=frozenset({"add"}))), pytest.raises(
        BackendError, match="'add'.*failed on the CPU"
    ):
        torch.add(torch.ones(2), torch.ones(3))


def test_caps_for_another_device_are_refused() -> None:
    with pytest.raises(ConfigError, match="mps"):
        TorchBackend(device="cpu", unsupported_ops=device_caps("mps", torch.float16))
    with pytest.raises(ConfigError, match="dtype"):
        TorchBackend(device="cpu", dtype="fp64")


def test_chat_cli_answers_with_the_torch_backend(smollm2_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "edgecloud", "chat", "--backend", "torch", "--prompt", QUESTION,
         "--model", str(smollm2_path), "--max-tokens", "8", "--temperature", "0"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "edge/torch" in result.stderr  # the client's footer: target/backend (the router's reason)
