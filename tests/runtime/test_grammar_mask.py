"""llama.cpp's grammar engine over logits from anywhere: the fast greedy choice (the best token,
then the best candidates, then the whole vocabulary) is exactly the argmax of the masked row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from edgecloud.runtime.grammar_mask import GrammarMask
from edgecloud.runtime.sampling import SamplingParams
from edgecloud.runtime.structured import schema_grammar

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": False}


@pytest.mark.parametrize("spread", [0.5, 4.0, 40.0])
def test_fast_greedy_is_the_masked_argmax(smollm2_path: Path, spread: float) -> None:
    llm = llama_cpp.Llama(model_path=str(smollm2_path), vocab_only=True, verbose=False)
    vocab, n_vocab = llm._model.vocab, llm.n_vocab()
    params = SamplingParams(64, temperature=0.0, grammar=schema_grammar(SCHEMA, param="response_format"))
    fast, reference = (GrammarMask(llama_cpp, vocab, n_vocab, params) for _ in range(2))
    rng = np.random.default_rng(int(spread * 10))
    paths = {"first": 0, "candidates": 0, "vocabulary": 0}
    try:
        for step in range(60):
            logits = (rng.standard_normal(n_vocab) * spread).astype(np.float32)
            allowed = reference.mask(logits)
            ok = np.flatnonzero(np.isfinite(allowed))
            if not len(ok):
                break  # the grammar is complete
            if step % 2:  # an allowed token planted among the best few, below a refused one
                order = np.argsort(-logits)
                planted = rng.choice(ok)
                logits[planted] = logits[order[int(rng.integers(1, 40))]] + 1e-3
                logits[order[0]] += 1.0
                allowed = reference.mask(logits)
            want = int(allowed.argmax())
            rank = int((logits > logits[want]).sum())
            paths["first" if rank == 0 else "candidates" if rank < 64 else "vocabulary"] += 1
            assert fast.greedy(logits) == want
            reference.accept(want)
    finally:
        fast.close()
        reference.close()
        llm.close()
    assert paths["candidates"] > 5 and paths["vocabulary"] > 5, paths  # every path was taken
