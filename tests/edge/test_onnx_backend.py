"""The ONNX Runtime edge backend on the INT4 export of SmolLM2-135M (built once per cache, see conftest).

What is specific to this backend (the shared streaming / stop / cancel contract is in
``test_backend_contract.py``): prompts and tokens identical to llama.cpp's for the same GGUF,
llama.cpp's end-of-generation ids, prefix reuse that does not change the answer, logprobs,
the context limit, the memory plan, ``edgecloud chat --backend onnx``, and the folder errors.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime_genai")

from edgecloud.edge.memory import plan_onnx
from edgecloud.edge.onnx import EXPORT_FILE, GENAI_CONFIG, OnnxBackend, load_manifest
from edgecloud.errors import ContextOverflowError, ModelIntegrityError, ModelNotFoundError
from edgecloud.types import ChatRequest

N_CTX = 512
EDGECLOUD = [sys.executable, "-m", "edgecloud"]
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Héllo — ça va? 🙂 日本語"},
    {"role": "assistant", "content": "Oui."},
    {"role": "user", "content": "Write a Python function that reverses a string."},
]


@pytest.fixture(scope="module")
def backend(smollm2_onnx: Path) -> Iterator[OnnxBackend]:
    b = OnnxBackend(smollm2_onnx, n_ctx=N_CTX, n_threads=1)
    b.load()
    yield b
    b.close()


@pytest.fixture(scope="module")
def llama(smollm2_path: Path) -> Iterator[object]:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(smollm2_path), vocab_only=True, verbose=False)
    yield llm
    llm.close()


def ask(text: str, **fields: object) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": text}], **fields)


def test_prompt_tokens_match_the_llama_cpp_backend(backend: OnnxBackend, smollm2_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(smollm2_path, n_ctx=N_CTX, n_threads=1, reuse_prefix=False) as reference:
        for messages in (CONVERSATION, CONVERSATION[1:2], CONVERSATION[3:]):
            assert backend.tokenize_chat(messages) == reference.tokenize_chat(messages)


def test_every_token_renders_the_bytes_llama_cpp_renders(backend: OnnxBackend, llama: object) -> None:
    from edgecloud.runtime.llama_cpp import token_piece

    import llama_cpp

    vocab = llama._model.vocab  # type: ignore[attr-defined]
    pieces = backend._vocab.pieces  # type: ignore[union-attr]
    n_vocab = llama.n_vocab()  # type: ignore[attr-defined]
    assert len(pieces) >= n_vocab
    mismatched = [t for t in range(n_vocab) if pieces[t] != token_piece(llama_cpp, vocab, t)]
    assert mismatched == []


def test_generation_ends_at_llama_cpp_end_of_generation_ids(backend: OnnxBackend, llama: object) -> None:
    import llama_cpp

    vocab = llama._model.vocab  # type: ignore[attr-defined]
    expected = [t for t in range(llama.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]  # type: ignore[attr-defined]
    assert backend.manifest is not None and backend.manifest.eog_token_ids == expected
    completion = backend.complete(ask("Say hi.", temperature=0, max_tokens=200))
    assert completion.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in completion.text


def test_reused_prefix_gives_the_same_greedy_answer(smollm2_onnx: Path) -> None:
    request = ChatRequest(messages=CONVERSATION, temperature=0, max_tokens=24)
    with OnnxBackend(smollm2_onnx, n_ctx=N_CTX, n_threads=1, reuse_prefix=False) as fresh:
        expected = [fresh.complete(request).text for _ in range(2)]
    with OnnxBackend(smollm2_onnx, n_ctx=N_CTX, n_threads=1) as reusing:
        first, second = reusing.complete(request), reusing.complete(request)
    assert expected[0] == expected[1] == first.text == second.text
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == second.usage.prompt_tokens - 1


def test_next_turn_reuses_the_conversation(backend: OnnxBackend) -> None:
    turn1 = [{"role": "user", "content": "Name three fruits."}]
    first = backend.complete(ChatRequest(messages=turn1, temperature=0, max_tokens=16))
    turn2 = [*turn1, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Which is sweetest?"}]
    second = backend.complete(ChatRequest(messages=turn2, temperature=0, max_tokens=8))
    assert second.usage.cached_tokens >= first.usage.prompt_tokens
    assert second.text


def test_logprobs_one_per_token_with_sorted_alternatives(backend: OnnxBackend) -> None:
    completion = backend.complete(ask("What is the capital of France?", temperature=0, max_tokens=12,
                                      logprobs=True, top_logprobs=3))
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens > 0
    for entry in content:
        alts = [t.logprob for t in entry.top_logprobs]
        assert entry.logprob <= 0.0 and len(alts) == 3 and alts == sorted(alts, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the best one


def test_frequency_penalty_reduces_repetition(backend: OnnxBackend) -> None:
    prompt = "Write 'cat cat cat cat cat cat' and keep repeating the word cat."

    def most_repeated(text: str) -> int:
        return max(Counter(text.lower().split()).values())

    plain = backend.complete(ask(prompt, temperature=0, max_tokens=40)).text
    penalised = backend.complete(ask(prompt, temperature=0, max_tokens=40, frequency_penalty=2.0)).text
    assert most_repeated(penalised) < most_repeated(plain)


def test_prompt_longer_than_the_context_fails_before_running(backend: OnnxBackend) -> None:
    before = backend.stats.prompt_tokens
    with pytest.raises(ContextOverflowError) as info:
        backend.complete(ask("word " * 2000, max_tokens=8))
    assert info.value.context_tokens == N_CTX
    assert backend.stats.prompt_tokens == before
    assert backend.complete(ask("Say hi.", temperature=0, max_tokens=4)).text


def test_memory_plan_sizes_the_cache(smollm2_onnx: Path) -> None:
    plan = plan_onnx(smollm2_onnx, ctx=4096)
    assert plan.fits and plan.n_ctx == 4096 and plan.kv_cache_type == "f32"
    # SmolLM2: 30 layers x 3 KV heads x 64 dims x (K + V) x float32
    assert plan.kv_bytes == 30 * 4096 * 3 * 64 * 2 * 4
    weights = (smollm2_onnx / "model.onnx.data").stat().st_size
    assert weights < plan.weights_bytes < 2 * weights
    assert plan.total_bytes == plan.weights_bytes + plan.kv_bytes + plan.compute_bytes + plan.overhead_bytes
    small = plan_onnx(smollm2_onnx, "phone-8gb")
    assert small.fits and small.n_ctx == 8192  # the model's own limit
    with OnnxBackend(smollm2_onnx, n_threads=1) as planned:
        planned.load()
        assert planned.n_ctx == plan_onnx(smollm2_onnx).n_ctx


def test_plan_cli_plans_an_export_folder_for_onnx_runtime(smollm2_onnx: Path) -> None:
    from typer.testing import CliRunner

    from edgecloud.cli import app

    # a fixed profile: "this" budgets from the memory free at the moment, which moves between calls
    args = ["plan", "--model", str(smollm2_onnx), "--device", "laptop-16gb", "--ctx", "2048", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data.pop("cpu")["threads"] >= 1  # this machine's compute threads, beside the plan
    assert data == plan_onnx(smollm2_onnx, "laptop-16gb", ctx=2048).to_dict()
    assert data["kv_cache_type"] == "f32" and data["n_ctx"] == 2048
    forced = CliRunner().invoke(app, ["plan", "--model", str(smollm2_onnx), "--kv-cache-type", "q8_0"])
    assert forced.exit_code == 2 and "--kv-cache-type" in forced.output


def test_a_folder_without_genai_config_is_model_not_found(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"not a model")
    with pytest.raises(ModelNotFoundError, match=GENAI_CONFIG):
        OnnxBackend(tmp_path).load()
    with pytest.raises(ModelNotFoundError, match="edgecloud export onnx"):
        load_manifest(tmp_path / "missing")


def test_a_folder_not_built_by_edgecloud_is_model_not_found(smollm2_onnx: Path, tmp_path: Path) -> None:
    (tmp_path / GENAI_CONFIG).write_text((smollm2_onnx / GENAI_CONFIG).read_text())
    with pytest.raises(ModelNotFoundError, match=EXPORT_FILE):
        load_manifest(tmp_path)
    (tmp_path / EXPORT_FILE).write_text(json.dumps({"model": "x"}))
    with pytest.raises(ModelIntegrityError, match=EXPORT_FILE):
        load_manifest(tmp_path)


def test_chat_cli_answers_from_an_export_without_the_gguf(smollm2_onnx: Path, tmp_path: Path) -> None:
    folder = tmp_path / "export"
    shutil.copytree(smollm2_onnx, folder)
    manifest = json.loads((folder / EXPORT_FILE).read_text())
    manifest["source_path"] = str(tmp_path / "gone.gguf")  # the GGUF is not needed to chat
    (folder / EXPORT_FILE).write_text(json.dumps(manifest))
    result = subprocess.run(
        [*EDGECLOUD, "chat", "--backend", "onnx", "--model", str(folder), "--prompt", "Say hello.",
         "--max-tokens", "12", "--temperature", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "edge/onnx" in result.stderr


def test_chat_cli_on_a_folder_that_is_not_an_export_is_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [*EDGECLOUD, "chat", "--backend", "onnx", "--model", str(tmp_path), "--prompt", "hi"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert GENAI_CONFIG in result.stderr and "Traceback" not in result.stderr


def test_client_with_edge_runtime_onnx_answers_through_the_router(smollm2_onnx: Path, tmp_path: Path) -> None:
    from edgecloud import EdgeCloud

    direct = OnnxBackend(smollm2_onnx, n_ctx=N_CTX, n_threads=1)
    request = ChatRequest(messages=CONVERSATION[-1:], max_tokens=12, temperature=0.0)
    with direct:
        expected = "".join(c.choices[0].delta.content or "" for c in direct.stream(request) if c.choices)
    with EdgeCloud(edge_model=str(smollm2_onnx), edge_runtime="onnx", n_ctx=N_CTX) as client:
        assert isinstance(client.edge, OnnxBackend)
        answer = client.chat.completions.create(messages=CONVERSATION[-1:], max_tokens=12, temperature=0.0)
    assert answer.choices[0].message.content == expected
    assert answer.route is not None and answer.route.target == "edge"
    with pytest.raises(ModelNotFoundError, match=GENAI_CONFIG):
        EdgeCloud(edge_model=str(tmp_path), edge_runtime="onnx").edge
