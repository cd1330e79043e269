"""Scorers: ``score(request) -> float``, the estimated probability that the edge answer is not good enough.

* :class:`RulesScorer` - the design notes' formula, kept as the baseline: a long prompt
  (> 1,024 tokens) adds 0.4, a specialist domain 0.3, a request for exact precision 0.3.
* :class:`LearnedScorer` - logistic regression over :func:`~edgecloud.router.features.extract`
  features and hashed n-grams, trained on measured outcomes
  (:func:`edgecloud.router.training.fit.train_scorer`, needs
  scikit-learn) and stored as reviewable JSON: feature names, standardisation, coefficients.
  Scoring is plain Python arithmetic: no scikit-learn and no unpickling at run time.

:func:`load_scorer` returns the learned scorer from a file (the packaged one by default) and
falls back to the rules with a warning when the file is missing or corrupted.
"""

from __future__ import annotations

import json
import logging
import math
from importlib import resources
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .features import FEATURE_NAMES, extract, hashed_ngrams

__all__ = [
    "DESIGN_BANDS", "FORMAT", "BandedScorer", "LearnedScorer", "RulesScorer", "Scorer", "load_scorer",
    "PACKAGED_SCORER",
]

logger = logging.getLogger(__name__)

FORMAT = "edgecloud.router.logistic/1"
#: The design notes' bands: below 0.3 edge, above 0.7 cloud, edge-then-check between.
DESIGN_BANDS: tuple[float, float] = (0.3, 0.7)
#: The scorer trained on this project's outcome data, shipped with the package.
PACKAGED_SCORER = "scorer.json"


@runtime_checkable
class Scorer(Protocol):
    """Anything with a name and ``score(request) -> float`` in [0, 1]."""

    name: str

    def score(self, request: Any) -> float: ...


@runtime_checkable
class BandedScorer(Scorer, Protocol):
    """A scorer with its own default bands: ``(edge_below, cloud_above)``, the policy's thresholds
    when the settings name none, since each scorer's scale is its own (others get :data:`DESIGN_BANDS`)."""

    bands: tuple[float, float]


class RulesScorer:
    """The design-note formula: length > 1,024 tokens +0.4, specialist domain +0.3, exact precision +0.3."""

    name = "rules"
    bands = DESIGN_BANDS

    def score(self, request: Any) -> float:
        f = extract(request)
        value = 0.0
        if f["long_prompt"]:
            value += 0.4
        if any(f[f"domain_{d}"] >= 2 for d in ("finance", "medical", "legal", "science")):
            value += 0.3
        if f["precision_request"]:
            value += 0.3
        return min(1.0, value)


class LearnedScorer:
    """Logistic regression over dense features and hashed n-grams, loaded from its JSON form."""

    name = "learned"

    def __init__(self, model: dict[str, Any]) -> None:
        if model.get("format") != FORMAT:
            raise ValueError(f"not a learned router model (format {model.get('format')!r}, expected {FORMAT!r})")
        names = list(model["features"])
        if names != list(FEATURE_NAMES):
            raise ValueError("the model was trained on other features than this version extracts; retrain it")
        self.model = model
        self._mean = [float(x) for x in model["mean"]]
        self._scale = [float(x) or 1.0 for x in model["scale"]]
        self._dense = [float(x) for x in model["coef_dense"]]
        self._hash_dim = int(model["hash_dim"])
        self._hashed = {int(k): float(v) for k, v in model["coef_hashed"].items()}
        self._bias = float(model["intercept"])
        low, high = (float(b) for b in model.get("bands", DESIGN_BANDS))
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"the model's bands {low}, {high} are not 0 <= edge_below <= cloud_above <= 1")
        self.bands = (low, high)
        if not (len(self._mean) == len(self._scale) == len(self._dense) == len(names)):
            raise ValueError("the model's coefficient lists do not match its feature list")

    @classmethod
    def from_file(cls, path: str | Path) -> LearnedScorer:
        return cls(json.loads(Path(path).read_text(encoding="utf-8")))

    def logit(self, request: Any) -> float:
        f = extract(request)
        z = self._bias
        for i, name in enumerate(FEATURE_NAMES):
            z += self._dense[i] * (f[name] - self._mean[i]) / self._scale[i]
        if self._hashed:
            for bucket, value in hashed_ngrams(request, self._hash_dim).items():
                z += self._hashed.get(bucket, 0.0) * value
        return z

    def score(self, request: Any) -> float:
        z = max(-30.0, min(30.0, self.logit(request)))
        return 1.0 / (1.0 + math.exp(-z))


def load_scorer(kind: str = "learned", path: str | Path | None = None) -> Scorer:
    """``rules``, or the learned scorer from ``path`` (default: packaged); rules if that cannot load."""
    if kind == "rules":
        return RulesScorer()
    if kind != "learned":
        raise ValueError(f"unknown scorer {kind!r}; use 'learned' or 'rules'")
    try:
        if path is None:
            text = resources.files("edgecloud.router").joinpath("data", PACKAGED_SCORER).read_text(encoding="utf-8")
            return LearnedScorer(json.loads(text))
        return LearnedScorer.from_file(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("the learned router model %s could not be loaded (%s); using the rules scorer instead",
                       path or PACKAGED_SCORER, exc)
        return RulesScorer()
