"""Replay outcome files to judge a router, as RouteLLM and RouterBench do.

Given each task's measured ``edge_pass`` / ``cloud_pass`` and a router's score, sending the
``k`` highest-scored tasks to the cloud gives a quality (mean pass rate) for every cloud-call
fraction ``k / n``. Scores that tie are an arbitrary order, so the curve is taken between
tie-group boundaries by linear interpolation (the expected value over the tie's orderings).

* PGR (performance gap recovered) = (quality - edge quality) / (cloud quality - edge quality),
  capped at 1: a router is not credited beyond sending everything to the cloud.
* APGR = the area under PGR over the cloud-call fraction in [0, 1]; a random router
  scores about 0.5; the oracle (cloud-only wins first) scores 1 - (share of cloud-only wins) / 2.
* CPT(x) = the smallest cloud-call fraction that reaches PGR x (CPT(50%), CPT(80%)).

A cascade (edge first, escalate on low confidence) is charged for its edge attempts:
:func:`cascade_point` reports its quality, cloud fraction and edge attempts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Curve", "apgr", "cascade_point", "cpt", "load_outcomes", "oracle_scores", "random_scores", "router_curve",
    "split_outcomes", "fold_indices", "summary", "plot_curves",
]

Curve = list[tuple[float, float]]  # (cloud fraction, quality)


def load_outcomes(path: str | Path) -> list[dict[str, Any]]:
    """Outcome rows from a JSONL file (see :mod:`edgecloud.router.training.label`)."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "edge_pass" not in row or "cloud_pass" not in row:
            raise ValueError(f"{path}:{n}: an outcome row needs edge_pass and cloud_pass")
        rows.append(row)
    return rows


