"""The lead-mode replay of ``benchmarks/chat_only.py`` on its committed data, as CI runs a slice of it.

Two code paths replay the same rule (the edge takes over after the cloud's first 16 tokens where it
agrees with 14 or more of them): the single-opening replay and the later-chances replay with one
checkpoint. They must agree; later chances and the cloud's own confidence are scored held out.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench_scripts import load

chat_only = load("chat_only")


@pytest.fixture(scope="module")
def replay() -> tuple[list[dict[str, Any]], list[str]]:
    rows = chat_only._joined()
    if len(rows) < 300:
        pytest.fail(f"the committed corpus has {len(rows)} probed tasks; chat_only.py probe writes them")
    return rows, sorted({r["suite"] for r in rows})


def test_one_checkpoint_replays_as_the_single_opening(replay: tuple[list[dict[str, Any]], list[str]]) -> None:
    rows, families = replay
    single = chat_only._lead_policies(rows, families)
    assert single["lead-16:agree>=0.85 (in-suite)"]["held_out"] == \
        single["lead-rolling-16:window>=0.875 (in-suite)"]["held_out"]


def test_later_chances_and_the_clouds_confidence_are_scored_held_out(
        replay: tuple[list[dict[str, Any]], list[str]]) -> None:
    rows, families = replay
    rolling = chat_only._rolling_lead(rows, families)
    cloud = chat_only._cloud_confidence_lead(rows, families)
    for result in (rolling, cloud):
        assert not any("incomplete" in v for v in result.values())
    three = rolling["lead-rolling-16/32/48:all@0.9"]
    assert sum(three["took_over_at"].values()) == pytest.approx(1.0, abs=1e-3)
    assert set(three["per_family_held_out"]) == set(families)
    for entry in [*rolling.values(), *cloud.values()]:
        held = entry["held_out"]
        assert held["tasks"] == len(rows) and 0 <= held["billed_vs_all_cloud_p50"] <= 1.0
