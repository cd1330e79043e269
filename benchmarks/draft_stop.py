"""Where a verified block should end: replaying draft-stopping rules over traces of real answers.

A check costs the cloud a pass over every drafted token and the user a draft step for each, and
every token after the first the cloud rejects is thrown away (and billed as input). The edge knows
where it is unsure: its probability of its own pick. This benchmark measures what ending a block
after the first drafted token below a confidence floor (``collab.draft_confidence``) gives, against
the block lengths the measured costs favour (the previous rule), and chooses the floor held out by
task family.

Phases:

    python benchmarks/draft_stop.py trace --per-family 8   # the answers, the edge's picks along them
    python benchmarks/draft_stop.py calibrate              # a draft step and a check of k tokens, here
    python benchmarks/draft_stop.py sweep                  # replay the rules -> results/draft_stop.json
    python benchmarks/draft_stop.py opening                # the cloud writing the first N tokens -> *_opening.json

``trace`` answers a sample of the development corpus with the 1.5B alone (greedy, one token at a
time, as ``edgecloud serve`` writes all-cloud), then reads that answer with the 0.5B edge in one
pass: its greedy pick and the probability of it at every position; at each position where its
pick differs from the cloud's, it drafts its own line on from its wrong pick (16 tokens, with their
probabilities). That is everything a block drafted from any position of the answer can hold: the
edge's picks while they agree with the cloud's, then its pick at the first disagreement and its
line after it. ``calibrate`` times, on this machine with both sides on every core (the shared box,
where the sides take turns), a real ``edgecloud serve`` (1.5B, two threads) on loopback: all-cloud's
streamed time per token, and a check of ``k`` drafted tokens in a token session (the last round's
cloud token and the block, one pass); then the edge's draft step (two threads), deep in an answer
and each block after the cloud's token. ``sweep`` replays strict rounds (draft, then the check;
what verified mode runs on a shared box) for each rule over every trace: the user's time as drafted tokens times the draft step
plus each check's cost (plus the round trip), the checks, and the bill (the cloud's input: each
block; its output: one token a check, which the server holds: ``session.keep_verified``), against all-cloud's decode of the
same answer. The floor is chosen leave-one-family-out (of the floors whose checks stay within
``MAX_PASSES`` of all-cloud's passes at p50 on the other families, the one with the lowest
end-to-end p50 there, scored on the held-out family), next to the in-suite figures. ``opening``
replays the same rounds after the cloud has written the answer's first ``N`` tokens itself (a check
without drafts each, ``collab.opening_tokens``), with the edge's read of the prompt (``--read-ms``
a token) before its first block: what the sides taking turns cost a short answer.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "src"))

from _live import _check_ms, _median_ms, _sample, _serve  # noqa: E402
from chat_only import CLOUD_MODEL, EDGE_MODEL, OUTCOMES, RESULTS, _rows  # noqa: E402

TRACES = RESULTS / "draft_stop_traces.jsonl"
CALIBRATION = RESULTS / "draft_stop_calibration.json"
#: Tokens of the edge's own line kept after each of its wrong picks (a block holds at most 15).
LINE = 16
#: The floors swept (0: no floor, the block length the costs favour).
FLOORS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
#: The cloud's forward passes a floor may cost, against all-cloud's (p50; issue 37's bound).
MAX_PASSES = 0.2
#: The bill an opening may reach against all-cloud's at p50 (verified mode's bar).
MAX_BILLED = 0.65
#: USD per million tokens (the client's default prices): input, output.
PRICE_IN, PRICE_OUT = 0.5, 1.5


def _files(edge: str, machine: str = "") -> tuple[Path, Path, str]:
    """The traces, the calibration and the sweep's results for ``edge`` (the published 0.5B's
    files carry no suffix; another edge's carry its name); ``machine``: the calibration and the
    sweep of another machine (their names end in it)."""
    if edge == EDGE_MODEL:
        traces, calibration, stem = TRACES, CALIBRATION, "draft_stop"
    else:
        tag = Path(edge).name.removesuffix(".gguf")
        traces, calibration, stem = (RESULTS / f"draft_stop_traces.{tag}.jsonl",
                                     RESULTS / f"draft_stop_calibration.{tag}.json", f"draft_stop.{tag}")
    if machine:
        calibration, stem = calibration.with_suffix(f".{machine}.json"), f"{stem}.{machine}"
    return traces, calibration, stem


def trace(args: argparse.Namespace) -> None:
    """The published edge's traces hold the cloud's answers too; another edge's trace reuses them
    (the cloud writes the same greedy answer whoever drafts) and only scores them anew."""
    from edgecloud.edge.llamacpp import LlamaCppBackend
    from edgecloud.store import resolve_model

    traces, _, _ = _files(args.edge)
    sample = _sample(_rows(OUTCOMES), args.per_family, args.skip)
    done = {json.loads(line)["id"] for line in traces.read_text().splitlines()} if traces.exists() else set()
    sample = [r for r in sample if r["id"] not in done]
    known = {} if traces == TRACES else {t["id"]: t["cloud"] for t in map(json.loads, TRACES.read_text().splitlines())}
    with LlamaCppBackend(str(resolve_model(CLOUD_MODEL))) as cloud, \
            LlamaCppBackend(str(resolve_model(args.edge))) as edge, traces.open("a", encoding="utf-8") as out:
        for n, row in enumerate(sample):
            started = time.perf_counter()
            prompt = edge.tokenize_chat(row["messages"])
            ids = known.get(row["id"]) or [t for t, _ in cloud.greedy(prompt, row["max_tokens"])]
            scores, _ = edge.score(prompt + ids, start=len(prompt), top_n=1)
            picks = [s.argmax for s in scores]
            lines = {}
            for j, (mine, theirs) in enumerate(zip(picks, ids)):
                if mine != theirs:
                    line = list(edge.greedy(prompt + ids[:j] + [mine], LINE))
                    lines[str(j)] = [[t for t, _ in line], [round(p, 4) for _, p in line]]
            out.write(json.dumps({"id": row["id"], "family": row["suite"], "prompt": len(prompt), "cloud": ids,
                                  "edge": picks, "p": [round(math.exp(s.top[0][1]), 4) for s in scores],
                                  "ends": [i for i, t in enumerate(picks) if edge.is_end(t)],
                                  "lines": lines}) + "\n")
            out.flush()
            print(f"{n + 1}/{len(sample)} {row['id']}: {len(ids)} tokens, {len(lines)} wrong picks, "
                  f"{time.perf_counter() - started:.1f} s", file=sys.stderr)


def calibrate(args: argparse.Namespace) -> None:
    import os

    import openai

    from edgecloud.edge.llamacpp import LlamaCppBackend
    from edgecloud.remote.client import CloudBackend
    from edgecloud.store import resolve_model

    out: dict[str, Any] = {"threads": args.threads, "cloud": CLOUD_MODEL, "edge": args.edge}
    port = 18000 + os.getpid() % 1000
    server = _serve(str(resolve_model(CLOUD_MODEL)), port, args.threads, None)
    try:
        chat = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-")
        steps = []
        for rep in range(3):  # all-cloud: the streamed answer's time per token after the first (its first 320)
            stamps = [time.perf_counter() for chunk in chat.chat.completions.create(
                model=CLOUD_MODEL, max_tokens=320, temperature=0, stream=True,
                messages=[{"role": "user", "content": f"[{rep}] Write a Python module with three functions that "
                                                      "merge, split and rotate sorted lists, with docstrings."}])
                if chunk.choices and chunk.choices[0].delta.content]
            steps.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
        out["cloud_decode_ms"] = _median_ms(steps)
        cloud = CloudBackend(f"http://127.0.0.1:{port}/v1", model=CLOUD_MODEL)
        out["check_ms_by_k"] = _check_ms(cloud, range(args.k_max + 1), args.reps)
        cloud.close()
    finally:
        server.terminate()
        server.wait(30)
    with LlamaCppBackend(str(resolve_model(args.edge)), n_threads=args.threads) as edge:
        prompt = edge.tokenize_chat([{"role": "user", "content": "Write a Python module with three functions that "
                                                                 "merge, split and rotate sorted lists, with docstrings."}])
        answer = edge.draft(prompt, 320)  # rounds as verified mode runs them: deep in an answer, each block after
        drafted, started = 0, time.perf_counter()  # the cloud's token (one step to read it, then the drafts)
        for at in range(200, 312, 8):
            drafted += len(edge.draft(prompt + answer[:at] + [answer[at] + 1], 8))
        out["draft_ms"] = round(1000 * (time.perf_counter() - started) / drafted, 2)
    _files(args.edge, args.machine)[1].write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=1))


def _line(trace: dict[str, Any], start: int) -> Iterator[tuple[float, bool]]:
    """The edge's line drafted from position ``start``: (its probability, whether the cloud keeps it)."""
    cloud, picks, probs = trace["cloud"], trace["edge"], trace["p"]
    for m in range(start, len(cloud)):
        yield probs[m], picks[m] == cloud[m]
        if picks[m] != cloud[m]:
            for p in trace["lines"].get(str(m), [[], []])[1]:
                yield p, False
            return


