"""Lead mode's agreement leaves out what the cloud copies from the prompt: the token arithmetic, and
the replay of ``benchmarks/lead_copy.py`` on its committed data, as CI runs a slice of it."""

from __future__ import annotations

from typing import Any

import pytest

from bench_scripts import load
from edgecloud.collab.lead import copied, prompt_runs
from edgecloud.config import CollabSettings

lead_copy = load("lead_copy")
chat_only = load("chat_only")


def test_each_position_knows_how_far_the_prompt_holds_it_verbatim() -> None:
    prompt = [5, 6, 7, 8, 9, 1, 6, 7]
    assert prompt_runs(prompt, [6, 7, 8, 9, 2, 3, 6, 7]) == [4, 3, 2, 1, 0, 0, 2, 1]
    assert prompt_runs(prompt, [1, 6, 7, 8]) == [3, 3, 2, 1]  # the longest of the places a token occurs
    assert prompt_runs([], [1, 2]) == [0, 0] and prompt_runs(prompt, []) == []


def test_a_token_is_copied_only_inside_a_long_enough_stretch() -> None:
    runs = prompt_runs([5, 6, 7, 8, 9, 1, 6, 7], [6, 7, 8, 9, 2, 3, 6, 7])
    assert copied(runs, 4) == [True] * 4 + [False] * 4
    assert copied(runs, 2) == [True] * 4 + [False, False, True, True]
    assert copied(runs, 5) == [False] * 8
    assert copied(runs, 0) == [False] * 8  # 0: every token counts


@pytest.fixture(scope="module")
def replay() -> dict[str, Any]:
    return lead_copy.replay()


def test_counting_every_token_replays_as_the_lead_policy_before(replay: dict[str, Any]) -> None:
    """Two code paths, one rule: with nothing left out, the threshold chosen per family held out is the
    lead replay's own (``chat_only.py``)."""
    rows = chat_only._joined()
    before = chat_only._lead_policies(rows, sorted({r["suite"] for r in rows}))["lead-16:agree@0.9"]["held_out"]
    assert replay["rules"]["lead-16:copy-0@0.9"]["held_out"] == before


def test_a_longer_stretch_leaves_out_fewer_tokens(replay: dict[str, Any]) -> None:
    shares = [replay["copied_share"][str(k)] for k in lead_copy.NGRAMS]
    assert shares[0] == 0 and shares[1:] == sorted(shares[1:], reverse=True) and shares[1] > 0


def test_the_shipped_setting_is_the_one_the_replay_chose(replay: dict[str, Any]) -> None:
    shipped = replay["shipped"][f"copy-{lead_copy.SHIPPED_NGRAM}"]
    settings = CollabSettings()
    assert (settings.lead_copy_ngram, settings.lead_agree) == (shipped["lead_copy_ngram"], shipped["lead_agree"])
    assert shipped["in_suite"]["quality_vs_all_cloud"] >= lead_copy.TARGETS[0]


def test_the_control_and_the_nested_choice_are_scored_held_out(replay: dict[str, Any]) -> None:
    for target in lead_copy.TARGETS:
        shuffled = replay["shuffled"][f"@{target}"]
        assert len(shuffled["seeds"]) == lead_copy.SHUFFLE_SEEDS
        nested = replay["nested"][f"@{target}"]
        assert nested["held_out"]["tasks"] == replay["tasks"]
        assert all(g is None or g[0] in lead_copy.NGRAMS for g in nested["chosen"].values())
