"""Function calling and JSON extraction through the public client: who writes a call, at what cost.

The corpus (``tasks``: generated from a fixed seed, written to
``benchmarks/data/function_calling.json``): 160 tool tasks in four families of 40 — ``typed``
(one tool offered, one call with typed arguments), ``choose`` (five tools offered, one fits),
``nested`` (nested objects, enums and arrays in the arguments), ``no_call`` (tools offered, a
question no tool answers) — and 60 ``json_extract`` tasks (a ``json_schema`` answer pulled from a
sentence). Every value the answer needs is in the prompt; grading is exact: the function's name
and its arguments (parsed JSON; numbers by value, strings as written) or the JSON object; for
``no_call``, no call at all. ``valid``: every call names a declared function with arguments its
schema accepts; every JSON answer parses and validates (judged on answers that finished: one cut
short by ``max_tokens`` — 48 tokens for ``no_call``, where only whether a call opens matters — is
counted in ``cut_short``).

``run`` answers every task with each policy through the public client (0.5B edge, a real
``edgecloud serve`` with the 1.5B, greedy): ``all-cloud`` and ``all-edge`` (pinned),
``one-side`` (``collab="off"``: the router picks a side, what the defaults did before tool calls
and JSON were verified) and ``verified`` (the defaults: both sides held to the grammar). Each
answer records the server's own forward passes (``edgecloud:forward_passes_total``), what the
client billed, and the seconds. ``report`` prints accuracy and validity by family, passes
against all-cloud, and the default chosen held out by family: for each family, the cheapest
policy whose accuracy on the other families is at least 95 % of all-cloud's, scored on that
family. Writes ``benchmarks/results/function_calling.json``.

Run: ``python benchmarks/function_calling.py tasks`` then ``run [--limit N]`` then ``report``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

DATA = Path(__file__).parent / "data" / "function_calling.json"
RESULTS = Path(__file__).parent / "results" / "function_calling.json"
RUNS = Path(__file__).parent / "results" / "function_calling_runs.jsonl"
EDGE_MODEL = "qwen2.5-coder-0.5b-instruct-q4"
CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct-q4"
#: In the order each task is answered: the same prompt for all (answers compare exactly), so the
#: server's prefix cache favours the later ones; verified goes first (its passes are not flattered).
POLICIES: dict[str, dict[str, Any]] = {
    "verified": {},  # the defaults
    "all-cloud": {"route": "cloud", "collab": "off"},
    "one-side": {"collab": "off"},
    "all-edge": {"route": "edge", "collab": "off"},
}
#: Accuracy a default must keep, as a share of all-cloud's (held out by family).
QUALITY_TARGET = 0.95

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Denver", "Hanoi", "Porto", "Quito", "Perth", "Bern", "Dakar"]
NAMES = [("Ana", "Lima"), ("Tom", "Baker"), ("Mei", "Chen"), ("Omar", "Haddad"), ("Eva", "Novak"),
         ("Raj", "Patel"), ("Lena", "Vogel"), ("Yuki", "Sato"), ("Carl", "Berg"), ("Nia", "Okafor")]
CURRENCIES = ["USD", "EUR", "JPY", "GBP", "CHF", "BRL"]
STOCKS = ["AAPL", "MSFT", "NVDA", "TSLA", "AMZN", "IBM"]
LANGUAGES = ["french", "german", "spanish", "italian"]
PHRASES = ["good morning", "thank you very much", "where is the station", "the bill, please", "see you tomorrow"]
RESTAURANTS = ["Blue Door", "Casa Verde", "The Olive", "Sakura", "Le Petit"]


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required or list(props)}


S, I, N = {"type": "string"}, {"type": "integer"}, {"type": "number"}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def _tool(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS = {
    "get_weather": _tool("get_weather", "Current weather in a city", _obj({"city": S, "unit": _enum("celsius", "fahrenheit")})),
    "convert_currency": _tool("convert_currency", "Convert an amount between currencies",
                              _obj({"amount": N, "from_currency": S, "to_currency": S})),
    "set_timer": _tool("set_timer", "Start a countdown timer", _obj({"minutes": I, "label": S})),
    "send_email": _tool("send_email", "Send an email", _obj({"to": S, "subject": S})),
    "book_table": _tool("book_table", "Reserve a restaurant table", _obj({"restaurant": S, "people": I, "time": S})),
    "get_stock_price": _tool("get_stock_price", "Latest price of a stock", _obj({"symbol": S})),
    "translate": _tool("translate", "Translate a phrase", _obj({"text": S, "target_language": _enum(*LANGUAGES)})),
    "search_flights": _tool("search_flights", "Find flights between two cities on a date",
                            _obj({"origin": S, "destination": S, "date": S})),
    "create_event": _tool("create_event", "Put an event in the calendar", _obj({
        "title": S, "when": _obj({"date": S, "time": S}), "priority": _enum("low", "normal", "high")})),
    "ship_package": _tool("ship_package", "Ship a package", _obj({
        "recipient": _obj({"name": S, "city": S, "zip": S}), "speed": _enum("standard", "express", "overnight")})),
    "add_contact": _tool("add_contact", "Add someone to the address book", _obj({
        "person": _obj({"first_name": S, "last_name": S}), "phone": S,
        "tags": {"type": "array", "items": _enum("family", "work", "friend")}})),
    "set_thermostat": _tool("set_thermostat", "Set a room's thermostat", _obj({
        "room": _enum("kitchen", "bedroom", "living_room"),
        "settings": _obj({"temperature": I, "mode": _enum("heat", "cool", "auto")})})),
}
FLAT = ["get_weather", "convert_currency", "set_timer", "send_email", "book_table", "get_stock_price", "translate",
        "search_flights"]
NESTED = ["create_event", "ship_package", "add_contact", "set_thermostat"]


def _flat_call(name: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A request for ``name`` in words and the call that answers it."""
    if name == "get_weather":
        city, unit = rng.choice(CITIES), rng.choice(["celsius", "fahrenheit"])
        return f"What's the weather in {city} right now? Give it in {unit}.", {"city": city, "unit": unit}
    if name == "convert_currency":
        amount, (a, b) = rng.choice([25, 120, 75.5, 1000, 9.99]), rng.sample(CURRENCIES, 2)
        return f"How much is {amount} {a} in {b}?", {"amount": amount, "from_currency": a, "to_currency": b}
    if name == "set_timer":
        minutes, label = rng.choice([3, 5, 12, 25, 45]), rng.choice(["tea", "pasta", "laundry", "break", "oven"])
        return f"Set a {minutes} minute timer called {label}.", {"minutes": minutes, "label": label}
    if name == "send_email":
        first, _ = rng.choice(NAMES)
        to, subject = f"{first.lower()}@example.com", rng.choice(["Lunch", "Invoice", "Meeting notes", "Trip"])
        return f"Email {to} with the subject {subject}.", {"to": to, "subject": subject}
    if name == "book_table":
        place, people, at = rng.choice(RESTAURANTS), rng.choice([2, 3, 4, 6]), rng.choice(["19:00", "20:30", "12:15"])
        return f"Book a table at {place} for {people} people at {at}.", {"restaurant": place, "people": people, "time": at}
    if name == "get_stock_price":
        symbol = rng.choice(STOCKS)
        return f"What is the latest price of {symbol} stock?", {"symbol": symbol}
    if name == "translate":
        text, lang = rng.choice(PHRASES), rng.choice(LANGUAGES)
        return f"Translate '{text}' into {lang}.", {"text": text, "target_language": lang}
    origin, dest = rng.sample(CITIES, 2)
    date = f"2027-0{rng.randint(1, 9)}-{rng.randint(10, 28)}"
    return f"Find flights from {origin} to {dest} on {date}.", {"origin": origin, "destination": dest, "date": date}


