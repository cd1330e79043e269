"""The torch engine against llama.cpp on real GGUF files: same tokens, same greedy text, a KV cache that is exact."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
llama_cpp = pytest.importorskip("llama_cpp")

from edgecloud.engine import Tokenizer, Transformer, generate
from edgecloud.errors import ContextOverflowError

N_NEW = 24
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> tuple[Transformer, Tokenizer]:
    return Transformer.from_gguf(smollm2_path), Tokenizer(smollm2_path)


def _llama_cpp_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by llama.cpp itself (argmax of its logits, temperature 0)."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    try:
        llm.eval(prompt)
        out: list[int] = []
        for _ in range(n):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([out[-1]])
        return out
    finally:
        llm.close()


def _check_parity(path: Path, model: Transformer, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode_chat(CHAT)
    start = time.perf_counter()
    ours = list(generate(model, tokenizer, prompt, N_NEW, stop_at_eog=False))
    elapsed = time.perf_counter() - start
    reference = _llama_cpp_greedy(path, prompt, N_NEW)
    # Teacher-forced: our top-1 at every position of llama.cpp's own continuation.
    cache = model.new_cache(len(prompt) + N_NEW)
    with torch.inference_mode():
        logits = model(torch.tensor(prompt + reference), None, cache)
    top1 = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    print(
        f"\n{path.name}: load {model.load_seconds:.1f} s, prefill+{N_NEW} tokens {elapsed:.2f} s "
        f"({N_NEW / elapsed:.1f} tok/s), text {tokenizer.decode(ours)!r}"
    )
    # llama.cpp multiplies against q8-quantized activations and keeps an f16 KV cache, and its
    # rounding depends on the SIMD path it was built for, so exact greedy equality is not a fair
    # test across builds (it held on one machine and failed on an AVX-512 build without AMX).
    # What must hold: teacher-forced, our top-1 is llama.cpp's token almost everywhere, and
    # where it is not, the two were near-tied in our logits (a rounding-level difference).
    steps = logits[len(prompt) - 1 : -1]
    margins = (steps.max(-1).values - steps[torch.arange(N_NEW), torch.tensor(reference)]).tolist()
    agreement = sum(a == b for a, b in zip(top1, reference)) / N_NEW
    print(f"top-1 agreement {agreement:.3f}, largest margin {max(margins):.3f}, first greedy tokens equal: "
          f"{ours[:8] == reference[:8]}")
    assert agreement >= 0.85, (agreement, margins)
    assert max(margins) < 0.5, margins
    assert ours[:4] == reference[:4]


def test_greedy_matches_llama_cpp_smollm2(smollm2_path: Path, smollm2: tuple[Transformer, Tokenizer]) -> None:
    _check_parity(smollm2_path, *smollm2)


@pytest.mark.slow
def test_greedy_matches_llama_cpp_qwen05(qwen05_path: Path) -> None:
    model, tokenizer = Transformer.from_gguf(qwen05_path), Tokenizer(qwen05_path)
    assert model.args.arch == "qwen2" and model.args.rope_style == "neox" and model.args.attn_bias
    _check_parity(qwen05_path, model, tokenizer)


def _tokens(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": "Count from one to ten in French, please."}])


def test_incremental_decode_equals_full_forward(smollm2: tuple[Transformer, Tokenizer]) -> None:
    model, tokenizer = smollm2
    seq = _tokens(tokenizer)
    n_prompt = len(seq) - 6
    cache = model.new_cache(len(seq))
    with torch.inference_mode():
        steps = [model(torch.tensor(seq[:n_prompt]), None, cache)]
        for token in seq[n_prompt:]:
            steps.append(model(torch.tensor([token]), None, cache))
        incremental = torch.cat(steps)
        full = model(torch.tensor(seq), None, model.new_cache(len(seq)))
    assert cache.length == len(seq)
    torch.testing.assert_close(incremental, full, rtol=1e-4, atol=1e-4)


def test_scoring_k_plus_one_positions_equals_single_steps(smollm2: tuple[Transformer, Tokenizer]) -> None:
    model, tokenizer = smollm2
    seq = _tokens(tokenizer)
    k = 4
    prefix, draft = seq[: -(k + 1)], seq[-(k + 1) :]
    cache = model.new_cache(len(seq) + 8)
    with torch.inference_mode():
        model(torch.tensor(prefix), None, cache)
        at_once = model(torch.tensor(draft), None, cache)
        # Reject the draft, then walk the same positions one token at a time.
        cache.truncate(len(prefix))
        one_by_one = torch.cat([model(torch.tensor([t]), None, cache) for t in draft])
        # The same positions also score identically inside a batch with another sequence.
        cache.truncate(len(prefix))
        other = model.new_cache(32)
        batched = model.forward_batch(
            [(torch.tensor(draft), torch.arange(len(prefix), len(seq)), cache), (torch.tensor(seq[:7]), None, other)]
        )[0]
    torch.testing.assert_close(at_once, one_by_one, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batched, at_once, rtol=1e-4, atol=1e-4)
    assert other.length == 7


def test_cache_overflow_is_a_context_error(smollm2: tuple[Transformer, Tokenizer]) -> None:
    model, _ = smollm2
    cache = model.new_cache(4)
    with pytest.raises(ContextOverflowError), torch.inference_mode():
        model(torch.arange(5), None, cache)


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n\treturn {'a': [1, 2]}  # ok\n",
        "emoji 🙂🚀 and CJK 你好，世界 and Ünïcödé",
        "<|im_start|>user\nhi<|im_end|>",
    ],
)
def test_tokenizer_round_trips(smollm2: tuple[Transformer, Tokenizer], text: str) -> None:
    _, tokenizer = smollm2
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids).decode("utf-8") == text


def test_tokenizer_special_tokens(smollm2: tuple[Transformer, Tokenizer]) -> None:
    _, tokenizer = smollm2
    im_end = tokenizer.encode("<|im_end|>")
    assert len(im_end) == 1 and tokenizer.is_eog(im_end[0])
    assert tokenizer.eos_id in tokenizer.eog_ids
    assert len(tokenizer.encode("<|im_end|>", special=False)) > 1  # parsed as plain text
    assert tokenizer.decode(im_end, special=False) == b""
    # Chat prompts are the template rendered like llama.cpp's formatter, then tokenized with specials.
    rendered = tokenizer.chat_template.render(CHAT)
    assert tokenizer.encode_chat(CHAT) == tokenizer.encode(rendered)
    assert rendered.endswith("<|im_start|>assistant\n")
