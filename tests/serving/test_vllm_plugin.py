"""edgecloud's vLLM plugin without vLLM: how it loads, and its token sessions.

What it does inside vLLM (checks from the prefix cache, sessions, the answer's shape) is tested
against real vLLM in ``tests/integration/test_vllm_real.py``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from edgecloud.serving.vllm import PLUGIN_DIR


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    module = importlib.import_module("edgecloud_vllm_plugin")
    yield importlib.reload(module)  # a fresh copy: register() runs once per process
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__module__ != "edgecloud_vllm_plugin"]
    sys.modules.pop("edgecloud_vllm_plugin", None)


def test_a_patch_applies_when_vllm_imports_its_module(plugin: ModuleType, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin imports nothing of vLLM's early: each patch runs right after vLLM imports the
    module it patches (here a stand-in module), or at once where it is imported already."""
    (tmp_path / "late_module.py").write_text("VALUE = 1\n")
    (tmp_path / "early_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import early_module  # type: ignore[import-not-found]

    seen: list[str] = []

    def patch(module: ModuleType) -> None:
        module.VALUE = 2
        seen.append(module.__name__)

    monkeypatch.setattr(plugin, "PATCHES", {"late_module": patch, "early_module": patch})
    plugin.register()
    assert early_module.VALUE == 2 and seen == ["early_module"]
    assert "late_module" not in sys.modules
    import late_module  # type: ignore[import-not-found]

    assert late_module.VALUE == 2 and seen == ["early_module", "late_module"]
    plugin.register()  # vLLM may call it again in the same process: nothing is patched twice
    assert seen == ["early_module", "late_module"]
    for name in ("late_module", "early_module"):
        sys.modules.pop(name, None)


def test_a_patch_that_does_not_fit_leaves_the_module_as_vllm_wrote_it(
        plugin: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "other_vllm.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def patch(module: ModuleType) -> None:
        module.Missing.method = None  # type: ignore[attr-defined]  # as a renamed class in another vLLM

    monkeypatch.setattr(plugin, "PATCHES", {"other_vllm": patch})
    plugin.register()
    import other_vllm  # type: ignore[import-not-found]

    assert other_vllm.VALUE == 1
    assert any("other_vllm" in r.getMessage() and "prefix cache" in r.getMessage() for r in caplog.records)
    sys.modules.pop("other_vllm", None)


def test_sessions_hold_the_latest_tokens_least_recently_used_out(plugin: ModuleType) -> None:
    now = [0.0]
    sessions = plugin.Sessions(max_sessions=2, ttl_s=10, clock=lambda: now[0])
    sessions.hold("a", [1, 2, 3])
    sessions.hold("b", [4])
    sessions.hold("a", [1, 2, 3, 5])
    sessions.hold("c", [6])  # "b" was used least recently
    assert sessions.held("a") == [1, 2, 3, 5] and sessions.held("b") is None and sessions.held("c") == [6]
    now[0] = 11.0
    assert sessions.held("a") is None and sessions.held("c") is None
