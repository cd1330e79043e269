"""Tool calls and structured answers on real models: validity, selection and argument accuracy,
and what constrained decoding costs in tokens/s.

The cases (``benchmarks/data/tools.json``, 42 tool prompts and 8 ``json_schema`` prompts, written
for this benchmark): a single tool offered, a choice among six, no tool needed (tools offered
anyway), arguments with nested objects and enums, and follow-ups after a tool result (answer
from the result, or make the next call). Every model runs every case through the llama.cpp
runtime, greedy, ``tool_choice: "auto"``, twice, back to back: with constraints on (the
default: a call, once opened, is held to its function's schema) and off (the same prompts, the
calls only parsed).

Figures per model and setting:

- ``call_validity``: emitted calls that name a declared function with arguments valid under
  its JSON schema; ``schema_validity``: ``json_schema`` answers that parse and validate;
- ``selection_accuracy``: the right function called, or none when none is needed;
  ``argument_accuracy``: of the right calls, those whose arguments hold the expected values
  (a subset, strings compared case-insensitively); ``follow_up_accuracy``: answers after a
  tool result that use it;
- ``tokens_per_s`` over every case, end to end (prompt evaluation included: a tool prompt is
  long and a call short, so this is mostly prefill); ``decode_tokens_per_s`` from the first
  chunk (after the prompt) to the last; ``start_ms``: mean time to that first chunk (the
  grammar's set-up and the prompt); ``constrained_overhead``: 1 - on/off decode tokens/s, also
  with ``tool_choice: "required"`` (the grammar active from the first token) on the call cases
  and for the ``json_schema`` answers, and the set-up it adds (``start_ms_added``).

Run: ``python benchmarks/tools.py`` (both models; ``--models`` to choose, ``--limit`` for a
quick look). Writes ``benchmarks/results/tools.json`` and prints it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import bench_lock, model_path  # noqa: E402

import jsonschema  # noqa: E402

from edgecloud.edge.llamacpp import LlamaCppBackend  # noqa: E402
from edgecloud.types import ChatCompletion, ChatRequest, collect_chunks  # noqa: E402

DATA = Path(__file__).parent / "data" / "tools.json"
RESULTS = Path(__file__).parent / "results" / "tools.json"
MODELS = "qwen2.5-coder-0.5b-instruct-q4,qwen2.5-coder-1.5b-instruct-q4"


@contextlib.contextmanager
def unconstrained() -> Iterator[None]:
    """Constraints off: no grammar for calls or ``json_schema`` answers (the text is only parsed)."""
    import edgecloud.runtime.structured as structured
    import edgecloud.runtime.tool_grammar as grammar

    saved = grammar.tool_grammar, structured.response_grammar
    grammar.tool_grammar = lambda request: None  # type: ignore[assignment]
    structured.response_grammar = lambda fmt: None  # type: ignore[assignment]
    try:
        yield
    finally:
        grammar.tool_grammar, structured.response_grammar = saved


def matches(got: Any, want: Any) -> bool:
    """``want`` is a subset of ``got`` (strings case-insensitive, numbers by value)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and matches(got[k], v) for k, v in want.items())
    if isinstance(want, str):
        return isinstance(got, str) and got.strip().lower() == want.lower()
    if isinstance(want, bool) or isinstance(got, bool):
        return got is want
    if isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and abs(got - want) < 1e-6
    return bool(got == want)