def _padded(trace: dict[str, Any], start: int) -> Iterator[tuple[float, bool]]:
    """:func:`_line`, and past the traced line after a wrong pick (``LINE`` tokens) the edge taken
    to stay sure and wrong: the most a block longer than the trace could cost."""
    kept = True
    for p, kept in _line(trace, start):
        yield p, kept
    while not kept:
        yield 1.0, False


def replay(trace: dict[str, Any], floor: float, cap: Callable[[float, float], int], cal: dict[str, Any],
           rtt_ms: float, start_ms: float = 0.0, opening: int = 1, read_ms: float = 0.0) -> dict[str, float]:
    """Strict rounds over one answer: its time against all-cloud's, checks, and the bill against
    all-cloud's; ``start_ms``: more edge time at each block's start (reading the cloud's token);
    ``opening``: the cloud writes the first this-many tokens, a check without drafts each
    (``collab.opening_tokens``); ``read_ms``: the edge's read of the prompt and those tokens, a token."""
    from edgecloud.runtime.speculative import Acceptance

    check = {int(k): v for k, v in cal["check_ms_by_k"].items()}
    draft_ms, n, largest = cal["draft_ms"], len(trace["cloud"]), max(check)
    ends = set(trace["ends"])
    # the prompt's check wrote the cloud's first token; each opening check after it, the next one
    # (it sends nothing: the server holds its own tokens, ``session.resumes``)
    written = checks = min(max(1, opening), n)
    ms, sent = (written - 1) * (check[0] + rtt_ms), 0
    if written < n:
        ms += read_ms * (trace["prompt"] + written)
    acceptance, round_ms = Acceptance(0.7), 100.0
    while written < n:
        k_max = min(cap(acceptance.rate, round_ms), n - written)
        block: list[bool] = []
        for p, kept in _padded(trace, written):
            block.append(kept)
            if len(block) >= k_max or p < floor or (kept and written + len(block) - 1 in ends):
                break
        accepted = next((i for i, kept in enumerate(block) if not kept), len(block))
        cost = check[min(len(block), largest)] + rtt_ms
        ms += draft_ms * len(block) + cost + start_ms
        checks, sent = checks + 1, sent + len(block)
        acceptance.observe(len(block), accepted)
        round_ms = 0.7 * round_ms + 0.3 * cost
        written += accepted + 1
    all_cloud_ms = (cal["cloud_decode_ms"] + rtt_ms / max(1, n)) * (n - 1)
    all_cloud_usd = PRICE_IN * trace["prompt"] + PRICE_OUT * n
    return {"e2e": ms / max(all_cloud_ms, 1e-9), "checks": checks, "checks_per_token": checks / n,
            "billed": (PRICE_IN * (trace["prompt"] + sent) + PRICE_OUT * checks) / all_cloud_usd}


