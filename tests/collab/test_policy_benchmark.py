"""A slice of the hybrid-policy benchmark (benchmarks/hybrid_policy.py) as CI runs it: two corpus
tasks answered through the public client in checked mode, graded and costed against the committed
all-cloud labels; and the committed report agrees with the client's defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from edgecloud.config import CollabSettings, Prices
from bench_scripts import BENCH, load


@pytest.fixture(scope="module")
def policy_module() -> ModuleType:
    return load("hybrid_policy")


def test_a_run_answers_grades_and_costs_each_task_and_resumes(tmp_path: Path, qwen05_path: Path,
                                                              policy_module) -> None:  # type: ignore[no-untyped-def]
    cmd = [sys.executable, str(BENCH / "hybrid_policy.py"), "run", "--name", "slice", "--mode", "checked",
           "--trust", "0.7", "--per-family", "1", "--families", "math,facts", "--ctx", "2048",
           "--edge-model", str(qwen05_path), "--cloud-model", str(qwen05_path), "--out-dir", str(tmp_path)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "slice.jsonl").read_text().splitlines()]
    assert sorted(r["family"] for r in rows) == ["facts", "math"]
    for row in rows:
        assert isinstance(row["pass"], bool) and row["answer_tokens"] > 0
        assert row["cost"]["cloud_calls"] == row["cloud_calls"]
        # a check is a forward pass of the cloud; the answer all-cloud needs its prompt and a step per token
        assert row["cost"]["cloud_passes"] >= row["cloud_calls"] and row["cost"]["all_cloud_passes"] > 0
    summary = policy_module.summarise(rows, policy_module.labels(), Prices())
    assert summary["tasks"] == 2 and 0 <= summary["cost_vs_all_cloud_pooled"]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and len((tmp_path / "slice.jsonl").read_text().splitlines()) == 2


def test_the_committed_report_chose_the_clients_default() -> None:
    """What ``collab="auto"`` runs is the mode the committed report chose on the development corpus
    (and, for checked mode, at the trust it measured), on enough tasks that one moves it < 1 %."""
    from edgecloud.collab import AUTO_MODE

    report = json.loads((BENCH / "results" / "hybrid_policy.json").read_text())
    chosen = report["default_choice"]["in_suite_choice"]
    config = json.loads((BENCH / "results" / "corpus" / "runs" / f"{chosen}.jsonl")
                        .read_text().splitlines()[0])["config"]
    assert config["mode"] == AUTO_MODE
    if AUTO_MODE == "checked":
        assert CollabSettings().trust == pytest.approx(config["trust"])
    assert set(report["default_choice"]["choices_held_out"].values()) <= {chosen} | set(report["runs"])
    assert report["default_choice"]["held_out"]["tasks"] >= 100
