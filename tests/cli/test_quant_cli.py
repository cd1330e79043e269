"""`edgecloud quant compare` on the tiny real model: the JSON it prints, the config it writes, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from edgecloud.quant import load_quant_config


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edgecloud", "quant", "compare", *args], capture_output=True,
                          text=True, timeout=900, cwd=cwd)


def test_compare_prints_the_metrics_and_writes_a_config(smollm2_path: Path, tmp_path: Path) -> None:
    data = tmp_path / "sample.jsonl"
    data.write_text(json.dumps({"name": "prose", "text": "The quick brown fox jumps over the lazy dog. " * 20}) + "\n"
                    + json.dumps({"name": "code", "text": "def add(a, b):\n    return a + b\n" * 20}) + "\n")
    config = tmp_path / "q.json"
    result = _run("--model", str(smollm2_path), "--data", str(data), "--tokens", "96", "--calibration-tokens", "32",
                  "--max-drift", "0.5", "--min-top1", "0.5", "--save-config", str(config), "--json", cwd=tmp_path)
    assert result.returncode in (0, 1), result.stderr
    out = json.loads(result.stdout)
    assert set(out) >= {"top1_agreement", "nll_delta_pct", "kl_mean", "layers", "protected", "meets_targets"}
    assert 0.0 <= out["top1_agreement"] <= 1.0 and out["kl_mean"] >= 0.0
    assert out["texts"] == {"prose": out["texts"]["prose"], "code": out["texts"]["code"]}
    assert out["layers"] and all({"name", "kl", "protected"} <= set(layer) for layer in out["layers"])
    assert result.returncode == (0 if out["meets_targets"] else 1)
    saved = load_quant_config(config)
    assert saved.keep_high_precision == out["protected"] and saved.model == smollm2_path.name


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--max-drift", "0"], "--max-drift"), (["--protect", "some"], "--protect"), (["--min-top1", "1.5"], "--min-top1")],
)
def test_bad_arguments_are_usage_errors(smollm2_path: Path, tmp_path: Path, args: list[str], message: str) -> None:
    result = _run("--model", str(smollm2_path), *args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr


def test_malformed_data_line_is_named(smollm2_path: Path, tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "ok"}\n{not json\n')
    result = _run("--model", str(smollm2_path), "--data", str(data), cwd=tmp_path)
    assert result.returncode == 2 and "bad.jsonl:2" in result.stderr
