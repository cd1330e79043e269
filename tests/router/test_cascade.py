"""The cascade's confidence check on real answers' code, run in the sandbox."""

from __future__ import annotations

import random

from edgecloud.router.cascade import ConfidenceCheck, Signals, check_examples, prompt_examples, signals

PROMPT = '''def add(a, b):
    """Add two numbers.
    >>> add(2, 3)
    5
    >>> add(-1, 1)
    0
    """
Also add(10, 5) == 15.
'''


def test_examples_are_read_from_doctests_and_text() -> None:
    assert prompt_examples(PROMPT) == [("add(2, 3)", "5"), ("add(-1, 1)", "0"), ("add(10, 5)", "15")]
    assert prompt_examples("Write a poem about the sea.") == []


def test_answers_are_checked_against_the_examples() -> None:
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    assert check_examples(PROMPT, good) is True
    assert check_examples(PROMPT, bad) is False
    assert check_examples(PROMPT, "```python\ndef add(a, b) return\n```") is False
    assert check_examples("Write a haiku.", good) is None


def test_default_rule_escalates_failures_truncation_and_low_confidence() -> None:
    check = ConfidenceCheck()
    good = signals(PROMPT, "```python\ndef add(a, b):\n    return a + b\n```", finish_reason="stop", logprobs=[-2.0])
    assert good.examples is True and not check.escalate(good)
    bad = signals(PROMPT, "```python\ndef add(a, b):\n    return a * b\n```", finish_reason="stop", logprobs=[-0.01])
    assert check.escalate(bad)
    cut = signals("Explain.", "Because", finish_reason="length", logprobs=[-0.01])
    assert cut.truncated and check.escalate(cut)
    assert check.escalate(Signals(None, False, {"mean": -1.2}))
    assert not check.escalate(Signals(None, False, {"mean": -0.05}))
    agree = signals("Capital of France?", "Paris", finish_reason="stop", samples=["Paris", " paris", "Lyon"])
    assert abs(agree.agreement - 2 / 3) < 1e-9


def test_fitted_check_learns_which_signal_matters() -> None:
    rng = random.Random(0)
    rows, sigs = [], []
    for _ in range(300):
        passed = rng.random() < 0.5
        ex = passed if rng.random() < 0.9 else not passed
        rows.append({"edge_pass": passed, "cloud_pass": True})
        sigs.append(Signals(ex, False, {"mean": rng.uniform(-1, 0), "min": -3, "p10": -1, "tail_mean": -2}))
    check = ConfidenceCheck().fit(rows, sigs)
    assert check.p_good(Signals(True, False, {"mean": -0.5})) > 0.7
    assert check.p_good(Signals(False, False, {"mean": -0.5})) < 0.3


def test_fitted_check_escalates_only_where_the_cloud_would_do_better() -> None:
    # The edge always fails; the cloud passes exactly on the requests the router scored high.
    # Escalating a task both sides fail gains nothing, so those answers count as good enough.
    rng = random.Random(1)
    rows, sigs = [], []
    for _ in range(300):
        score = rng.random()
        rows.append({"edge_pass": False, "cloud_pass": score > 0.5})
        sigs.append(Signals(None, False, {"mean": rng.uniform(-1, 0)}, route_score=score))
    check = ConfidenceCheck().fit(rows, sigs)
    assert check.p_good(Signals(None, False, {"mean": -0.5}, route_score=0.9)) < 0.2
    assert check.p_good(Signals(None, False, {"mean": -0.5}, route_score=0.1)) > 0.8


def _synthetic_rows(n: int = 120, seed: int = 0) -> list[dict]:
    """Outcome rows whose edge answers fail exactly when a stated example fails or the answer is cut."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = rng.choice(["good", "wrong", "cut"])
        answer = {"good": "```python\ndef add(a, b):\n    return a + b\n```",
                  "wrong": "```python\ndef add(a, b):\n    return a - b\n```",
                  "cut": "```python\ndef add(a, b):\n    return a +"}[kind]
        rows.append({"id": f"t{i}", "suite": "code", "messages": [{"role": "user", "content": PROMPT}],
                     "edge_pass": kind == "good", "cloud_pass": rng.random() < 0.9, "edge_answer": answer,
                     "edge_finish": "length" if kind == "cut" else "stop",
                     "edge_logprob": {"mean": -0.1 - rng.random() * 0.3, "min": -2.0, "p10": -0.8, "tail_mean": -1.2}})
    return rows


def test_cascade_fit_reaches_the_target_with_the_informative_signal() -> None:
    from edgecloud.router.training.cascade_fit import ablation, evaluate_cascade, row_signals
    from edgecloud.router.training.evaluate import split_outcomes

    train, test = split_outcomes(_synthetic_rows())
    s_train, s_test = row_signals(train), row_signals(test)
    zeros_train, zeros_test = [0.5] * len(train), [0.5] * len(test)  # all in the middle band
    result = evaluate_cascade(train, test, s_train, s_test, zeros_train, zeros_test, target=0.95)
    point = result["cascade_all"]["test"]
    # escalating exactly the failed/cut answers keeps cloud-level quality with ~2/3 cloud calls
    assert point["share_of_cloud_quality"] >= 0.95
    assert point["cloud_fraction"] < 0.8
    assert result["banded"]["test"] == point  # every score in the middle band: the same cascade
    check = result["check"]
    assert ConfidenceCheck.from_json(check.to_json()).p_good(s_test[0]) == check.p_good(s_test[0])
    parts = ablation(train, test, s_train, s_test)
    # the logprobs here are noise: alone they cannot beat the examples signal on cloud calls
    assert parts["examples only"]["cloud_fraction"] <= parts["logprob only"]["cloud_fraction"]


def test_a_runtime_without_logprobs_gets_a_check_that_does_not_read_them() -> None:
    confident = Signals(None, False, {"mean": -0.01, "min": -0.1, "p10": -0.05, "tail_mean": -0.02})
    missing = Signals(None, False, {})  # no logprobs: the summary is empty, not "certain"
    plain = ConfidenceCheck(threshold=0.6, coef=[0.0] * 9, intercept=0.0)
    check = ConfidenceCheck(threshold=0.2, coef=[0, 0, 0, 5.0, 0, 0, 0, 0, 0], intercept=0.0, without_logprobs=plain)
    again = ConfidenceCheck.from_json(check.to_json())  # the variant survives the file
    assert again.for_backend(True) is again and not again.escalate(confident)
    assert again.for_backend(False).threshold == 0.6 and again.for_backend(False).escalate(missing)
    # without a fitted variant: the rule, which reads no logprob and has no evidence against the answer
    rule = ConfidenceCheck(threshold=0.2, coef=[0, 0, 0, 5.0, 0, 0, 0, 0, 0]).for_backend(False)
    assert rule.coef is None and not rule.escalate(missing) and rule.escalate(Signals(False, False, {}))
