"""Fitting the learned router scorer on measured outcomes (offline: the CLI and benchmarks).

This module owns :func:`train_scorer` (the scorer's JSON form from outcome rows, with ``C`` and
the hashed n-grams chosen by cross-validated APGR) and :func:`out_of_fold_scores`. The scorer it
writes is read on the request path by :class:`~edgecloud.router.scorers.LearnedScorer`.
"""

from __future__ import annotations

from typing import Any

from ..features import FEATURE_NAMES, extract, hashed_ngrams
from ..scorers import DESIGN_BANDS, FORMAT, LearnedScorer
from .evaluate import apgr, fold_indices, router_curve

__all__ = ["out_of_fold_scores", "train_scorer"]


def out_of_fold_scores(rows: list[dict[str, Any]], *, folds: int = 5, c: float | None = None, seed: int = 0
                       ) -> list[float]:
    """Each row's learned score from a scorer trained on the other folds: what the router would
    say about these requests had it never seen them (for fitting what comes after it)."""
    out = [0.0] * len(rows)
    for held in fold_indices(len(rows), folds, seed):
        scorer = LearnedScorer(train_scorer([r for i, r in enumerate(rows) if i not in held], c=c, seed=seed))
        for i in held:
            out[i] = scorer.score(rows[i])
    return out


def _cv_apgr(rows: list[dict[str, Any]], x: Any, y: Any, c: float, seed: int) -> float:
    """Out-of-fold APGR of a logistic regression with ``C=c``, averaged over three shuffles of 5 folds."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_predict

    n_splits = min(5, int(min(y.sum(), len(y) - y.sum())))
    if n_splits < 2:
        return 0.0
    values = []
    for shuffle in range(3):
        folds = StratifiedKFold(n_splits=n_splits, shuffle=True, random_state=seed + shuffle)
        p = cross_val_predict(LogisticRegression(C=c, max_iter=2000), x, y, cv=folds, method="predict_proba")[:, 1]
        try:
            values.append(apgr(router_curve(rows, p)))
        except ValueError:  # the cloud no better than the edge here: no gap to rank for
            values.append(0.0)
    return float(np.mean(values))


def train_scorer(
    rows: list[dict[str, Any]], *, hash_dim: int = 2048, c: float | None = None, seed: int = 0,
    ngrams: bool | None = None,
) -> dict[str, Any]:
    """Fit the learned scorer on outcome rows; returns its JSON form.

    The label is RouteLLM's: the cloud would have won (its answer passed where the edge's
    failed). Labelling "the edge failed" instead ranks tasks both sides fail (hard arithmetic
    for two small models) as high as the ones the cloud fixes, which spends cloud calls for no
    gain: measured on this project's outcomes, that label ranked worse than random (APGR 0.47).

    ``c`` (inverse regularisation) and whether the hashed n-grams are used (``hash_dim`` buckets,
    or none; ``ngrams`` True/False decides it instead) are chosen by 5-fold cross-validated APGR -
    the ranking the router is judged on.
    """
    import numpy as np
    from scipy import sparse
    from sklearn.linear_model import LogisticRegression

    if len(rows) < 10:
        raise ValueError(f"need at least 10 outcome rows to train, got {len(rows)}")
    y = np.array([1 if (r["cloud_pass"] and not r["edge_pass"]) else 0 for r in rows])
    if y.min() == y.max():
        raise ValueError("the cloud wins none or all of these outcomes; nothing to learn")
    dense = np.array([[extract(r, max_tokens=r.get("max_tokens"))[n] for n in FEATURE_NAMES] for r in rows])
    mean, scale = dense.mean(axis=0), dense.std(axis=0)
    scale[scale == 0] = 1.0
    dense_x = sparse.csr_matrix((dense - mean) / scale)
    with_ngrams = None
    if hash_dim > 0 and ngrams is not False:
        hashed = sparse.lil_matrix((len(rows), hash_dim))
        for i, r in enumerate(rows):
            for bucket, value in hashed_ngrams(r, hash_dim).items():
                hashed[i, bucket] = value
        with_ngrams = sparse.hstack([dense_x, hashed.tocsr()]).tocsr()
    # Model selection by cross-validated APGR on these rows: C, and whether the hashed n-grams
    # earn their cost (they take about a third of the scoring time); the simpler model wins ties.
    options = [(0, dense_x)] if ngrams is not True or with_ngrams is None else []
    options += [(hash_dim, with_ngrams)] if with_ngrams is not None else []
    grid = [c] if c is not None else [0.01, 0.03, 0.1, 0.3, 1.0]
    choose = len(grid) * len(options) > 1
    scored = [(_cv_apgr(rows, xs, y, g, seed) if choose else 0.0, -dim, g, dim, xs) for dim, xs in options for g in grid]
    cv_apgr, _, c, hash_dim, x = max(scored, key=lambda t: (round(t[0], 4), t[1]))
    fit = LogisticRegression(C=c, max_iter=2000).fit(x, y)
    coef = fit.coef_[0]
    # The design notes' bands read as traffic shares: the lowest 30% of training scores edge
    # only, the highest 30% straight to the cloud (a probability of a cloud win rarely reaches 0.7).
    train_scores = fit.predict_proba(x)[:, 1]
    bands = [round(float(np.quantile(train_scores, q)), 6) for q in DESIGN_BANDS]
    n_dense = len(FEATURE_NAMES)
    return {
        "format": FORMAT,
        "label": "cloud answer passed where the edge answer failed",
        "trained_on": len(rows),
        "C": c,
        "cv_apgr": round(cv_apgr, 4) if choose else None,
        "features": list(FEATURE_NAMES),
        "mean": [round(float(v), 6) for v in mean],
        "scale": [round(float(v), 6) for v in scale],
        "coef_dense": [round(float(v), 6) for v in coef[:n_dense]],
        "hash_dim": hash_dim,
        "coef_hashed": {str(i): round(float(v), 6) for i, v in enumerate(coef[n_dense:]) if abs(v) > 1e-6},
        "intercept": round(float(fit.intercept_[0]), 6),
        "bands": bands,
    }
