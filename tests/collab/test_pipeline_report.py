"""A slice of the user's-clock benchmark (benchmarks/pipeline.py) as CI runs it: ``report`` pools
one client's committed live runs by setup, and what it pools is each run's answers, task by task."""

from __future__ import annotations

import json
import statistics
from types import ModuleType

import pytest

from bench_scripts import BENCH, load

TAG = "stream"  # the client the README's table reports


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load("pipeline")


def _runs(setup: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(p.read_text(encoding="utf-8"))
            for p in sorted((BENCH / "results").glob(f"pipeline_live_{setup}_skip*_{TAG}.json"))]


def test_a_setup_measured_once_pools_to_that_runs_own_summary(bench: ModuleType) -> None:
    pooled = bench._pooled(TAG)["setups"]
    single = [setup for setup, g in pooled.items() if g["runs"] == 1]
    assert single, "the committed runs measure some setup once"
    for setup in single:
        (run,) = _runs(setup)
        assert pooled[setup]["summary"] == run["summary"]


def test_pooled_runs_are_every_answer_of_each_run_compared_task_by_task(bench: ModuleType) -> None:
    pooled = bench._pooled(TAG)["setups"]
    many = {setup: g for setup, g in pooled.items() if g["runs"] > 1}
    assert many, "the committed runs measure some setup more than once"
    for setup, g in many.items():
        runs = _runs(setup)
        assert g["tasks"] == sum(len(r["answers"]["all-cloud"]) for r in runs)
        ratios = [a["seconds"] / c["seconds"] for r in runs
                  for a, c in zip(r["answers"]["pipelined"], r["answers"]["all-cloud"])
                  if "raised" not in a and "raised" not in c]
        assert g["summary"]["pipelined"]["e2e_vs_all_cloud_p50"] == round(statistics.median(ratios), 3)
        per_run = [r["summary"]["pipelined"]["e2e_vs_all_cloud_p50"] for r in runs]
        assert min(per_run) <= g["summary"]["pipelined"]["e2e_vs_all_cloud_p50"] <= max(per_run)


def test_a_tag_without_runs_is_refused_by_name(bench: ModuleType) -> None:
    import argparse

    with pytest.raises(SystemExit, match="no-such-client"):
        bench.report(argparse.Namespace(tag="no-such-client"))