def tool_list(data: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": n, **data["tools"][n]}} for n in names]


def timed(edge: LlamaCppBackend, request: ChatRequest) -> tuple[ChatCompletion, dict[str, float]]:
    """The answer, with its seconds in all, to its first chunk (the runtime yields it once the
    prompt is evaluated: sampler and grammar set up, prefill done) and from there to the end."""
    stamps: list[float] = []

    def stamped() -> Iterator[Any]:
        for chunk in edge.stream(request):
            stamps.append(time.perf_counter())
            yield chunk

    started = time.perf_counter()
    answer = collect_chunks(stamped())
    ended = time.perf_counter()
    return answer, {"seconds": ended - started, "start_seconds": stamps[0] - started,
                    "decode_seconds": ended - stamps[0]}


def run_case(edge: LlamaCppBackend, data: dict[str, Any], case: dict[str, Any], max_tokens: int,
             choice: str = "auto") -> dict[str, Any]:
    messages = [{"role": "user", "content": case["prompt"]}, *case.get("history", [])]
    request = ChatRequest(messages=messages, tools=tool_list(data, case["tools"]), tool_choice=choice,
                          temperature=0, max_tokens=max_tokens)
    answer, times = timed(edge, request)
    message = answer.choices[0].message
    calls = message.tool_calls or []
    valid = 0
    for call in calls:
        spec = data["tools"].get(call.function.name)
        try:
            if spec is not None:
                jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
                valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    first = calls[0] if calls else None
    selected = (first is None) if case["expect"] is None else (first is not None and first.function.name == case["expect"])
    args_ok = None
    if selected and first is not None:
        want = {k: v for k, v in case["args"].items() if not k.startswith("_")}
        args_ok = matches(json.loads(first.function.arguments), want)
    uses_result = None
    if "_text_contains" in case["args"]:
        uses_result = case["args"]["_text_contains"].lower() in (message.content or "").lower()
    return {"calls": len(calls), "valid_calls": valid, "selected": selected, "args_ok": args_ok,
            "uses_result": uses_result, "tokens": answer.usage.completion_tokens, **times,
            "prompt_tokens": answer.usage.prompt_tokens}


def run_structured(edge: LlamaCppBackend, item: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    schema = item["schema"]
    request = ChatRequest(messages=[
        {"role": "system", "content": f"Answer with one JSON object matching this JSON schema: {json.dumps(schema)}"},
        {"role": "user", "content": item["prompt"]}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        temperature=0, max_tokens=max_tokens)
    answer, times = timed(edge, request)
    text = answer.text.strip().removeprefix("```json").removesuffix("```").strip()
    try:
        jsonschema.validate(json.loads(text), schema)
        ok = True
    except (ValueError, jsonschema.ValidationError):
        ok = False
    return {"valid": ok, "finished": answer.choices[0].finish_reason == "stop",
            "tokens": answer.usage.completion_tokens, **times}


def ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def speeds(rows: list[dict[str, Any]], prefix: str = "") -> dict[str, Any]:
    """End-to-end and decode tokens/s of ``rows``, and their mean time to the first chunk."""
    tokens = sum(r["tokens"] for r in rows)
    # the first token comes with the first chunk: the decode rate counts the rest
    decoded = sum(max(0, r["tokens"] - 1) for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    decode_seconds = sum(r["decode_seconds"] for r in rows)
    return {
        f"{prefix}tokens_per_s": round(tokens / seconds, 2) if seconds else None,
        f"{prefix}decode_tokens_per_s": round(decoded / decode_seconds, 2) if decode_seconds else None,
        f"{prefix}start_ms": round(1000 * sum(r["start_seconds"] for r in rows) / len(rows), 1) if rows else None,
    }


def summarise(rows: list[dict[str, Any]], cases: list[dict[str, Any]], structured: list[dict[str, Any]]) -> dict[str, Any]:
    calls = sum(r["calls"] for r in rows)
    right = [r for r in rows if r["args_ok"] is not None]
    follow = [r for r in rows if r["uses_result"] is not None]
    by_kind: dict[str, list[bool]] = {}
    for case, row in zip(cases, rows):
        by_kind.setdefault(case["kind"], []).append(bool(row["selected"]))
    return {
        "cases": len(rows),
        "calls": calls,
        "call_validity": ratio(sum(r["valid_calls"] for r in rows), calls),
        "selection_accuracy": ratio(sum(bool(r["selected"]) for r in rows), len(rows)),
        "selection_by_kind": {k: ratio(sum(v), len(v)) for k, v in by_kind.items()},
        "argument_accuracy": ratio(sum(bool(r["args_ok"]) for r in right), len(right)),
        "follow_up_accuracy": ratio(sum(bool(r["uses_result"]) for r in follow), len(follow)),
        "schema_validity": ratio(sum(s["valid"] for s in structured), len(structured)),
        # an answer cut off by max_tokens cannot be whole JSON, constrained or not
        "schema_validity_of_finished": ratio(sum(s["valid"] for s in structured if s["finished"]),
                                             sum(s["finished"] for s in structured)),
        "structured_cut_by_max_tokens": sum(not s["finished"] for s in structured),
        **speeds(rows),
        **speeds(structured, "structured_"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--structured-max-tokens", type=int, default=160, help="for the json_schema answers")
    parser.add_argument("--limit", type=int, default=None, help="only the first N tool cases and N // 5 structured ones")
    parser.add_argument("--settings", default="on,off", help="constraints on, off or both (on,off: overheads too)")
    parser.add_argument("--every", type=int, default=1, help="every Nth case only (a quicker look, every kind kept)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    data = json.loads(DATA.read_text(encoding="utf-8"))
    cases, structured = data["cases"], data["structured"]
    if args.limit:
        cases, structured = cases[: args.limit], structured[: max(1, args.limit // 5)]
    if args.every > 1:  # every kind keeps its share (the cases are grouped by kind)
        cases, structured = cases[:: args.every], structured[:: args.every]
    report: dict[str, Any] = {"cases": len(cases), "structured_cases": len(structured), "max_tokens": args.max_tokens,
                              "tool_choice": "auto", "models": {}}
    call_cases = [c for c in cases if c["expect"] is not None and "history" not in c][:8]
    with bench_lock():
        for name in args.models.split(","):
            edge = LlamaCppBackend(model_path(name), n_ctx=4096, reuse_prefix=False)  # both settings prefill alike
            try:
                edge.tokenize_chat([{"role": "user", "content": "hi"}])  # load before timing
                # every case with constraints on and off back to back (the order alternating), so
                # a machine that drifts over the run weighs on both settings alike
                settings = args.settings.split(",")
                runs: dict[str, dict[str, list[dict[str, Any]]]] = {setting: {} for setting in settings}
                jobs = [("auto", c, lambda e, c=c: run_case(e, data, c, args.max_tokens)) for c in cases]
                jobs += [("structured", s, lambda e, s=s: run_structured(e, s, args.structured_max_tokens)) for s in structured]
                if len(settings) > 1:  # the speed of the grammar from the first token: a ratio, so both settings
                    jobs += [("required", c, lambda e, c=c: run_case(e, data, c, args.max_tokens, choice="required"))
                             for c in call_cases]
                for i, (kind, _, job) in enumerate(jobs):
                    for setting in (settings if i % 2 == 0 else settings[::-1]):
                        with contextlib.nullcontext() if setting == "on" else unconstrained():
                            runs[setting].setdefault(kind, []).append(job(edge))
                    print(f"tools: {name} {i + 1}/{len(jobs)}", file=sys.stderr, end="\r")
            finally:
                edge.close()
            out: dict[str, Any] = {}
            for setting, got in runs.items():
                summary = summarise(got["auto"], cases, got["structured"])
                required = got.get("required", [])
                summary["required_call_validity"] = ratio(sum(r["valid_calls"] for r in required),
                                                          sum(r["calls"] for r in required))
                summary.update(speeds(required, "required_"))
                out[f"constraints_{setting}"] = summary
                print(f"\ntools: {name} constraints {setting}: {json.dumps(summary)}", file=sys.stderr)
            if len(settings) < 2:
                report["models"][name] = out
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
                continue
            on, off = out["constraints_on"], out["constraints_off"]
            out["constrained_overhead"] = {
                kind: {"decode": round(1 - on[f"{prefix}decode_tokens_per_s"] / off[f"{prefix}decode_tokens_per_s"], 4),
                       "end_to_end": round(1 - on[f"{prefix}tokens_per_s"] / off[f"{prefix}tokens_per_s"], 4),
                       "start_ms_added": round(on[f"{prefix}start_ms"] - off[f"{prefix}start_ms"], 1)}
                for kind, prefix in (("auto", ""), ("required", "required_"), ("json_schema", "structured_"))
            }
            report["models"][name] = out
            args.out.parent.mkdir(parents=True, exist_ok=True)  # after each model: a long run keeps what it measured
            args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
