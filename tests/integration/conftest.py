"""Shared by the integration tests: a real ``edgecloud serve`` (llama.cpp, SmolLM2) on loopback."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture()
def litellm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The ``litellm`` module, offline, with the event loop it leaves behind closed afterwards.

    litellm's service logger makes the calling thread an event loop of its own
    (``asyncio.get_event_loop()``) and never closes it; closed here, its sockets do not reach
    the garbage collector open.
    """
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its cost map from the internet
    module = pytest.importorskip("litellm")
    yield module
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: no loop set is deprecated, and fine here
        try:
            loop = asyncio.get_event_loop_policy().get_event_loop()
        except RuntimeError:  # none set (litellm then ran its hooks with asyncio.run, which closes its loop)
            return
    loop.close()
    asyncio.set_event_loop(None)
