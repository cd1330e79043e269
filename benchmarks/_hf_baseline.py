"""The Hugging Face transformers baseline for the cloud engine benchmark.

:func:`hf_generate_tokens_per_second` loads the same GGUF file our engine serves with
transformers' own GGUF loader (``from_pretrained(dir, gguf_file=name)``, which dequantizes
Q4_K/Q6_K/... through the ``gguf`` package into transformers' Qwen2/Llama model code), and
times ``model.generate`` the way a transformers user would run it: batch 1, greedy, its
default dynamic KV cache, no compilation.

What is measured, exactly:

- ``load_s``: tokenizer plus model ``from_pretrained`` (GGUF parse, dequantization, tokenizer
  conversion from the GGUF vocabulary), wall clock.
- the prompt is the tokenizer's chat template applied to one user message with the generation
  prompt added (the template's default system message included), as our engine does;
  ``prompt_tokens`` is its length.
- one untimed warm-up ``generate`` of the same request, then one timed ``generate`` with
  ``do_sample=False, max_new_tokens=min_new_tokens=new_tokens`` (EOS suppressed, so exactly
  ``new_tokens`` tokens come out).
- ``seconds`` is the wall clock of that whole ``generate`` call: prefill of the prompt, the
  ``new_tokens`` decode steps, and transformers' per-step logits processing.
  ``tokens_per_s = new_tokens / seconds``, so it is end-to-end generation throughput including
  prefill, not pure decode speed (for short prompts the prefill is one forward pass, a few
  percent of the total).
- ``text`` is the decoded output of the timed run, for checking that greedy output matches our
  engine's (with EOS suppressed, text after the point where the model would have stopped is
  forced continuation).

Requires ``transformers`` (and ``accelerate``, which transformers requires for GGUF loading);
``python benchmarks/_hf_baseline.py`` runs it on the default edge model and prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def hf_generate_tokens_per_second(
    gguf_path: Path,
    prompt: str,
    new_tokens: int = 64,
    dtype: str = "float32",
    threads: int | None = None,
) -> dict[str, Any]:
    """Greedy batch-1 generation speed of transformers on ``gguf_path`` (see the module docstring)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if threads is not None:
        torch.set_num_threads(threads)
    gguf_path = Path(gguf_path).resolve()
    folder, name = str(gguf_path.parent), gguf_path.name

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    model.eval()
    load_s = time.perf_counter() - started

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    prompt_tokens = int(inputs["input_ids"].shape[1])
    options = {
        "do_sample": False,
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    }
    with torch.inference_mode():
        model.generate(**inputs, **options)
        started = time.perf_counter()
        output = model.generate(**inputs, **options)
        seconds = time.perf_counter() - started
    generated = output[0, prompt_tokens:]
    assert generated.numel() == new_tokens, (generated.numel(), new_tokens)
    return {
        "tokens_per_s": new_tokens / seconds,
        "new_tokens": new_tokens,
        "seconds": seconds,
        "load_s": load_s,
        "transformers": transformers.__version__,
        "prompt_tokens": prompt_tokens,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "loader": "transformers GGUF (from_pretrained gguf_file=...)",
        "text": tokenizer.decode(generated, skip_special_tokens=False),
    }


def main() -> None:
    from _common import DEFAULT_EDGE_MODEL, bench_lock, model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_EDGE_MODEL, help="catalogue name or .gguf path")
    parser.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    path = model_path(args.model)
    with bench_lock():
        result = hf_generate_tokens_per_second(path, args.prompt, args.new_tokens, args.dtype, args.threads)
    print(json.dumps({"model": str(args.model), "prompt": args.prompt, **result}, indent=2))


if __name__ == "__main__":
    main()