def _nested_call(name: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    if name == "create_event":
        title, date = rng.choice(["Dentist", "Team sync", "Yoga", "Budget review"]), f"2027-1{rng.randint(0, 2)}-0{rng.randint(1, 9)}"
        at, priority = rng.choice(["09:00", "14:30", "17:45"]), rng.choice(["low", "normal", "high"])
        return (f"Add '{title}' to my calendar on {date} at {at}, {priority} priority.",
                {"title": title, "when": {"date": date, "time": at}, "priority": priority})
    if name == "ship_package":
        (first, last), city, zip_code = rng.choice(NAMES), rng.choice(CITIES), str(rng.randint(10000, 99999))
        speed = rng.choice(["standard", "express", "overnight"])
        return (f"Ship a package {speed} to {first} {last} in {city}, zip code {zip_code}.",
                {"recipient": {"name": f"{first} {last}", "city": city, "zip": zip_code}, "speed": speed})
    if name == "add_contact":
        (first, last), phone = rng.choice(NAMES), f"+1-555-{rng.randint(1000, 9999)}"
        tags = sorted(rng.sample(["family", "work", "friend"], rng.randint(1, 2)))
        return (f"Add {first} {last} to my contacts, phone {phone}, tagged {' and '.join(tags)}.",
                {"person": {"first_name": first, "last_name": last}, "phone": phone, "tags": tags})
    room, temp, mode = rng.choice(["kitchen", "bedroom", "living_room"]), rng.randint(16, 26), rng.choice(["heat", "cool", "auto"])
    return (f"Set the {room.replace('_', ' ')} thermostat to {temp} degrees in {mode} mode.",
            {"room": room, "settings": {"temperature": temp, "mode": mode}})


NO_CALL_QUESTIONS = [
    "What is the capital of Canada?", "Write a haiku about autumn leaves.", "What does HTTP stand for?",
    "Explain recursion in one sentence.", "Who wrote Romeo and Juliet?", "What is 17 times 3?",
    "Give me a synonym for happy.", "What is the boiling point of water in Celsius at sea level?",
    "Say hello in a friendly way.", "What is a prime number?", "Name three primary colours.",
    "How many days are in a leap year?", "What is the chemical symbol for gold?",
    "Write a Python one-liner that reverses a string s.", "What is the largest planet in our solar system?",
    "Tell me a short joke about programmers.", "What is the square root of 81?",
    "Describe the colour blue to someone in one sentence.", "What is the opposite of 'ancient'?",
    "In which continent is Kenya?",
]

EXTRACTIONS: list[tuple[str, dict[str, Any], Any]] = [
    ("person", _obj({"name": S, "age": I, "city": S}),
     lambda r: (lambda n, a, c: (f"{n} is {a} years old and lives in {c}.", {"name": n, "age": a, "city": c}))(
         " ".join(r.choice(NAMES)), r.randint(19, 80), r.choice(CITIES))),
    ("product", _obj({"name": S, "price": N, "in_stock": {"type": "boolean"}}),
     lambda r: (lambda n, p, s: (f"The {n} costs {p} dollars and is {'in stock' if s else 'sold out'}.",
                                 {"name": n, "price": p, "in_stock": s}))(
         r.choice(["desk lamp", "kettle", "backpack", "keyboard"]), r.choice([19.5, 42, 89.99, 250]), r.random() < 0.5)),
    ("meeting", _obj({"day": _enum("monday", "tuesday", "wednesday", "thursday", "friday"), "hour": I, "room": S}),
     lambda r: (lambda d, h, m: (f"We meet on {d.capitalize()} at {h} o'clock in room {m}.", {"day": d, "hour": h, "room": m}))(
         r.choice(["monday", "tuesday", "wednesday", "thursday", "friday"]), r.randint(8, 17), r.choice(["A1", "B12", "C3"]))),
    ("book", _obj({"title": S, "author": S, "year": I}),
     lambda r: (lambda t, a, y: (f"'{t}' was written by {a} in {y}.", {"title": t, "author": a, "year": y}))(
         *r.choice([("Dune", "Frank Herbert", 1965), ("Emma", "Jane Austen", 1815), ("Ulysses", "James Joyce", 1922),
                    ("Beloved", "Toni Morrison", 1987), ("Solaris", "Stanislaw Lem", 1961)]))),
    ("order", _obj({"item": S, "quantity": I, "express": {"type": "boolean"}}),
     lambda r: (lambda i, q, e: (f"Please send {q} {i}{'' if q == 1 else 's'}{', express' if e else ', no rush'}.",
                                 {"item": i, "quantity": q, "express": e}))(
         r.choice(["mug", "notebook", "cable", "plant"]), r.randint(1, 9), r.random() < 0.5)),
    ("address", _obj({"street": S, "city": S, "country": S}),
     lambda r: (lambda s, c, k: (f"Ship it to {s}, {c}, {k}.", {"street": s, "city": c, "country": k}))(
         r.choice(["12 Elm Street", "4 Rue Cler", "77 Oak Road"]), *r.choice([("Paris", "France"), ("Lima", "Peru"),
                                                                               ("Oslo", "Norway"), ("Perth", "Australia")]))),
]


def tasks() -> list[dict[str, Any]]:
    """The corpus (see the module docstring), the same every time."""
    rng = random.Random(2026)
    out: list[dict[str, Any]] = []

    def add(family: str, prompt: str, tools: list[str], expected: Any, **extra: Any) -> None:
        out.append({"id": f"{family}/{len([t for t in out if t['family'] == family]):03d}", "family": family,
                    "messages": [{"role": "user", "content": prompt}], "tools": [TOOLS[t] for t in tools],
                    "expected": expected, **extra})

    for i in range(40):
        name = FLAT[i % len(FLAT)]
        prompt, args = _flat_call(name, rng)
        add("typed", prompt, [name], {"name": name, "arguments": args})
    for i in range(40):
        name = FLAT[i % len(FLAT)]
        prompt, args = _flat_call(name, rng)
        offered = rng.sample([t for t in FLAT + NESTED if t != name], 4) + [name]
        rng.shuffle(offered)
        add("choose", prompt, offered, {"name": name, "arguments": args})
    for i in range(40):
        name = NESTED[i % len(NESTED)]
        prompt, args = _nested_call(name, rng)
        add("nested", prompt, [name], {"name": name, "arguments": args})
    for i in range(40):
        offered = rng.sample(FLAT + NESTED, 3)
        add("no_call", NO_CALL_QUESTIONS[i % len(NO_CALL_QUESTIONS)] + ("" if i < 20 else " Answer briefly."), offered,
            None)
    for i in range(60):
        name, schema, make = EXTRACTIONS[i % len(EXTRACTIONS)]
        text, obj = make(rng)
        out.append({"id": f"json_extract/{i:03d}", "family": "json_extract", "tools": [],
                    "messages": [{"role": "user", "content": f"Extract the {name} from this text as JSON: {text}"}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
                    "expected": obj})
    return out


def _same(a: Any, b: Any) -> bool:
    """Exact match of parsed JSON: numbers by value (20 == 20.0, but a bool is no number), strings as written."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def grade(task: dict[str, Any], content: str | None, calls: list[tuple[str, str]]) -> tuple[bool, bool]:
    """(exact, valid) for an answer: its text and its calls as (name, arguments JSON)."""
    import jsonschema

    if task["family"] == "json_extract":
        try:
            got = json.loads(content or "")
            jsonschema.validate(got, task["response_format"]["json_schema"]["schema"])
        except (ValueError, jsonschema.ValidationError):
            return False, False
        return _same(got, task["expected"]), True
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in task["tools"]}
    parsed = []
    for name, arguments in calls:
        try:
            args = json.loads(arguments)
            jsonschema.validate(args, schemas[name])
        except (ValueError, KeyError, jsonschema.ValidationError):
            return False, False
        parsed.append((name, args))
    if task["expected"] is None:
        return not parsed, True
    want = task["expected"]
    return len(parsed) == 1 and parsed[0][0] == want["name"] and _same(parsed[0][1], want["arguments"]), True


def cmd_tasks(_: argparse.Namespace) -> None:
    corpus = tasks()
    DATA.write_text(json.dumps(corpus, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({f: sum(t["family"] == f for t in corpus) for f in dict.fromkeys(t["family"] for t in corpus)}))


def _cap(task: dict[str, Any]) -> int:
    """``max_tokens`` for a task: a call opens the answer, so 48 tokens tell whether one comes
    (``no_call``); calls and JSON get room to finish."""
    return 48 if task["family"] == "no_call" else 160


def _cut(row: dict[str, Any]) -> bool:
    """Whether the answer was cut short by ``max_tokens`` (a call or JSON cut short is not judged
    for validity: the grammar holds what is written, not where ``max_tokens`` stops it)."""
    if "finish" in row:
        return bool(row["finish"] == "length")
    return bool(row["tokens"] >= (48 if row["family"] == "no_call" else 160))


def _answer(client: Any, task: dict[str, Any], policy: str) -> dict[str, Any]:
    params: dict[str, Any] = {**POLICIES[policy], "temperature": 0, "max_tokens": _cap(task)}
    if task["tools"]:
        params["tools"] = task["tools"]
    if task.get("response_format"):
        params["response_format"] = task["response_format"]
    started = time.perf_counter()
    try:
        answer = client.chat.completions.create(messages=task["messages"], **params)
    except Exception as exc:  # noqa: BLE001 - counted: the bar is that nothing raises
        return {"raised": f"{type(exc).__name__}: {exc}"[:300]}
    message = answer.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    exact, valid = grade(task, message.content, calls)
    return {"exact": exact, "valid": valid, "finish": answer.choices[0].finish_reason,
            "seconds": time.perf_counter() - started, "collab": answer.route.collab,
            "side": answer.route.target, "client_passes": answer.cost.cloud_passes if answer.cost else 0,
            "billed": answer.cost.vs_all_cloud if answer.cost else None,
            "cloud_tokens": answer.route.tokens.get("cloud", 0), "tokens": answer.usage.completion_tokens,
            "calls": calls, "content": (message.content or "")[:200],
            "text_sha": hashlib.sha256(json.dumps([message.content, calls]).encode()).hexdigest()[:16]}


def cmd_run(args: argparse.Namespace) -> None:
    from _live import _server_passes, _start_server

    from edgecloud import EdgeCloud
    from edgecloud.edge.llamacpp import LlamaCppBackend
    from edgecloud.store import resolve_model

    corpus = json.loads(DATA.read_text(encoding="utf-8"))
    runs = Path(args.runs)
    done = set()
    if runs.exists():
        done = {(r["id"], r["policy"]) for r in map(json.loads, runs.read_text(encoding="utf-8").splitlines())}
    picked: list[dict[str, Any]] = []
    for family in dict.fromkeys(t["family"] for t in corpus):
        picked += [t for t in corpus if t["family"] == family][: args.limit or None]
    cloud_path = Path(resolve_model(args.cloud_model))
    server, port = _start_server(str(cloud_path), split=False)
    try:  # (edgecloud serve names a model file by its stem)
        with LlamaCppBackend(str(resolve_model(args.edge_model)), n_ctx=4096) as edge, \
                EdgeCloud(edge_backend=edge, cloud_base_url=f"http://127.0.0.1:{port}/v1", cloud_model=cloud_path.stem,
                          config={"fallback": {"timeout_s": 300}, "router": {"pii": "off"}}) as client, \
                runs.open("a", encoding="utf-8") as log:  # (the e-mail addresses in the tasks are not private)
            for i, task in enumerate(picked):
                for policy in POLICIES:
                    if (task["id"], policy) in done:
                        continue
                    before = _server_passes(port)
                    row = _answer(client, task, policy)
                    time.sleep(0.2)  # a closed answer's last step lands on the counter
                    row.update(id=task["id"], family=task["family"], policy=policy,
                               server_passes=_server_passes(port) - before)
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                print(f"{i + 1}/{len(picked)} {task['id']}", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(30)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy, validity and cost by policy and family, and the default held out by family."""
    by = {(r["id"], r["policy"]): r for r in rows}
    ids = sorted({r["id"] for r in rows if all((r["id"], p) in by for p in POLICIES)})
    families = sorted({i.split("/")[0] for i in ids})

    def stats(policy: str, fams: list[str]) -> dict[str, Any]:
        mine = [by[(i, policy)] for i in ids if i.split("/")[0] in fams]
        cloud = [by[(i, "all-cloud")] for i in ids if i.split("/")[0] in fams]
        ok = [r for r in mine if "raised" not in r]
        finished = [r for r in ok if not _cut(r)]
        passes = sum(r["server_passes"] for r in ok)
        return {"tasks": len(mine), "raised": len(mine) - len(ok),
                "accuracy": round(sum(r["exact"] for r in ok) / max(1, len(mine)), 4),
                "valid": round(sum(r["valid"] for r in finished) / max(1, len(finished)), 4),
                "cut_short": len(ok) - len(finished),
                "passes_vs_all_cloud": round(passes / max(1.0, sum(c["server_passes"] for c in cloud if "raised" not in c)), 4),
                "billed_p50": round(statistics.median([r["billed"] or 0.0 for r in ok]), 4) if ok else None,
                "same_answer_as_all_cloud": round(sum(r["text_sha"] == c.get("text_sha") for r, c in zip(mine, cloud)
                                                      if "raised" not in r) / max(1, len(ok)), 4),
                "seconds_p50": round(statistics.median([r["seconds"] for r in ok]), 3) if ok else None}

    table = {p: {"all": stats(p, families), **{f: stats(p, [f]) for f in families}} for p in POLICIES}
    for p in POLICIES:
        for key, s in table[p].items():
            s["accuracy_vs_all_cloud"] = round(s["accuracy"] / max(1e-9, table["all-cloud"][key]["accuracy"]), 4)
    held_out = {}
    for family in families:
        rest = [f for f in families if f != family]
        fits = []
        for p in POLICIES:
            s, c = stats(p, rest), stats("all-cloud", rest)
            if s["accuracy"] >= QUALITY_TARGET * c["accuracy"]:
                fits.append((s["passes_vs_all_cloud"], p))
        choice = min(fits)[1] if fits else "all-cloud"
        scored = table[choice][family]
        held_out[family] = {"chosen": choice, "accuracy_vs_all_cloud": scored["accuracy_vs_all_cloud"],
                            "passes_vs_all_cloud": scored["passes_vs_all_cloud"], "valid": scored["valid"]}
    chosen = {v["chosen"] for v in held_out.values()}
    return {"tasks": len(ids), "families": {f: sum(i.startswith(f + "/") for i in ids) for f in families},
            "policies": table, "held_out": held_out, "default_held_out": sorted(chosen)}


def cmd_report(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in Path(args.runs).read_text(encoding="utf-8").splitlines()]
    out = {"edge": EDGE_MODEL, "cloud": CLOUD_MODEL, **summarize(rows)}
    if args.write:
        RESULTS.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: out[k] for k in ("tasks", "families", "held_out", "default_held_out")}, indent=1))
    for p, s in out["policies"].items():
        print(p, json.dumps(s["all"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("tasks")
    run = sub.add_parser("run")
    run.add_argument("--limit", type=int, default=0, help="tasks per family (0: all)")
    run.add_argument("--runs", default=str(RUNS), help="where each answer is appended (a run resumes from it)")
    run.add_argument("--edge-model", default=EDGE_MODEL)
    run.add_argument("--cloud-model", default=CLOUD_MODEL)
    report = sub.add_parser("report")
    report.add_argument("--runs", default=str(RUNS))
    report.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args()
    {"tasks": cmd_tasks, "run": cmd_run, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
