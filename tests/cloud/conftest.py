"""Fixtures of the cloud tests: SmolLM2 on the torch engine (fp32, oneDNN-packed layers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Iterator[tuple[Any, Any]]:
    """``(Transformer, Tokenizer)`` for SmolLM2, one per test module."""
    pytest.importorskip("torch")
    pytest.importorskip("llama_cpp")
    from edgecloud.cloud.engine import Tokenizer, Transformer, pack_linears

    model = Transformer.from_gguf(smollm2_path)
    pack_linears(model)
    tokenizer = Tokenizer(smollm2_path)
    yield model, tokenizer
    tokenizer.close()
