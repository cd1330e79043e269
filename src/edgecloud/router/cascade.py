"""The cascade's confidence check: is the edge's answer good enough, or should the cloud answer?

Token logprobs alone rank the edge's failures barely better than chance on code and arithmetic
(measured with these models), so the check looks at the answer itself:

* ``examples``: for code, the answer's code runs in the sandbox against the examples the prompt
  states (doctest lines ``>>> f(2)`` / ``4``, and ``f(2) == 4`` or ``f(2) -> 4`` written in the
  text). ``True`` all hold, ``False`` one fails or the code does not run, ``None`` no examples.
* ``truncated``: the answer stopped at ``max_tokens``.
* ``logprob``: mean, minimum, 10th percentile and tail mean of the answer's token logprobs.
* ``agreement``: for short answers, the share of a few sampled answers that agree with the
  greedy one (the caller supplies the samples; computing them costs edge time).
* ``route_score``: the router's score for the request (the estimated chance that the cloud
  answers it where the edge fails), so what the prompt says and what the answer shows are
  weighed together.

:class:`ConfidenceCheck` turns the signals into ``p(answer is good enough)`` - good enough
meaning that asking the cloud would not have done better (the edge passed, or the cloud failed
too: escalating a task both models fail only spends a cloud call): a logistic model fitted
on outcome rows (:meth:`ConfidenceCheck.fit`) or, before fitting, a conservative rule
(escalate on a failed example, a truncated answer, or a mean logprob below ``min_mean_logprob``).
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from .answers import extract_code, logprob_summary, normalise
from .sandbox import run_python

__all__ = ["CHECK_FORMAT", "ConfidenceCheck", "Signals", "prompt_examples", "signals"]

logger = logging.getLogger(__name__)
CHECK_FORMAT = "edgecloud.router.confidence/1"
PACKAGED_CHECK = "confidence.json"

_DOCTEST = re.compile(r"^\s*>>> (.+)\n\s*(?!>>>)(\S.*)$", re.MULTILINE)
_INLINE = re.compile(r"\b([A-Za-z_]\w*\((?:[^()\n]|\([^()\n]*\))*\))\s*(?:==|->|=>|returns|should return)\s*"
                     r"([^\n,;]+?)(?=\s*(?:$|\n|;|,\s|\.\s|\.$))", re.MULTILINE)


def _is_expr(text: str) -> bool:
    try:
        ast.parse(text.strip(), mode="eval")
        return True
    except SyntaxError:
        return False


def prompt_examples(prompt: str, limit: int = 8) -> list[tuple[str, str]]:
    """(call, expected) pairs the prompt states, each a valid Python expression."""
    pairs: list[tuple[str, str]] = []
    for call, expected in _DOCTEST.findall(prompt) + _INLINE.findall(prompt):
        call, expected = call.strip(), expected.strip().rstrip(".")
        if _is_expr(call) and _is_expr(expected) and (call, expected) not in pairs:
            pairs.append((call, expected))
        if len(pairs) >= limit:
            break
    return pairs


def check_examples(prompt: str, answer: str, *, timeout: float = 5.0) -> bool | None:
    """Run the answer's code against the prompt's examples: True, False, or None (no examples)."""
    pairs = prompt_examples(prompt)
    if not pairs:
        return None
    asserts = "\n".join(f"assert ({call}) == ({expected}), {call!r}" for call, expected in pairs)
    return run_python(f"{extract_code(answer)}\n\n{asserts}\n", timeout=timeout).passed


@dataclass(frozen=True)
class Signals:
    """What the check knows about one edge answer."""

    examples: bool | None
    truncated: bool
    logprob: dict[str, float]
    agreement: float | None = None
    route_score: float | None = None

    def vector(self) -> list[float]:
        lp = self.logprob
        return [
            1.0 if self.examples is True else 0.0, 1.0 if self.examples is False else 0.0, float(self.truncated),
            lp.get("mean", 0.0), lp.get("min", 0.0), lp.get("p10", 0.0), lp.get("tail_mean", 0.0),
            -1.0 if self.agreement is None else self.agreement,
            0.0 if self.route_score is None else self.route_score,
        ]


SIGNAL_NAMES = ("examples_pass", "examples_fail", "truncated", "lp_mean", "lp_min", "lp_p10", "lp_tail", "agreement",
                "route_score")


def signals(prompt: str, answer: str, *, finish_reason: str | None, logprobs: Sequence[float] | dict[str, float] = (),
            samples: Sequence[str] = (), is_code: bool | None = None, route_score: float | None = None) -> Signals:
    """Compute the signals for an edge answer (runs its code in the sandbox when the prompt has examples)."""
    code = is_code if is_code is not None else ("```" in answer or "def " in answer)
    examples = check_examples(prompt, answer) if code else None
    summary = logprobs if isinstance(logprobs, dict) else logprob_summary(list(logprobs))
    agreement = None
    if samples:
        norm = normalise(answer)
        agreement = sum(normalise(s) == norm for s in samples) / len(samples)
    return Signals(examples, finish_reason == "length", dict(summary), agreement, route_score)


@dataclass
class ConfidenceCheck:
    """``p_good(signals)``; ``escalate`` when it is below ``threshold``."""

    threshold: float = 0.5
    min_mean_logprob: float = -0.35
    coef: list[float] | None = None
    intercept: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)
    #: The check fitted without the logprob signals, for edge runtimes that give none
    #: (:meth:`for_backend`); None: such answers are judged by the rule.
    without_logprobs: ConfidenceCheck | None = None

    def for_backend(self, supports_logprobs: bool) -> ConfidenceCheck:
        """The check to use on answers of a backend that does (or does not) give token logprobs.

        A check fitted with logprobs would read absent logprobs as certainty (a logprob of 0);
        without them, the variant fitted on the other signals judges, else the rule, which
        then decides on the examples and truncation alone (no logprob: no evidence either way).
        """
        if supports_logprobs or self.coef is None and self.without_logprobs is None:
            return self
        if self.without_logprobs is not None:
            return self.without_logprobs
        return ConfidenceCheck(threshold=0.5, min_mean_logprob=float("-inf"))

    def to_json(self) -> dict[str, Any]:
        """A reviewable JSON form (format ``edgecloud.router.confidence/1``)."""
        out = {"format": CHECK_FORMAT, "threshold": self.threshold, "min_mean_logprob": self.min_mean_logprob,
               "signals": list(SIGNAL_NAMES), "coef": self.coef, "intercept": self.intercept, "notes": self.notes}
        if self.without_logprobs is not None:
            out["without_logprobs"] = self.without_logprobs.to_json()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ConfidenceCheck:
        if data.get("format") != CHECK_FORMAT:
            raise ValueError(f"not a confidence check file (format {data.get('format')!r}, want {CHECK_FORMAT!r})")
        coef = data.get("coef")
        if coef is not None and len(coef) != len(SIGNAL_NAMES):
            raise ValueError(f"coef has {len(coef)} values, want {len(SIGNAL_NAMES)}")
        variant = data.get("without_logprobs")
        return cls(threshold=float(data["threshold"]), min_mean_logprob=float(data.get("min_mean_logprob", -0.35)),
                   coef=[float(c) for c in coef] if coef is not None else None,
                   intercept=float(data.get("intercept", 0.0)), notes=dict(data.get("notes") or {}),
                   without_logprobs=cls.from_json(variant) if isinstance(variant, dict) else None)

    @classmethod
    def packaged(cls) -> ConfidenceCheck:
        """The check fitted on the committed outcome data, or the default rule when it cannot load."""
        try:
            text = resources.files("edgecloud.router").joinpath("data", PACKAGED_CHECK).read_text(encoding="utf-8")
            return cls.from_json(json.loads(text))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.info("no fitted confidence check (%s); using the default rule", exc)
            return cls()

    def p_good(self, s: Signals) -> float:
        if self.coef is None:
            if s.examples is False or s.truncated:
                return 0.0
            if s.examples is True:
                return 1.0
            return 1.0 if s.logprob.get("mean", 0.0) >= self.min_mean_logprob else 0.0
        z = self.intercept + sum(c * v for c, v in zip(self.coef, s.vector()))
        return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))

    def escalate(self, s: Signals) -> bool:
        return self.p_good(s) < self.threshold

    def fit(self, rows: Sequence[dict[str, Any]], row_signals: Sequence[Signals],
            use: Sequence[str] | None = None) -> ConfidenceCheck:
        """Fit the logistic model on outcome rows and their signals.

        The label is "good enough": the edge passed, or the cloud failed as well.

        ``use`` limits the model to those of :data:`SIGNAL_NAMES` (the others get weight 0), to
        measure what each signal adds.
        """
        import numpy as np
        from sklearn.linear_model import LogisticRegression

        names = list(SIGNAL_NAMES) if use is None else [n for n in SIGNAL_NAMES if n in set(use)]
        unknown = set(use or ()) - set(SIGNAL_NAMES)
        if unknown or not names:
            raise ValueError(f"unknown or no signals {sorted(unknown)}; choose from {', '.join(SIGNAL_NAMES)}")
        columns = [SIGNAL_NAMES.index(n) for n in names]
        x = np.array([s.vector() for s in row_signals])[:, columns]
        y = np.array([1 if (r["edge_pass"] or not r["cloud_pass"]) else 0 for r in rows])
        if y.min() == y.max():
            raise ValueError("escalating helps on none or all of these outcomes; nothing to fit")
        model = LogisticRegression(C=1.0, max_iter=2000).fit(x, y)
        coef = [0.0] * len(SIGNAL_NAMES)
        for column, value in zip(columns, model.coef_[0]):
            coef[column] = float(value)
        self.coef = coef
        self.intercept = float(model.intercept_[0])
        self.notes = {"fitted_on": len(rows), "signals": names}
        return self
