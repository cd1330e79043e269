"""Shared fixtures: real model files from the store's cache (pulled once, then reused)."""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgecloud.store import resolve_model

# The test machine has no route to model hubs: fail hub lookups at once instead of after
# huggingface_hub's connection retries (it is importable once transformers is installed).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Clients built by tests keep their saved KV states (the disk tier) in a folder of this run, not
# in the user's cache, and start every run without states from the last one.
os.environ.setdefault("EDGECLOUD_CACHE__DIR", tempfile.mkdtemp(prefix="edgecloud-test-kv-"))

SMOLLM2 = "smollm2-135m-instruct-q4"
QWEN05 = "qwen2.5-coder-0.5b-instruct-q4"


@pytest.fixture(scope="module", autouse=True)
def _collect_garbage_per_module() -> Iterator[None]:
    """Collect garbage as each module ends, so a client or socket a module left open fails that
    module (warnings are errors), not whichever later test the collector happens to run in."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M Q4_1: the fast real model for tests where the model does not matter."""
    return resolve_model(SMOLLM2, pull=True, progress=False)


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    """Qwen2.5-Coder-0.5B Q4_K_M as published (the default edge model is made from it)."""
    return resolve_model(QWEN05, pull=True, progress=False)


@pytest.fixture(scope="session")
def smollm2_onnx(smollm2_path: Path) -> Path:
    """SmolLM2-135M exported by ``edgecloud export onnx`` (INT4, block 32): built once, then reused
    from ``~/.cache/edgecloud/test-exports/`` while the GGUF file and the options are unchanged."""
    pytest.importorskip("onnxruntime_genai")
    from edgecloud.quant.export_onnx import cached_export
    from edgecloud.store.cache import home_dir

    return cached_export(smollm2_path, home_dir() / "test-exports")


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Iterator[tuple[Any, Any]]:
    """``(Transformer, Tokenizer)``: SmolLM2 on the torch engine (fp32, oneDNN-packed), one per test module."""
    pytest.importorskip("torch")
    pytest.importorskip("llama_cpp")
    from edgecloud.engine import Tokenizer, Transformer, pack_linears

    model = Transformer.from_gguf(smollm2_path)
    pack_linears(model)
    tokenizer = Tokenizer(smollm2_path)
    yield model, tokenizer
    tokenizer.close()


@pytest.fixture()
def edgecloud_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty EDGECLOUD_HOME for tests that exercise the cache itself."""
    home = tmp_path / "edgecloud-home"
    monkeypatch.setenv("EDGECLOUD_HOME", str(home))
    return home


def pytest_report_header(config: pytest.Config) -> str:
    return f"EDGECLOUD_HOME={os.environ.get('EDGECLOUD_HOME', '(platform cache)')}"
