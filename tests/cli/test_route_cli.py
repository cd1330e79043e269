"""``edgecloud route score`` / ``eval`` / ``train`` through the real CLI entry point."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path


def _cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edgecloud", "route", *args], input=stdin, capture_output=True,
                          text=True, timeout=120, check=False)


def test_score_writes_one_line_per_request_and_survives_bad_lines() -> None:
    lines = [
        json.dumps({"id": "easy", "prompt": "Add two numbers"}),
        "not json at all",
        json.dumps({"id": "med", "messages": [{"role": "user", "content":
                    "Exactly what dose of this medication treats an infection in a patient?"}]}),
        json.dumps({"id": "junk", "prompt": "\x00\x01 ☃ 混合 " * 1000}),
        json.dumps({"id": "nothing"}),
    ]
    proc = _cli("score", "--scorer", "rules", stdin="\n".join(lines) + "\n")
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [o["id"] for o in out] == ["easy", 2, "med", "junk", "nothing"]
    assert out[0]["target"] == "edge" and out[0]["score"] == 0.0
    assert "error" in out[1] and "line 2" in out[1]["error"]
    assert out[2]["target"] == "edge_then_cloud" and "reason" in out[2]
    assert 0.0 <= out[3]["score"] <= 1.0
    assert "messages" in out[4]["error"]


def test_train_then_eval_on_outcomes(tmp_path: Path) -> None:
    rng = random.Random(0)
    data = tmp_path / "outcomes.jsonl"
    rows = []
    for i in range(200):
        hard = i % 2 == 0
        text = "Prove the theorem about integral equations step by step" if hard else "Say hello to the user"
        rows.append({"id": f"t{i}", "suite": "synthetic", "max_tokens": 128,
                     "messages": [{"role": "user", "content": f"{text} ({i})"}],
                     "edge_pass": (not hard) if rng.random() < 0.85 else hard, "cloud_pass": rng.random() < 0.9})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = tmp_path / "scorer.json"
    trained = _cli("train", "--data", str(data), "--out", str(model))
    assert trained.returncode == 0, trained.stderr
    assert json.loads(model.read_text())["format"] == "edgecloud.router.logistic/1"
    plot = tmp_path / "curve.png"
    proc = _cli("eval", "--data", str(data), "--model", str(model), "--plot", str(plot), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["scorer"] == "learned" and out["apgr"] > out["random_apgr"] + 0.1
    assert plot.read_bytes()[:4] == b"\x89PNG"
    rules = json.loads(_cli("eval", "--data", str(data), "--scorer", "rules", "--json").stdout)
    assert rules["scorer"] == "rules" and 0 <= rules["apgr"] <= 1
