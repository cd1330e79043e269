"""A slice of the function-calling benchmark (benchmarks/function_calling.py) as CI runs it: the
corpus, the exact grading, one task of each family answered by every policy through the public
client, and the committed report's held-out choice agrees with what the defaults do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from bench_scripts import BENCH, load


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load("function_calling")


def test_the_corpus_is_the_committed_one_and_big_enough(bench) -> None:  # type: ignore[no-untyped-def]
    corpus = bench.tasks()
    assert corpus == json.loads((BENCH / "data" / "function_calling.json").read_text())
    families: dict[str, int] = {}
    for task in corpus:
        families[task["family"]] = families.get(task["family"], 0) + 1
    tools = {f: n for f, n in families.items() if f != "json_extract"}
    assert len(tools) >= 4 and sum(tools.values()) >= 150 and families["json_extract"] >= 50
    assert len({t["id"] for t in corpus}) == len(corpus)
    for task in corpus:  # every value an exact answer needs is in the prompt
        expected = task["expected"]
        if expected is None:
            continue
        values = expected["arguments"] if task["family"] != "json_extract" else expected
        prompt = task["messages"][0]["content"].lower()
        for value in _leaves(values):
            if isinstance(value, str):
                assert value.lower().replace("_", " ") in prompt, (task["id"], value)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    return [value]


def test_grading_is_exact_and_checks_the_schema(bench) -> None:  # type: ignore[no-untyped-def]
    corpus = {t["id"]: t for t in bench.tasks()}
    typed, none, extract = corpus["typed/000"], corpus["no_call/000"], corpus["json_extract/001"]
    name, args = typed["expected"]["name"], typed["expected"]["arguments"]
    assert bench.grade(typed, None, [(name, json.dumps(args, indent=4))]) == (True, True)
    wrong = {**args, next(iter(args)): "somewhere else"}
    assert bench.grade(typed, None, [(name, json.dumps(wrong))]) == (False, True)
    assert bench.grade(typed, None, [(name, "{not json")]) == (False, False)
    assert bench.grade(typed, None, [(name, json.dumps({}))]) == (False, False)  # required arguments missing
    assert bench.grade(typed, "It is sunny.", []) == (False, True)
    assert bench.grade(none, "Ottawa.", []) == (True, True)
    assert bench.grade(none, None, [(name, json.dumps(args))]) == (False, False)  # not offered here
    want = extract["expected"]
    assert bench.grade(extract, json.dumps(want), []) == (True, True)
    flipped = {**want, "in_stock": not want["in_stock"]}
    assert bench.grade(extract, json.dumps(flipped), []) == (False, True)
    assert bench.grade(extract, json.dumps({**want, "price": str(want["price"])}), []) == (False, False)


def test_the_held_out_choice_is_the_cheapest_that_keeps_quality_elsewhere(bench) -> None:  # type: ignore[no-untyped-def]
    rows = []
    for family in ("a", "b", "c"):
        for i in range(10):
            for policy, exact, passes in (("all-cloud", True, 30), ("verified", True, 6), ("one-side", i < 8, 15),
                                          ("all-edge", i < 5, 0)):
                rows.append({"id": f"{family}/{i}", "family": family, "policy": policy, "exact": exact, "valid": True,
                             "server_passes": passes, "billed": 0.5, "seconds": 1.0, "text_sha": "x",
                             "finish": "stop"})
    summary = bench.summarize(rows)
    assert summary["default_held_out"] == ["verified"]
    assert summary["held_out"]["a"]["passes_vs_all_cloud"] == pytest.approx(0.2)
    worse = [r for r in rows if not (r["policy"] == "verified" and r["family"] != "a" and r["id"].endswith(("/1", "/2")))]
    worse += [{**r, "exact": False} for r in rows if r["policy"] == "verified" and r["family"] != "a"
              and r["id"].endswith(("/1", "/2"))]
    assert bench.summarize(worse)["held_out"]["a"]["chosen"] == "all-cloud"  # 80 % elsewhere: not kept


def test_a_slice_answers_each_family_with_every_policy(tmp_path: Path, qwen05_path: Path, bench) -> None:  # type: ignore[no-untyped-def]
    runs = tmp_path / "runs.jsonl"
    cmd = [sys.executable, str(BENCH / "function_calling.py"), "run", "--limit", "1", "--runs", str(runs),
           "--edge-model", str(qwen05_path), "--cloud-model", str(qwen05_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in runs.read_text().splitlines()]
    assert len(rows) == 5 * len(bench.POLICIES) and not [r for r in rows if "raised" in r]
    # every call and every JSON answer that finished validates, whoever wrote it
    assert all(r["valid"] for r in rows if r["finish"] != "length")
    verified = [r for r in rows if r["policy"] == "verified"]
    assert {r["collab"] for r in verified} == {"verified"}
    by = {(r["id"], r["policy"]): r for r in rows}
    for r in verified:  # the cloud's own answer (graded alike: a batched check may space JSON otherwise at a
        alone = by[(r["id"], "all-cloud")]  # near tie, llama.cpp's batched logits not being bit-equal) at fewer passes
        assert r["exact"] == alone["exact"] and r["server_passes"] < alone["server_passes"]
    report = subprocess.run([sys.executable, str(BENCH / "function_calling.py"), "report", "--runs", str(runs)],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]


def test_the_committed_report_chose_verified_held_out() -> None:
    """Tool and JSON requests run verified by default: the committed report chose it on every
    family held out, keeping valid calls and JSON at 100 %."""
    report = json.loads((BENCH / "results" / "function_calling.json").read_text())
    assert report["default_held_out"] == ["verified"] and report["tasks"] >= 200
    assert all(v["valid"] == 1.0 for v in report["held_out"].values())
