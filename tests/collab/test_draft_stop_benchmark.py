"""A slice of the draft-stopping benchmark (benchmarks/draft_stop.py) as CI runs it: the committed
traces are real answers of every family, the replay ends blocks where the rule says and keeps the
cloud's tokens, and the shipped confidence floor is the one the committed sweep chose held out by
task family for the shipped edge model (its traces, its costs)."""

from __future__ import annotations

import itertools
import json
from types import ModuleType
from typing import Any

import pytest

from edgecloud.config import CollabSettings
from edgecloud.store import DEFAULT_DRAFT_MODEL
from bench_scripts import BENCH, load


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load("draft_stop")


@pytest.fixture(scope="module")
def traces(bench) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    return [json.loads(line) for line in bench._files(DEFAULT_DRAFT_MODEL)[0].read_text().splitlines()]


@pytest.fixture(scope="module")
def calibration(bench) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    return json.loads(bench._files(DEFAULT_DRAFT_MODEL)[1].read_text())


def test_the_traces_are_real_answers_of_every_family(traces: list[dict[str, Any]]) -> None:
    families: dict[str, int] = {}
    for t in traces:
        families[t["family"]] = families.get(t["family"], 0) + 1
        assert len(t["edge"]) == len(t["p"]) == len(t["cloud"]) and all(0 <= p <= 1 for p in t["p"])
        # a line is drafted exactly where the edge's pick differs from the cloud's
        assert {int(j) for j in t["lines"]} == {j for j, (e, c) in enumerate(zip(t["edge"], t["cloud"])) if e != c}
    assert len(traces) >= 100 and len(families) >= 8 and min(families.values()) >= 10
    assert len({t["id"] for t in traces}) == len(traces)


def test_a_block_ends_where_the_edge_is_unsure_and_the_answer_is_the_clouds(bench, traces, calibration) -> None:  # type: ignore[no-untyped-def]
    trace = max(traces, key=lambda t: len(t["lines"]))  # the answer with the most wrong picks
    n = len(trace["cloud"])
    every = bench.replay(trace, 1.01, lambda rate, ms: 15, calibration, 0.0)  # every token below: blocks of one
    written, rounds = 1, 0  # the prompt's check writes the cloud's first token; then a check of one draft writes
    while written < n:      # it and the cloud's next token where the cloud keeps it, else the cloud's token alone
        written, rounds = written + (2 if trace["edge"][written] == trace["cloud"][written] else 1), rounds + 1
    assert every["checks"] == 1 + rounds
    free = bench.replay(trace, 0.0, lambda rate, ms: 15, calibration, 0.0)
    floored = bench.replay(trace, 0.7, lambda rate, ms: 15, calibration, 0.0)
    assert free["checks"] < floored["checks"] < every["checks"]
    # blocks that end before their rejected tail send fewer tokens
    assert floored["billed"] < free["billed"]
    on_path = [kept for _, kept in bench._line(trace, 0)]
    first_wrong = on_path.index(False)
    assert all(on_path[:first_wrong]) and trace["edge"][first_wrong] != trace["cloud"][first_wrong]
    # a block longer than the traced line after a wrong pick is counted drafted and rejected to its end;
    # a line that reaches the answer's end stays as long as the answer
    past = list(itertools.islice(bench._padded(trace, first_wrong), bench.LINE + 10))
    assert len(past) == bench.LINE + 10 and not any(kept for _, kept in past)
    clean = max(traces, key=lambda t: len(t["cloud"]) if t["edge"][-1] == t["cloud"][-1] else 0)
    last = max(j for j, (e, c) in enumerate(zip(clean["edge"], clean["cloud"])) if e != c) + 1 if clean["lines"] else 0
    assert len(list(bench._padded(clean, last))) == len(clean["cloud"]) - last


def test_the_shipped_floor_is_the_one_chosen_held_out_by_family(bench) -> None:  # type: ignore[no-untyped-def]
    report = json.loads((BENCH / "results" / f"{bench._files(DEFAULT_DRAFT_MODEL)[2]}.json").read_text())
    shipped = CollabSettings().draft_confidence
    # where the floor applies (the sides take turns: a cloud on this machine, loopback), it is one of
    # the floors chosen held out, within the bound on the cloud's passes
    held = report["by_rtt"]["0"]["held_out_by_family"]["k 15"]
    assert shipped in held["floor_chosen_by_family"].values()
    assert held["server_passes_vs_all_cloud_p50"] <= report["max_passes"]
    for rtt in ("0", "50"):  # and it beats no floor, on the user's clock and the bill
        rows = report["by_rtt"][rtt]["in_suite"]
        ours, none = rows[f"k 15, floor {shipped:g}"], rows["adaptive k, floor 0"]
        assert ours["e2e_vs_all_cloud_p50"] < none["e2e_vs_all_cloud_p50"]
        assert ours["billed_vs_all_cloud_p50"] < none["billed_vs_all_cloud_p50"]


def test_an_answer_within_the_opening_costs_what_all_cloud_does_and_the_shipped_opening_was_chosen_held_out(
        bench, traces, calibration) -> None:  # type: ignore[no-untyped-def]
    trace = min((t for t in traces if len(t["cloud"]) > 4), key=lambda t: len(t["cloud"]))
    n = len(trace["cloud"])
    # the cloud writes it all, a check a token, nothing sent but the prompt: all-cloud's bill
    opened = bench.replay(trace, 0.7, lambda rate, ms: 15, calibration, 0.0, opening=n, read_ms=3.0)
    assert opened["checks"] == n and opened["billed"] == pytest.approx(1.0)
    drafted = bench.replay(trace, 0.7, lambda rate, ms: 15, calibration, 0.0, opening=1, read_ms=3.0)
    assert drafted["checks"] < n
    # the shipped opening: within what was chosen held out by family on the machine it was measured on, within
    # verified mode's bars on the cloud's passes (pooled) and the bill (p50) over every answer
    report = json.loads((BENCH / "results" / f"{bench._files(DEFAULT_DRAFT_MODEL, 'epyc-k31')[2]}_opening.json")
                        .read_text())
    shipped = CollabSettings().opening_tokens
    rtt0 = report["by_rtt"]["0"]
    chosen = rtt0["held_out_by_family"]["opening_chosen_by_family"].values()  # short answers' families choose
    assert min(chosen) <= shipped <= max(chosen)                                # more, long answers' fewer
    row = rtt0["in_suite"][str(shipped)]
    assert row["server_passes_pooled"] <= report["max_passes"] and row["billed_vs_all_cloud_p50"] <= report["max_billed"]
    assert row["e2e_vs_all_cloud_p50"] < rtt0["in_suite"]["1"]["e2e_vs_all_cloud_p50"]
