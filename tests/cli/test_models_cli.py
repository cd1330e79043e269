"""`edgecloud models ...` through the real console entry point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EDGECLOUD = [sys.executable, "-m", "edgecloud"]


def run(*args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if home is not None:
        env["EDGECLOUD_HOME"] = str(home)
    return subprocess.run([*EDGECLOUD, *args], capture_output=True, text=True, env=env, timeout=300)


def test_list_json_has_every_catalogue_model(smollm2_path: Path) -> None:
    result = run("models", "list", "--json")
    assert result.returncode == 0, result.stderr
    models = {m["name"]: m for m in json.loads(result.stdout)["models"]}
    assert {"smollm2-135m-instruct-q4", "qwen2.5-coder-0.5b-instruct-q4", "qwen2.5-coder-1.5b-instruct-q4"} <= set(models)
    assert models["smollm2-135m-instruct-q4"]["pulled"] is True
    assert sum(1 for m in models.values() if m["source"] == "hub") >= 3


def test_list_table_is_human_readable() -> None:
    result = run("models", "list")
    assert result.returncode == 0
    assert "qwen2.5-coder-0.5b-instruct-q4" in result.stdout


def test_path_prints_verified_file(smollm2_path: Path) -> None:
    result = run("models", "path", "smollm2-135m-instruct-q4")
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == smollm2_path


def test_path_of_unpulled_model_says_how_to_pull(tmp_path: Path) -> None:
    result = run("models", "path", "smollm2-135m-instruct-q4", home=tmp_path)
    assert result.returncode == 2
    assert "edgecloud models pull smollm2-135m-instruct-q4" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_model_is_a_clear_error() -> None:
    result = run("models", "pull", "no-such-model")
    assert result.returncode == 2
    assert "known models" in result.stderr and "smollm2-135m-instruct-q4" in result.stderr
    assert "Traceback" not in result.stderr


def test_pull_then_pull_again_is_a_noop(tmp_path: Path, smollm2_path: Path) -> None:
    (tmp_path / "models").mkdir()
    shutil.copyfile(smollm2_path, tmp_path / "models" / "smollm2-135m-instruct-q4.gguf")
    first = run("models", "pull", "smollm2-135m-instruct-q4", "-q", home=tmp_path)
    assert first.returncode == 0, first.stderr
    stamp = (tmp_path / "models" / "smollm2-135m-instruct-q4.gguf").stat().st_mtime_ns
    second = run("models", "pull", "smollm2-135m-instruct-q4", "-q", home=tmp_path)
    assert second.returncode == 0
    assert second.stdout == first.stdout
    assert (tmp_path / "models" / "smollm2-135m-instruct-q4.gguf").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("argv", [["--help"], ["models", "--help"]])
def test_help(argv: list[str]) -> None:
    result = run(*argv)
    assert result.returncode == 0
    assert "Usage" in result.stdout
