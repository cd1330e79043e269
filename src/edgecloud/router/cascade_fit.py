"""Fitting and judging the cascade on outcome data: thresholds, cloud share, what each signal adds.

This module owns the offline side of :mod:`edgecloud.router.cascade`: the signals of every
outcome row's edge answer (:func:`row_signals`: its code run against the prompt's examples,
truncation, the logprob summary recorded when labelling), a threshold chosen on the train
split as the one with the fewest cloud calls that still reaches ``target`` of cloud-only
quality (:func:`choose_threshold`), and the held-out figures (:func:`evaluate_cascade`) for

* ``cascade_all``: every request answered on the edge first, escalated when the check fails;
* ``banded``: the router's bands first (score above ``cloud_above`` straight to the cloud,
  below ``edge_below`` edge only), the check in between;

plus an ablation: the same fit and threshold choice with each signal group left out and with
each group alone (:func:`ablation`). ``edgecloud route cascade`` prints it all and writes the
fitted check that the client loads (``router/data/confidence.json``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .cascade import SIGNAL_NAMES, ConfidenceCheck, Signals, signals
from .evaluate import cascade_point

__all__ = ["GROUPS", "ablation", "choose_threshold", "evaluate_cascade", "row_signals"]

#: Signal groups for the ablation.
GROUPS: dict[str, tuple[str, ...]] = {
    "examples": ("examples_pass", "examples_fail"),
    "truncated": ("truncated",),
    "logprob": ("lp_mean", "lp_min", "lp_p10", "lp_tail"),
}


def _prompt(row: dict[str, Any]) -> str:
    return next((m["content"] for m in reversed(row.get("messages", [])) if m.get("role") == "user"), "")


def row_signals(rows: Sequence[dict[str, Any]], progress: Callable[[int, int], None] | None = None) -> list[Signals]:
    """The check's signals for each row's recorded edge answer (code rows run in the sandbox)."""
    out = []
    for i, row in enumerate(rows):
        out.append(signals(_prompt(row), row.get("edge_answer", ""), finish_reason=row.get("edge_finish"),
                           logprobs=row.get("edge_logprob") or {}))
        if progress is not None:
            progress(i + 1, len(rows))
    return out


def choose_threshold(rows: Sequence[dict[str, Any]], p_good: Sequence[float], to_cloud: Sequence[bool],
                     target: float = 0.95) -> tuple[float, dict[str, float]]:
    """The escalation threshold with the fewest cloud calls reaching ``target`` of cloud quality
    (the highest share reached when none does), and its cascade point on ``rows``."""
    candidates = sorted({0.0, 1.01, *(round(p, 6) for p in p_good)})
    best: tuple[float, dict[str, float]] | None = None
    for threshold in candidates:
        point = cascade_point(rows, to_cloud, [p < threshold for p in p_good])
        key_ok = point["share_of_cloud_quality"] >= target
        if best is None:
            best = (threshold, point)
            continue
        best_ok = best[1]["share_of_cloud_quality"] >= target
        if (key_ok and (not best_ok or point["cloud_fraction"] < best[1]["cloud_fraction"])) or (
            not key_ok and not best_ok and point["share_of_cloud_quality"] > best[1]["share_of_cloud_quality"]
        ):
            best = (threshold, point)
    assert best is not None
    return best


def _bands(scores: Sequence[float], edge_below: float, cloud_above: float) -> tuple[list[bool], list[bool]]:
    """(straight to the cloud, checked) per row under the router's bands."""
    return [s > cloud_above for s in scores], [edge_below <= s <= cloud_above for s in scores]


def evaluate_cascade(
    train: Sequence[dict[str, Any]], test: Sequence[dict[str, Any]],
    train_signals: Sequence[Signals], test_signals: Sequence[Signals],
    train_scores: Sequence[float], test_scores: Sequence[float],
    *, target: float = 0.95, edge_below: float = 0.3, cloud_above: float = 0.7, use: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Fit on ``train``, choose thresholds there, report both cascades on ``test`` (and the check)."""
    check = ConfidenceCheck().fit(train, train_signals, use=use)
    p_train = [check.p_good(s) for s in train_signals]
    p_test = [check.p_good(s) for s in test_signals]
    out: dict[str, Any] = {"signals": check.notes["signals"]}
    threshold, on_train = choose_threshold(train, p_train, [False] * len(train), target)
    out["cascade_all"] = {"threshold": threshold, "train": on_train,
                          "test": cascade_point(test, [False] * len(test), [p < threshold for p in p_test])}
    direct_train, checked_train = _bands(train_scores, edge_below, cloud_above)
    p_banded = [p if c else 1.01 for p, c in zip(p_train, checked_train)]  # unchecked rows never escalate
    threshold_b, on_train_b = choose_threshold(train, p_banded, direct_train, target)
    direct_test, checked_test = _bands(test_scores, edge_below, cloud_above)
    out["banded"] = {"threshold": threshold_b, "train": on_train_b, "test": cascade_point(
        test, direct_test, [c and p < threshold_b for p, c in zip(p_test, checked_test)])}
    check.threshold = threshold
    check.notes.update(target_share=target, chosen_on="train split")
    out["check"] = check
    return out


def ablation(
    train: Sequence[dict[str, Any]], test: Sequence[dict[str, Any]],
    train_signals: Sequence[Signals], test_signals: Sequence[Signals], *, target: float = 0.95,
) -> dict[str, Any]:
    """``cascade_all`` on ``test`` with each signal group left out, and with each group alone."""
    zeros = [0.0] * len(train)
    out: dict[str, Any] = {}
    for name, group in GROUPS.items():
        for label, use in ((f"without {name}", [n for n in SIGNAL_NAMES if n not in group]), (f"{name} only", group)):
            try:
                result = evaluate_cascade(train, test, train_signals, test_signals, zeros, [0.0] * len(test),
                                          target=target, use=use)
            except ValueError as exc:  # e.g. a constant signal: nothing to fit
                out[label] = {"error": str(exc)}
                continue
            out[label] = result["cascade_all"]["test"]
    return out