def _summary(rows: list[dict[str, float]]) -> dict[str, float]:
    return {"e2e_vs_all_cloud_p50": round(statistics.median(r["e2e"] for r in rows), 3),
            "e2e_vs_all_cloud_mean": round(statistics.fmean(r["e2e"] for r in rows), 3),
            "billed_vs_all_cloud_p50": round(statistics.median(r["billed"] for r in rows), 3),
            "checks_per_answer_p50": statistics.median(r["checks"] for r in rows),
            "server_passes_vs_all_cloud_p50": round(statistics.median(r["checks_per_token"] for r in rows), 3)}


def sweep(args: argparse.Namespace) -> None:
    from edgecloud.runtime.speculative import best_k

    trace_file, calibration, stem = _files(args.edge, args.machine)
    cal = json.loads(calibration.read_text())
    traces = [t for t in map(json.loads, trace_file.read_text().splitlines()) if len(t["cloud"]) > 1]
    families = sorted({t["family"] for t in traces})

    def adaptive(rate: float, round_ms: float) -> int:  # the previous rule: the k the measured costs favour
        return best_k(rate, 15, fixed=round_ms, per_token=cal["draft_ms"])[0]

    caps: dict[str, Callable[[float, float], int]] = {"adaptive k": adaptive}
    measured = max(int(k) for k in cal["check_ms_by_k"])  # blocks up to 15, and longer where checks were timed
    for k_max in sorted({15, *(k for k in (23, 31, 47, 63) if k <= measured)}):
        caps[f"k {k_max}"] = (lambda k: lambda rate, round_ms: k)(k_max)
    out: dict[str, Any] = {"tasks": len(traces), "max_passes": MAX_PASSES, "start_ms": args.start_ms, "families": {f: sum(t["family"] == f for t in traces) for f in families},
                           "calibration": cal, "by_rtt": {}}
    for rtt in args.rtt:
        runs = {(cap, floor): [replay(t, floor, fn, cal, rtt, args.start_ms) for t in traces]
                for cap, fn in caps.items() for floor in FLOORS}
        in_suite = {f"{cap}, floor {floor:g}": _summary(rows) for (cap, floor), rows in runs.items()}
        held: dict[str, Any] = {}
        for cap in caps:
            chosen, rows = {}, []
            for family in families:
                def others(floor: float, key: str) -> float:
                    return statistics.median(r[key] for t, r in zip(traces, runs[(cap, floor)]) if t["family"] != family)
                within = [f for f in FLOORS if others(f, "checks_per_token") <= MAX_PASSES] or list(FLOORS)
                best = min(within, key=lambda f: others(f, "e2e"))
                chosen[family] = best
                rows += [r for t, r in zip(traces, runs[(cap, best)]) if t["family"] == family]
            held[cap] = {"floor_chosen_by_family": chosen, **_summary(rows)}
        out["by_rtt"][f"{rtt:g}"] = {"in_suite": in_suite, "held_out_by_family": held}
        print(f"RTT {rtt:g} ms", json.dumps(held, indent=1))
        for name, row in in_suite.items():
            print(f"  {name:22s} {row}")
    out["agreement_by_probability"] = _agreement(traces)
    name = f"{stem}.json" if not args.start_ms else f"{stem}_start{args.start_ms:g}.json"
    (RESULTS / name).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


