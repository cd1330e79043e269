"""Fitting and judging the cascade on outcome data: thresholds, cloud share, what each signal adds.

This module owns the offline side of :mod:`edgecloud.router.cascade`: the signals of every
outcome row's edge answer (:func:`row_signals`: its code run against the prompt's examples,
truncation, the logprob summary recorded when labelling), a threshold chosen on the train
split as the one with the fewest cloud calls that still reaches ``target`` of cloud-only
quality (:func:`choose_threshold`, on out-of-fold check values: :func:`out_of_fold_p_good`), and the held-out figures (:func:`evaluate_cascade`) for

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

from ..cascade import SIGNAL_NAMES, ConfidenceCheck, Signals, signals
from .evaluate import cascade_point, fold_indices

__all__ = ["GROUPS", "ablation", "choose_threshold", "evaluate_cascade", "out_of_fold_p_good", "row_signals"]

#: Signal groups for the ablation.
GROUPS: dict[str, tuple[str, ...]] = {
    "examples": ("examples_pass", "examples_fail"),
    "truncated": ("truncated",),
    "logprob": ("lp_mean", "lp_min", "lp_p10", "lp_tail"),
    "route score": ("route_score",),
}


def _prompt(row: dict[str, Any]) -> str:
    return next((m["content"] for m in reversed(row.get("messages", [])) if m.get("role") == "user"), "")


def row_signals(rows: Sequence[dict[str, Any]], scores: Sequence[float] | None = None,
                progress: Callable[[int, int], None] | None = None) -> list[Signals]:
    """The check's signals for each row's recorded edge answer (code rows run in the sandbox);
    ``scores`` are the router's scores for the rows, the ``route_score`` signal."""
    out = []
    for i, row in enumerate(rows):
        out.append(signals(_prompt(row), row.get("edge_answer", ""), finish_reason=row.get("edge_finish"),
                           logprobs=row.get("edge_logprob") or {},
                           route_score=None if scores is None else scores[i]))
        if progress is not None:
            progress(i + 1, len(rows))
    return out


def choose_threshold(rows: Sequence[dict[str, Any]], p_good: Sequence[float], to_cloud: Sequence[bool],
                     target: float = 0.95, max_cloud: float = 1.0) -> tuple[float, dict[str, float]]:
    """The escalation threshold and its cascade point on ``rows``.

    Within the cloud budget (``cloud_fraction <= max_cloud``): the fewest cloud calls that reach
    ``target`` of cloud-only quality, or, when none does, the highest quality. When even no
    escalation exceeds the budget (the direct band alone), the fewest cloud calls.
    """
    points = [(t, cascade_point(rows, to_cloud, [p < t for p in p_good]))
              for t in sorted({0.0, 1.01, *p_good})]  # exact: a rounded value can land above the p it stands for
    within = [(t, pt) for t, pt in points if pt["cloud_fraction"] <= max_cloud + 1e-12]
    if not within:
        return min(points, key=lambda tp: tp[1]["cloud_fraction"])
    reaching = [(t, pt) for t, pt in within if pt["share_of_cloud_quality"] >= target]
    if reaching:
        return min(reaching, key=lambda tp: (tp[1]["cloud_fraction"], tp[0]))
    return max(within, key=lambda tp: (tp[1]["share_of_cloud_quality"], -tp[1]["cloud_fraction"]))


def out_of_fold_p_good(rows: Sequence[dict[str, Any]], row_signals: Sequence[Signals], *, folds: int = 5,
                       use: Sequence[str] | None = None, seed: int = 0) -> list[float]:
    """Each row's ``p_good`` from a check fitted on the other folds.

    Thresholds are chosen on these: a check scored on the rows it was fitted on looks surer than
    it is, and a threshold chosen there escalates too little on new requests.
    """
    out = [0.0] * len(rows)
    for held in fold_indices(len(rows), folds, seed):
        fit_rows = [r for i, r in enumerate(rows) if i not in held]
        fit_signals = [s for i, s in enumerate(row_signals) if i not in held]
        try:
            check = ConfidenceCheck().fit(fit_rows, fit_signals, use=use)
        except ValueError:  # a fold with one outcome only: fall back to the fit on every row
            check = ConfidenceCheck().fit(rows, row_signals, use=use)
        for i in held:
            out[i] = check.p_good(row_signals[i])
    return out


def _bands(scores: Sequence[float], edge_below: float, cloud_above: float) -> tuple[list[bool], list[bool]]:
    """(straight to the cloud, checked) per row under the router's bands."""
    return [s > cloud_above for s in scores], [edge_below <= s <= cloud_above for s in scores]


def evaluate_cascade(
    train: Sequence[dict[str, Any]], test: Sequence[dict[str, Any]],
    train_signals: Sequence[Signals], test_signals: Sequence[Signals],
    train_scores: Sequence[float], test_scores: Sequence[float],
    *, target: float = 0.95, max_cloud: float = 1.0, edge_below: float = 0.3, cloud_above: float = 0.7,
    use: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Fit on ``train``, choose thresholds there, report both cascades on ``test`` (and the check)."""
    check = ConfidenceCheck().fit(train, train_signals, use=use)
    p_train = out_of_fold_p_good(train, train_signals, use=use)
    p_test = [check.p_good(s) for s in test_signals]
    out: dict[str, Any] = {"signals": check.notes["signals"]}
    threshold, on_train = choose_threshold(train, p_train, [False] * len(train), target, max_cloud)
    out["cascade_all"] = {"threshold": threshold, "train": on_train,
                          "test": cascade_point(test, [False] * len(test), [p < threshold for p in p_test])}
    direct_train, checked_train = _bands(train_scores, edge_below, cloud_above)
    p_banded = [p if c else 1.01 for p, c in zip(p_train, checked_train)]  # unchecked rows never escalate
    threshold_b, on_train_b = choose_threshold(train, p_banded, direct_train, target, max_cloud)
    direct_test, checked_test = _bands(test_scores, edge_below, cloud_above)
    out["banded"] = {"threshold": threshold_b, "train": on_train_b, "test": cascade_point(
        test, direct_test, [c and p < threshold_b for p, c in zip(p_test, checked_test)])}
    check.threshold = threshold_b  # the client checks middle-band answers: the banded cascade's threshold
    check.notes.update(target_share=target, max_cloud=max_cloud, chosen_on="train split, out-of-fold")
    out["check"] = check
    return out


def ablation(
    train: Sequence[dict[str, Any]], test: Sequence[dict[str, Any]],
    train_signals: Sequence[Signals], test_signals: Sequence[Signals], *, target: float = 0.95,
    max_cloud: float = 1.0,
) -> dict[str, Any]:
    """``cascade_all`` on ``test`` with each signal group left out, and with each group alone."""
    zeros = [0.0] * len(train)
    out: dict[str, Any] = {}
    for name, group in GROUPS.items():
        for label, use in ((f"without {name}", [n for n in SIGNAL_NAMES if n not in group]), (f"{name} only", group)):
            try:
                result = evaluate_cascade(train, test, train_signals, test_signals, zeros, [0.0] * len(test),
                                          target=target, max_cloud=max_cloud, use=use)
            except ValueError as exc:  # e.g. a constant signal: nothing to fit
                out[label] = {"error": str(exc)}
                continue
            out[label] = result["cascade_all"]["test"]
    return out
