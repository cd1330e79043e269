"""Router building blocks: sandbox, task grading, features, PII, scorers and the evaluation maths."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from edgecloud.router.training.evaluate import apgr, cpt, oracle_scores, random_scores, router_curve, split_outcomes, summary
from edgecloud.router.features import FEATURE_NAMES, extract, hashed_ngrams
from edgecloud.router.pii import find_pii, has_pii, iban_ok, luhn_ok, redact
from edgecloud.router.sandbox import run_python
from edgecloud.router.scorers import LearnedScorer, RulesScorer, load_scorer
from edgecloud.router.training.fit import train_scorer
from edgecloud.router.training.tasks import extract_code, grade, load_tasks

# ---------------------------------------------------------------- sandbox and grading


def test_sandbox_passes_fails_and_times_out() -> None:
    assert run_python("assert sum(range(4)) == 6").passed
    failed = run_python("assert 1 == 2")
    assert not failed.passed and "AssertionError" in failed.output
    looped = run_python("while True: pass", timeout=1.5)
    assert looped.timed_out and not looped.passed
    assert not run_python("x = bytearray(4 << 30)").passed  # the memory limit holds


def test_every_suite_loads_and_grades_known_answers() -> None:
    tasks = load_tasks()
    suites = {t.suite for t in tasks}
    assert suites == {"humaneval", "code", "math", "facts", "long"}
    assert sum(t.suite == "humaneval" for t in tasks) == 164
    assert len({t.id for t in tasks}) == len(tasks)
    math_task = next(t for t in tasks if t.suite == "math")
    assert grade(math_task, f"... so the answer is\n{math_task.check['answer']}")
    assert not grade(math_task, f"{math_task.check['answer'] + 1}")
    fact = next(t for t in tasks if t.suite == "facts")
    assert grade(fact, f"It is {fact.check['answers'][0].upper()}.")
    assert not grade(fact, "I do not know.")


def test_humaneval_grading_runs_the_real_tests() -> None:
    task = load_tasks(["humaneval"])[0]  # has_close_elements
    body = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
    assert grade(task, f"Here you go:\n```python\n{task.check['before']}{body}```\nDone.")
    assert not grade(task, f"```python\n{task.check['before']}    return False\n```")
    assert not grade(task, "I cannot help with that.")


def test_extract_code_prefers_definition_blocks() -> None:
    answer = "```python\ndef f(x):\n    return x\n```\nUse it:\n```python\nprint(f(2))\n```"
    assert extract_code(answer).strip() == "def f(x):\n    return x"
    assert extract_code("def g(): pass") == "def g(): pass"


# ---------------------------------------------------------------- features


def test_features_are_named_bounded_and_fast_on_odd_input() -> None:
    odd = ["", "x" * 1_000_000, bytes(range(256)).decode("latin-1") * 50, "混合 scripts ünïcode ۱۲۳ 😀" * 200]
    for text in odd:
        f = extract({"messages": [{"role": "user", "content": text}]})
        assert list(f) == list(FEATURE_NAMES)
        assert all(v == v and abs(v) < 1e6 for v in f.values())  # no NaN, no overflow
        hashed_ngrams(text)
    f = extract([{"role": "system", "content": "be brief"}, {"role": "user", "content": "Calculate exactly the "
                 "compound interest on a mortgage loan of 1000 dollars at 5% for 3 years, step by step."}])
    assert f["has_system"] == 1 and f["precision_request"] == 1 and f["domain_finance"] >= 2
    assert f["math_markers"] > 0 and f["reasoning_markers"] > 0
    start = time.perf_counter()
    for _ in range(200):
        extract("Write a Python function that returns the n-th Fibonacci number.")
    assert (time.perf_counter() - start) / 200 < 0.05  # generous: the benchmark measures the real figure


def test_hashed_ngrams_are_stable_and_normalised() -> None:
    a, b = hashed_ngrams("sort the list of numbers"), hashed_ngrams("sort the list of numbers")
    assert a == b and abs(sum(v * v for v in a.values()) - 1.0) < 1e-9
    assert all(0 <= k < 4096 for k in a)


# ---------------------------------------------------------------- PII


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("write to jane.doe@example.com please", "email"),
        ("call +44 20 7946 0958 tomorrow", "phone"),
        ("my card is 4111 1111 1111 1111", "card"),
        ("IBAN GB82 WEST 1234 5698 7654 32", "iban"),
        ("SSN 123-45-6789", "ssn"),
        ("NI number AB 12 34 56 C", "uk_nino"),
        ("passport no. X1234567", "national_id"),
    ],
)
def test_pii_kinds_are_found(text: str, kind: str) -> None:
    assert kind in has_pii(text)


def test_checksums_keep_ordinary_numbers_out() -> None:
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")
    assert iban_ok("GB82WEST12345698765432") and not iban_ok("GB83WEST12345698765432")
    for text in ["order 4111 1111 1111 1112", "def f(x):\n    return x * 1000000", "on 2024-05-01 at 10.20.30.40",
                 "the value 3.14159265358979", "version 1.2.3 of the API"]:
        assert has_pii(text) == [], text


def test_redaction_round_trip_keeps_one_placeholder_per_value() -> None:
    texts = ["Email jane@example.com and card 4111 1111 1111 1111.", "Again: jane@example.com"]
    redacted, red = redact(texts)
    assert "jane@example.com" not in "".join(redacted) and "4111" not in "".join(redacted)
    assert redacted[1] == "Again: [EMAIL_1]"
    assert [red.restore(t) for t in redacted] == texts
    answer = "I will write to [EMAIL_1] about card [CARD_1]."
    assert red.restore(answer) == "I will write to jane@example.com about card 4111 1111 1111 1111."
    assert [f.kind for f in find_pii(texts[0])] == ["email", "card"]


# ---------------------------------------------------------------- evaluation maths


def _synthetic(n: int, seed: int, edge_only: bool) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        cloud = rng.random() < 0.75
        edge = rng.random() < 0.45 and (cloud or edge_only)
        rows.append({"id": f"t{i}", "suite": "s", "edge_pass": edge, "cloud_pass": cloud,
                     "messages": [{"role": "user", "content": f"task {i}"}]})
    return rows


def test_random_router_scores_about_half_and_oracle_matches_the_closed_form() -> None:
    rows = _synthetic(3000, 1, edge_only=False)  # the cloud wins wherever the edge does
    wins = sum(r["cloud_pass"] and not r["edge_pass"] for r in rows) / len(rows)
    assert abs(apgr(router_curve(rows, oracle_scores(rows))) - (1 - wins / 2)) < 1e-9
    rand = [apgr(router_curve(rows, random_scores(rows, s))) for s in range(10)]
    assert abs(sum(rand) / len(rand) - 0.5) < 0.02
    # All-equal scores are one tie group: the expected curve is the straight line, APGR 0.5 exactly.
    assert abs(apgr(router_curve(rows, [0.0] * len(rows))) - 0.5) < 1e-9


def test_curve_endpoints_cpt_and_summary() -> None:
    rows = _synthetic(400, 2, edge_only=True)
    scores = oracle_scores(rows)
    curve = router_curve(rows, scores)
    edge_q = sum(r["edge_pass"] for r in rows) / len(rows)
    cloud_q = sum(r["cloud_pass"] for r in rows) / len(rows)
    assert curve[0] == (0.0, pytest.approx(edge_q)) and curve[-1] == (1.0, pytest.approx(cloud_q))
    assert 0 < cpt(curve, 0.5) < cpt(curve, 0.8) < 1
    out = summary(rows, scores)
    assert out["apgr"] > out["random_apgr"] and abs(out["random_apgr"] - 0.5) < 0.06
    assert {"apgr", "cpt50", "cpt80", "random_apgr", "edge_quality", "cloud_quality", "curve"} <= set(out)


def test_split_is_disjoint_seeded_and_stratified() -> None:
    rows = _synthetic(300, 3, edge_only=True)
    train, test = split_outcomes(rows, 0.3, seed=5)
    assert {r["id"] for r in train}.isdisjoint({r["id"] for r in test})
    assert len(train) + len(test) == 300 and 80 <= len(test) <= 100
    assert [r["id"] for r in split_outcomes(rows, 0.3, seed=5)[1]] == [r["id"] for r in test]


# ---------------------------------------------------------------- scorers


def test_rules_scorer_follows_the_formula() -> None:
    rules = RulesScorer()
    assert rules.score("Write a function that adds two numbers.") == 0.0
    assert rules.score("Give the exact figure, precisely to 2 decimal places.") == pytest.approx(0.3)
    long_text = "word " * 6000
    assert rules.score(long_text) == pytest.approx(0.4)
    assert rules.score("Exactly what dose of this medication treats the infection in a patient? " + long_text) == 1.0


def test_learned_scorer_trains_round_trips_and_ranks(tmp_path: Path) -> None:
    # Synthetic outcomes with a learnable signal: the edge fails the 'graph' tasks.
    rng = random.Random(4)
    rows = []
    for i in range(160):
        hard = i % 2 == 0
        text = ("Implement Dijkstra shortest paths on a weighted graph with edge cases" if hard
                else "Return the sum of two numbers") + f" #{rng.randint(0, 999)}"
        rows.append({"messages": [{"role": "user", "content": text}], "max_tokens": 256,
                     "edge_pass": (not hard) if rng.random() < 0.9 else hard, "cloud_pass": True})
    model = train_scorer(rows, hash_dim=512)
    path = tmp_path / "scorer.json"
    path.write_text(json.dumps(model))
    scorer = load_scorer("learned", path)
    assert isinstance(scorer, LearnedScorer)
    assert scorer.score("Implement Dijkstra shortest paths on a weighted graph") > 0.6
    assert scorer.score("Return the sum of two numbers") < 0.4
    assert 0.0 <= scorer.score("") <= 1.0


def test_model_selection_keeps_ngrams_only_where_they_carry_the_signal() -> None:
    # The same sentence shape either way; only the animal named decides who wins. The dense
    # features cannot tell the two apart, the hashed n-grams can.
    rng = random.Random(5)
    rows = []
    for i in range(120):
        animal = "zebra" if i % 2 else "horse"  # same length: no size feature tells them apart
        text = f"Write a short poem about a {animal} that lives in the city number {rng.randint(10, 99)}."
        rows.append({"messages": [{"role": "user", "content": text}], "max_tokens": 128,
                     "edge_pass": animal == "horse", "cloud_pass": True})
    model = train_scorer(rows, hash_dim=256)
    assert model["hash_dim"] == 256 and model["coef_hashed"]
    assert model["cv_apgr"] > 0.74  # the oracle here: 1 - (share of cloud-only wins = 0.5) / 2 = 0.75
    scorer = LearnedScorer(model)
    assert scorer.score(rows[1]) > scorer.score(rows[0])  # zebra (edge fails) above horse
    plain = train_scorer(rows, hash_dim=256, ngrams=False)
    assert plain["hash_dim"] == 0 and plain["coef_hashed"] == {}
    assert LearnedScorer(plain).score(rows[1]) == pytest.approx(LearnedScorer(plain).score(rows[3]), abs=0.05)


def test_broken_or_missing_model_falls_back_to_rules(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "edgecloud.router.logistic/1", "features": [')
    for path in (broken, tmp_path / "missing.json"):
        with caplog.at_level("WARNING"):
            scorer = load_scorer("learned", path)
        assert isinstance(scorer, RulesScorer)
    assert "rules scorer" in caplog.text
    with pytest.raises(ValueError, match="unknown scorer"):
        load_scorer("magic")
