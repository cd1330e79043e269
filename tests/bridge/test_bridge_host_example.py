"""examples/bridge_host.py drives a real ``edgecloud bridge --stdio`` process on the real edge model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

ROOT = Path(__file__).resolve().parents[2]


def test_bridge_host_example_streams_cancels_survives_bad_input_and_exits(smollm2_path: Path) -> None:
    result = subprocess.run([sys.executable, "examples/bridge_host.py", "--model", str(smollm2_path)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "chat.delta notifications add up to the result text" in out
    assert "the chat answered -32800" in out and "it stopped early" in out
    for code in ("-32700", "-32600", "-32601", "-32602"):
        assert f"-> {code}" in out
    assert "a notification got no reply" in out and "request line is longer than" in out
    assert "smollm2-135m-instruct-q4 (installed)" in out
    assert "the bridge exited 0" in out and out.rstrip().endswith("all as expected")
