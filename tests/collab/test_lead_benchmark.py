"""The lead-mode replay of ``benchmarks/chat_only.py`` on its committed data, as CI runs a slice of it.

Two code paths replay the same rule (the edge takes over after the cloud's first 16 tokens where it
agrees with 14 or more of them): the single-opening replay and the later-chances replay with one
checkpoint. They must agree; later chances and second signals (the cloud's confidence, the edge's probe) are scored held out.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench_scripts import load

chat_only = load("chat_only")


@pytest.fixture(scope="module")
def replay() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = chat_only._joined()
    if len(rows) < 300:
        pytest.fail(f"the committed corpus has {len(rows)} probed tasks; chat_only.py probe writes them")
    return rows, chat_only._lead_policies(rows, sorted({r["suite"] for r in rows}))


def test_one_checkpoint_replays_as_the_single_opening(replay: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    _, lead = replay
    assert lead["lead-16:agree>=0.85 (in-suite)"]["held_out"] == \
        lead["lead-rolling-16:window>=0.875 (in-suite)"]["held_out"]


def test_later_chances_and_second_signals_are_scored_held_out(
        replay: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    rows, lead = replay
    assert not any("incomplete" in v for v in lead.values())
    families = {r["suite"] for r in rows}
    three = lead["lead-rolling-16/32/48:all@0.9"]
    assert sum(three["took_over_at"].values()) == pytest.approx(1.0, abs=1e-3)
    assert set(three["per_family_held_out"]) == families
    for signal in ("cloud_min_margin", "probe_mean_margin"):
        assert f"lead-16:agree&{signal}>=@0.9" in lead
    # choosing the rule itself held out: each family's pick is one of the rules scored above
    nested = lead["lead-16:nested@0.9"]
    assert nested["rules_chosen"] and all(f"{rule}@0.9" in lead or rule == "lead-16:agree>="
                                          for rule in nested["rules_chosen"])
    for entry in lead.values():
        held = entry["held_out"]
        assert held["tasks"] == len(rows) and 0 <= held["billed_vs_all_cloud_p50"] <= 1.0