def split_outcomes(rows: Sequence[dict[str, Any]], test_share: float = 0.3, seed: int = 0
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A seeded train / held-out split, stratified by suite and by the (edge, cloud) outcome."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: str(r.get("id"))):
        groups.setdefault((row.get("suite"), bool(row["edge_pass"]), bool(row["cloud_pass"])), []).append(row)
    rng = random.Random(seed)
    train, test = [], []
    for key in sorted(groups, key=str):
        members = groups[key]
        rng.shuffle(members)
        cut = int(round(len(members) * test_share))
        test.extend(members[:cut])
        train.extend(members[cut:])
    return train, test


def fold_indices(n: int, folds: int = 5, seed: int = 0) -> list[set[int]]:
    """A seeded split of ``range(n)`` into ``folds`` held-out index sets (for out-of-fold values)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [set(order[k::folds]) for k in range(folds)]


def router_curve(rows: Sequence[dict[str, Any]], scores: Sequence[float]) -> Curve:
    """Quality at every cloud-call fraction when the highest scores go to the cloud (ties interpolated)."""
    n = len(rows)
    if n == 0:
        raise ValueError("no outcome rows to evaluate")
    edge = np.array([float(bool(r["edge_pass"])) for r in rows])
    cloud = np.array([float(bool(r["cloud_pass"])) for r in rows])
    order = np.argsort(-np.asarray(scores, dtype=float), kind="stable")
    ordered = np.asarray(scores, dtype=float)[order]
    gain = (cloud - edge)[order]
    base = edge.sum()
    curve: Curve = [(0.0, base / n)]
    done, total_gain = 0, 0.0
    while done < n:
        end = done
        while end < n and ordered[end] == ordered[done]:
            end += 1
        group_gain = gain[done:end].sum()
        size = end - done
        for j in range(1, size + 1):  # expected quality j tasks into the tie group
            curve.append(((done + j) / n, (base + total_gain + group_gain * j / size) / n))
        total_gain += group_gain
        done = end
    return curve


def _pgr(curve: Curve) -> list[tuple[float, float]]:
    edge_q, cloud_q = curve[0][1], curve[-1][1]
    gap = cloud_q - edge_q
    if gap <= 0:
        raise ValueError(f"the cloud is not better than the edge on these outcomes ({cloud_q:.3f} vs {edge_q:.3f}); "
                         "there is no gap for a router to recover")
    return [(c, min(1.0, (q - edge_q) / gap)) for c, q in curve]


def apgr(curve: Curve) -> float:
    """Area under the (capped) PGR curve over cloud-call fractions 0..1."""
    points = _pgr(curve)
    xs, ys = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    return float(np.sum((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2))


def cpt(curve: Curve, target: float) -> float:
    """The smallest cloud-call fraction whose PGR reaches ``target`` (linear between points)."""
    points = _pgr(curve)
    for (c0, p0), (c1, p1) in zip(points, points[1:]):
        if p1 >= target - 1e-12:
            if p0 >= target - 1e-12:
                return c0
            return c0 + (c1 - c0) * (target - p0) / (p1 - p0)
    return 1.0


def random_scores(rows: Sequence[dict[str, Any]], seed: int = 0) -> list[float]:
    """A seeded random router."""
    rng = random.Random(seed)
    return [rng.random() for _ in rows]


def oracle_scores(rows: Sequence[dict[str, Any]]) -> list[float]:
    """The oracle: cloud-only wins first, edge-only wins last."""
    return [1.0 if (r["cloud_pass"] and not r["edge_pass"]) else 0.0 if (r["edge_pass"] and not r["cloud_pass"])
            else 0.5 for r in rows]


def cascade_point(rows: Sequence[dict[str, Any]], to_cloud: Sequence[bool], escalate: Sequence[bool]) -> dict[str, float]:
    """Quality and costs of a cascade: ``to_cloud`` goes straight to the cloud, the rest is answered
    on the edge and ``escalate``\\ d to the cloud when its check fails."""
    n = len(rows)
    quality = cloud_calls = edge_attempts = 0
    for row, direct, esc in zip(rows, to_cloud, escalate):
        if direct:
            cloud_calls += 1
            quality += bool(row["cloud_pass"])
            continue
        edge_attempts += 1
        if esc:
            cloud_calls += 1
            quality += bool(row["cloud_pass"])
        else:
            quality += bool(row["edge_pass"])
    cloud_q = sum(bool(r["cloud_pass"]) for r in rows) / n
    return {
        "quality": quality / n,
        "share_of_cloud_quality": (quality / n) / cloud_q if cloud_q else float("nan"),
        "cloud_fraction": cloud_calls / n,
        "edge_attempt_fraction": edge_attempts / n,
    }


def summary(rows: Sequence[dict[str, Any]], scores: Sequence[float], *, seeds: Iterable[int] = range(20)
            ) -> dict[str, Any]:
    """The ``route eval`` JSON: APGR, CPT(50%), CPT(80%), random and oracle baselines, the curve."""
    curve = router_curve(rows, scores)
    random_apgr = float(np.mean([apgr(router_curve(rows, random_scores(rows, s))) for s in seeds]))
    return {
        "n": len(rows),
        "apgr": round(apgr(curve), 4),
        "cpt50": round(cpt(curve, 0.5), 4),
        "cpt80": round(cpt(curve, 0.8), 4),
        "random_apgr": round(random_apgr, 4),
        "oracle_apgr": round(apgr(router_curve(rows, oracle_scores(rows))), 4),
        "edge_quality": round(curve[0][1], 4),
        "cloud_quality": round(curve[-1][1], 4),
        "curve": [[round(c, 4), round(q, 4)] for c, q in curve],
    }


def plot_curves(curves: dict[str, Curve], path: str | Path, *, title: str = "Router: quality vs cloud calls",
                points: dict[str, tuple[float, float]] | None = None) -> Path:
    """Write a PNG of quality against cloud-call fraction for each named curve (and cascade points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    for name, curve in curves.items():
        ax.plot([c for c, _ in curve], [q for _, q in curve], label=name, linestyle="--" if name == "random" else "-")
    for name, (c, q) in (points or {}).items():
        ax.scatter([c], [q], marker="*", s=120, zorder=5, label=name)
    ax.set_xlabel("fraction of requests sent to the cloud")
    ax.set_ylabel("quality (share of tasks passed)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def score_rows(rows: Sequence[dict[str, Any]], score: Callable[[dict[str, Any]], float]) -> list[float]:
    """Scores for outcome rows (each row holds the request's ``messages`` and ``max_tokens``)."""
    return [float(score(r)) for r in rows]
