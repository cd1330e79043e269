"""The examples run as users run them: as scripts, against a real ``edgecloud serve`` process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from faults import ServeProcess

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-example"


@pytest.fixture(scope="module")
def server(smollm2_path: Path) -> Iterator[ServeProcess]:
    with ServeProcess(str(smollm2_path), api_key=KEY) as proc:
        yield proc


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_app_quickstart(server: ServeProcess, smollm2_path: Path) -> None:
    result = _run(["examples/app_quickstart.py", "--edge-model", str(smollm2_path), "--cloud-url", server.url,
                   "--cloud-model", smollm2_path.stem, "--cloud-key", KEY, "--max-tokens", "16", "Say hello."])
    assert result.stdout.strip()
    assert re.search(r"\[ran on (edge|cloud)/\w+", result.stderr)
    assert "[private question answered on the edge" in result.stderr
    assert "[cost $" in result.stderr


def test_async_app(server: ServeProcess, smollm2_path: Path) -> None:
    result = _run(["examples/async_app.py", "--edge-model", str(smollm2_path), "--cloud-url", server.url,
                   "--cloud-model", smollm2_path.stem, "--cloud-key", KEY, "--max-tokens", "12"])
    lines = [line for line in result.stdout.splitlines() if "->" in line]
    assert len(lines) == 3 and all(re.search(r"\[(edge|cloud): ", line) for line in lines)
    assert "'requests': 4" in result.stderr


def test_self_host_python_block(server: ServeProcess, smollm2_path: Path, tmp_path: Path) -> None:
    text = (ROOT / "examples" / "self_host.md").read_text(encoding="utf-8")
    block = re.findall(r"```python\n(.*?)```", text, re.DOTALL)[0]
    script = tmp_path / "self_host.py"
    script.write_text(block, encoding="utf-8")
    env = {"EDGECLOUD_CLOUD_BASE_URL": server.url, "EDGECLOUD_CLOUD_MODEL": smollm2_path.stem,
           "EDGECLOUD_CLOUD_API_KEY": KEY, "EDGECLOUD_EDGE_MODEL": str(smollm2_path)}
    result = _run([str(script)], env)
    routes = [line.split()[0] for line in result.stdout.splitlines()[:2]]
    assert len(routes) == 2 and set(routes) <= {"edge", "cloud"}
    assert "'requests': 2" in result.stdout