#: ``collab.opening_tokens`` replayed by ``opening``.
OPENINGS = (1, 2, 4, 6, 8, 12, 16)


def opening(args: argparse.Namespace) -> None:
    """The cloud writing an answer's first tokens before the edge reads the prompt (strict rounds
    after them at the default floor and ``draft_max``): short answers end at the cloud's pace, long
    ones pay a pass per token opened. Chosen held out by family: of the openings whose checks stay
    within ``MAX_PASSES`` of all-cloud's passes (pooled) and whose bill stays within ``MAX_BILLED``
    at p50 on the other families, the lowest end to end p50 there."""
    from edgecloud.config import CollabSettings

    trace_file, calibration, stem = _files(args.edge, args.machine)
    cal = json.loads(calibration.read_text())
    traces = [t for t in map(json.loads, trace_file.read_text().splitlines()) if len(t["cloud"]) > 1]
    families = sorted({t["family"] for t in traces})
    defaults = CollabSettings()
    floor, k_max = defaults.draft_confidence, defaults.draft_max

    def pooled(rows: list[dict[str, float]], picked: list[dict[str, Any]]) -> float:
        return sum(r["checks"] for r in rows) / sum(len(t["cloud"]) for t in picked)

    out: dict[str, Any] = {"tasks": len(traces), "floor": floor, "draft_max": k_max, "read_ms": args.read_ms,
                           "max_passes": MAX_PASSES, "max_billed": MAX_BILLED, "by_rtt": {}}
    for rtt in args.rtt:
        runs = {n: [replay(t, floor, lambda rate, round_ms: k_max, cal, rtt, args.start_ms, n, args.read_ms)
                    for t in traces] for n in OPENINGS}
        in_suite = {str(n): {**_summary(rows), "server_passes_pooled": round(pooled(rows, traces), 3)}
                    for n, rows in runs.items()}
        chosen, held_rows, held_traces = {}, [], []
        for family in families:
            others = [i for i, t in enumerate(traces) if t["family"] != family]
            def rows_of(n: int, idx: list[int]) -> list[dict[str, float]]:
                return [runs[n][i] for i in idx]
            within = [n for n in OPENINGS
                      if pooled(rows_of(n, others), [traces[i] for i in others]) <= MAX_PASSES
                      and statistics.median(r["billed"] for r in rows_of(n, others)) <= MAX_BILLED] or [1]
            best = min(within, key=lambda n: statistics.median(r["e2e"] for r in rows_of(n, others)))
            chosen[family] = best
            mine = [i for i, t in enumerate(traces) if t["family"] == family]
            held_rows += rows_of(best, mine)
            held_traces += [traces[i] for i in mine]
        held = {"opening_chosen_by_family": chosen, **_summary(held_rows),
                "server_passes_pooled": round(pooled(held_rows, held_traces), 3)}
        out["by_rtt"][f"{rtt:g}"] = {"in_suite": in_suite, "held_out_by_family": held}
        print(f"RTT {rtt:g} ms held out", json.dumps(held))
        for name, row in in_suite.items():
            print(f"  opening {name:>3s} {row}")
    (RESULTS / f"{stem}_opening.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


def _agreement(traces: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """How often the edge's pick is the cloud's, by the edge's probability of it (along the cloud's answers)."""
    edges = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0001)
    counts = {i: [0, 0] for i in range(len(edges) - 1)}
    for t in traces:
        for mine, theirs, p in zip(t["edge"], t["cloud"], t["p"]):
            i = next(j for j in range(len(edges) - 1) if p < edges[j + 1])
            counts[i][0] += 1
            counts[i][1] += mine == theirs
    return {f"{edges[i]:g}-{min(1.0, edges[i + 1]):g}": {"positions": n, "agree": round(a / max(1, n), 3)}
            for i, (n, a) in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edge", default=EDGE_MODEL,
                        help="the drafting model (catalogue name or .gguf path); its files carry its name")
    parser.add_argument("--machine", default="",
                        help="another machine's calibration and sweep (a tag their file names end in)")
    sub = parser.add_subparsers(dest="phase", required=True)
    tr = sub.add_parser("trace")
    tr.add_argument("--per-family", type=int, default=8)
    tr.add_argument("--skip", type=int, default=0, help="tasks of each family to skip (another sample)")
    tr.set_defaults(run=trace)
    ca = sub.add_parser("calibrate")
    ca.add_argument("--threads", type=int, default=2, help="threads of each side (the shared 2-core box: 2)")
    ca.add_argument("--reps", type=int, default=5)
    ca.add_argument("--k-max", type=int, default=31,
                    help="time checks of up to this many drafted tokens (sweep replays blocks up to it)")
    ca.set_defaults(run=calibrate)
    sw = sub.add_parser("sweep")
    sw.add_argument("--rtt", type=float, nargs="+", default=[0.0, 50.0], help="round trips to replay, ms")
    sw.add_argument("--start-ms", type=float, default=0.0,
                    help="edge time at each block's start beyond a draft step (live: ~10 ms, reading two tokens "
                         "after a kept block)")
    sw.set_defaults(run=sweep)
    op = sub.add_parser("opening")
    op.add_argument("--rtt", type=float, nargs="+", default=[0.0, 50.0], help="round trips to replay, ms")
    op.add_argument("--start-ms", type=float, default=0.0, help="as sweep's")
    op.add_argument("--read-ms", type=float, default=3.0,
                    help="the edge's read of the prompt, a token (0.5B IQ4_NL, 2 threads, 30-200 tokens: 3.0-3.7 ms)")
    op.set_defaults(run=opening)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
