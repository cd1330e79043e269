"""Shared by the integration tests: a real ``edgecloud serve`` (llama.cpp, SmolLM2) on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from faults import ServeProcess

#: The API key every integration server is started with.
KEY = "sk-test"


@pytest.fixture(scope="module")
def server(smollm2_path: Path) -> Iterator[ServeProcess]:
    """``edgecloud serve`` on SmolLM2 for this module's tests (the name it serves: the file's)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("fastapi")
    with ServeProcess(str(smollm2_path), api_key=KEY) as proc:
        yield proc
