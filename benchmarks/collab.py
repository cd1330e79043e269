"""Token-level edge–cloud collaboration against the other ways to share an answer, in one run.

0.5B edge (llama.cpp, in this process) and 1.5B cloud (a real ``edgecloud serve --engine
llamacpp`` child on 127.0.0.1, optionally behind the latency proxy), greedy, on tasks of the
project's five outcome suites (stratified per suite from ``benchmarks/results/router/outcomes.jsonl``:
tasks the cloud fixes, tasks both solve, the rest). Everything goes through the public client.

Side by side: all-edge, all-cloud, the request router and the buffered cascade (both decided
from this run's edge and cloud answers, in-suite and leave-one-suite-out), token mode with its
gate swept (quality vs share of cloud-written tokens), and verified mode (text identical to
all-cloud?, cloud forward passes per output token, wall time). Every mode meets the cloud
server's and the edge's prefix caches warm except the first two (all-edge, all-cloud): the
like-for-like TTFT and wall-time figures are the ``rtt`` phase's, where every mode runs on
tasks all modes have seen. Also the gate's signals as
predictors of "the cloud would write another token here" (AUC per signal, and a logistic on
all three in-suite vs leave-one-suite-out), and TTFT / wall time at RTT 0, 50 and 150 ms.

    python benchmarks/collab.py                       # the full run (~40 min on 2 cores)
    python benchmarks/collab.py --per-suite 1 --max-tokens 32 --configs line:16:0.75 --rtt-tasks 2   # a smoke run

Prints JSON; writes benchmarks/results/collab.json and collab.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from edgecloud import EdgeCloud  # noqa: E402
from edgecloud.collab.gate import GATE_SIGNALS, signals_of  # noqa: E402
from edgecloud.router.training.tasks import SUITES, grade, load_tasks  # noqa: E402
from edgecloud.testing import LatencyProxy  # noqa: E402
from faults import ServeProcess  # noqa: E402

from _common import DEFAULT_EDGE_MODEL, bench_lock  # noqa: E402

CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct-q4"
RESULTS = Path(__file__).parent / "results"
OUTCOMES = RESULTS / "router" / "outcomes.jsonl"


def pick_tasks(per_suite: int, seed: int = 3) -> list[Any]:
    """Per suite: half tasks the cloud fixed, a third both solved, the rest (as labelled before)."""
    rows = [json.loads(line) for line in OUTCOMES.read_text().splitlines()]
    by_id = {t.id: t for t in load_tasks()}
    rng = random.Random(seed)
    chosen = []
    for suite in SUITES:
        mine = [r for r in rows if r["suite"] == suite and r["id"] in by_id]
        rng.shuffle(mine)
        fixes = [r for r in mine if r["cloud_pass"] and not r["edge_pass"]]
        both = [r for r in mine if r["cloud_pass"] and r["edge_pass"]]
        rest = [r for r in mine if not r["cloud_pass"]]
        n_fix, n_both = (per_suite + 1) // 2, max(1, per_suite // 3)
        take = (fixes[:n_fix] + both[:n_both])[:per_suite]
        take += rest[: max(0, per_suite - len(take))]
        chosen += [by_id[r["id"]] for r in take]
    return chosen


def answer(client: EdgeCloud, task: Any, max_tokens: int, **params: Any) -> dict[str, Any]:
    """One streamed answer: text, pass, TTFT, wall time, route figures."""
    started = time.perf_counter()
    first = None
    parts: list[str] = []
    logprobs: list[float] = []
    last = None
    for chunk in client.chat.completions.create(messages=task.messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, **params):
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - started
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].logprobs is not None:
            logprobs += [e.logprob for e in chunk.choices[0].logprobs.content]
        last = chunk
    text = "".join(parts)
    route = last.route if last is not None else None
    return {"id": task.id, "suite": task.suite, "pass": grade(task, text), "text": text,
            "ttft": first, "seconds": time.perf_counter() - started,
            "tokens": route.tokens if route else None, "cloud_calls": route.cloud_calls if route else None,
            "fallbacks": len(route.fallbacks) if route else 0, "logprobs": logprobs or None}


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    edge = sum((r["tokens"] or {}).get("edge", 0) for r in results)
    cloud = sum((r["tokens"] or {}).get("cloud", 0) for r in results)
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    return {
        "quality": round(statistics.mean(r["pass"] for r in results), 4),
        "cloud_token_share": round(cloud / (edge + cloud), 4) if edge + cloud else 0.0,
        "cloud_calls_per_answer": round(statistics.mean(r["cloud_calls"] or 0 for r in results), 2),
        "ttft_p50": round(ttfts[len(ttfts) // 2], 3) if ttfts else None,
        "ttft_p90": round(ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], 3) if ttfts else None,
        "seconds_per_answer": round(statistics.mean(r["seconds"] for r in results), 2),
        "tasks": len(results),
    }


def gap_recovered(q: float, q_edge: float, q_cloud: float) -> float | None:
    return round((q - q_edge) / (q_cloud - q_edge), 3) if q_cloud != q_edge else None


def loso_choice(configs: dict[str, list[dict[str, Any]]], cloud: list[dict[str, Any]], target: float = 0.9,
                max_share: float = 1.0) -> dict[str, Any]:
    """Leave-one-suite-out: per suite, the config with the fewest cloud tokens reaching ``target`` of
    all-cloud quality on the other suites (else the best quality there), among those writing at
    most ``max_share`` of the tokens there, scored on that suite."""
    held_results, choices = [], {}
    for suite in SUITES:
        others = [r for r in cloud if r["suite"] != suite]
        if not others:
            continue
        q_cloud = statistics.mean(r["pass"] for r in others)
        scored = []
        for name, results in configs.items():
            rest = [r for r in results if r["suite"] != suite]
            s = summarise(rest)
            if s["cloud_token_share"] > max_share:
                continue
            scored.append((s["quality"] >= target * q_cloud, -s["cloud_token_share"] if s["quality"] >= target * q_cloud
                           else s["quality"], name))
        best = max(scored)[2]
        choices[suite] = best
        held_results += [r for r in configs[best] if r["suite"] == suite]
    return {"choices": choices, "held_out": summarise(held_results)}


def gate_report(signal_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """AUC of each signal for "the cloud's greedy token differs here", and of a logistic on all
    three: fitted and scored on every suite (in-suite) vs fitted on four, scored on the fifth."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    y = np.array([r["disagree"] for r in signal_rows])
    x = np.array([[r["entropy"], 1 - r["top1"], 1 - r["margin"]] for r in signal_rows])
    suites = np.array([r["suite"] for r in signal_rows])
    out: dict[str, Any] = {"positions": int(len(y)), "disagree_rate": round(float(y.mean()), 4)}
    for i, name in enumerate(GATE_SIGNALS):
        out[f"auc_{name}"] = round(float(roc_auc_score(y, x[:, i])), 4)
    model = LogisticRegression(max_iter=1000).fit(x, y)
    out["auc_logistic_in_suite"] = round(float(roc_auc_score(y, model.predict_proba(x)[:, 1])), 4)
    held = np.zeros(len(y))
    per_suite = {}
    for suite in SUITES:
        mask = suites == suite
        if mask.sum() == 0 or len(set(y[~mask])) < 2:
            continue
        fold = LogisticRegression(max_iter=1000).fit(x[~mask], y[~mask])
        held[mask] = fold.predict_proba(x[mask])[:, 1]
        if len(set(y[mask])) == 2:
            per_suite[suite] = {"logistic": round(float(roc_auc_score(y[mask], held[mask])), 4),
                                "top1": round(float(roc_auc_score(y[mask], x[mask, 1])), 4)}
    out["auc_logistic_loso"] = round(float(roc_auc_score(y, held)), 4)
    out["per_suite_loso"] = per_suite
    return out


def collect_signals(client: EdgeCloud, cloud: Any, task: Any, text: str) -> list[dict[str, Any]]:
    """Per answer token: the edge's signals, and whether the cloud's greedy choice differs."""
    edge = client.edge
    prompt = edge.tokenize_chat(task.messages)
    ids = edge.tokenize_text(text)
    if not ids:
        return []
    mine, _ = edge.score(prompt + ids, start=len(prompt), top_n=10)
    theirs, _ = cloud.score(prompt + ids, start=len(prompt), top_n=1)
    rows = []
    for a, b in zip(mine, theirs):
        s = signals_of([lp for _, lp in a.top])
        rows.append({"suite": task.suite, "entropy": s.entropy, "top1": s.top1, "margin": s.margin,
                     "disagree": int(b.argmax != a.token)})
    return rows


def offline_router_and_cascade(tasks: list[Any], edge: list[dict[str, Any]], cloud: list[dict[str, Any]]) -> dict[str, Any]:
    """The request router and the buffered cascade decided from this run's answers."""
    from edgecloud.router.cascade import ConfidenceCheck, signals
    from edgecloud.router.training.evaluate import apgr, router_curve
    from edgecloud.router.scorers import LearnedScorer, load_scorer
    from edgecloud.router.training.fit import train_scorer
    from edgecloud.router.training.cascade_fit import choose_threshold, out_of_fold_p_good, row_signals
    from edgecloud.types import ChatRequest

    rows = [{"suite": t.suite, "messages": t.messages, "max_tokens": t.max_tokens, "edge_pass": e["pass"],
             "cloud_pass": c["pass"]} for t, e, c in zip(tasks, edge, cloud)]
    packaged = load_scorer("learned")
    in_suite = [packaged.score(ChatRequest(messages=t.messages, max_tokens=t.max_tokens)) for t in tasks]
    outcomes = [json.loads(line) for line in OUTCOMES.read_text().splitlines()]
    loso = [0.0] * len(tasks)
    checks = {}
    all_signals = row_signals(outcomes)
    for suite in SUITES:
        train = [r for r in outcomes if r["suite"] != suite]
        scorer = LearnedScorer(train_scorer(train))
        train_sig = [s for r, s in zip(outcomes, all_signals) if r["suite"] != suite]
        check = ConfidenceCheck().fit(train, train_sig)
        threshold, _ = choose_threshold(train, out_of_fold_p_good(train, train_sig), [False] * len(train))
        check.threshold = threshold
        checks[suite] = check
        for i, t in enumerate(tasks):
            if t.suite == suite:
                loso[i] = scorer.score(ChatRequest(messages=t.messages, max_tokens=t.max_tokens))
    out: dict[str, Any] = {"router_apgr_in_suite": round(apgr(router_curve(rows, in_suite)), 4),
                           "router_apgr_loso": round(apgr(router_curve(rows, loso)), 4),
                           "router_apgr_random": 0.5}
    packaged_check = ConfidenceCheck.packaged()

    def cascade(check_for: Any) -> dict[str, Any]:
        quality, escalated, ttft = [], 0, []
        for t, e, c in zip(tasks, edge, cloud):
            sig = signals(t.prompt, e["text"], finish_reason="stop", logprobs=e.get("logprobs") or {})
            check = check_for(t)
            accept = check.p_good(sig) >= check.threshold
            quality.append(e["pass"] if accept else c["pass"])
            escalated += not accept
            ttft.append(e["seconds"] + (0 if accept else (c["ttft"] or 0)))
        ttft.sort()
        return {"quality": round(statistics.mean(quality), 4), "cloud_answer_share": round(escalated / len(tasks), 4),
                "ttft_p50": round(ttft[len(ttft) // 2], 3), "ttft_p90": round(ttft[int(0.9 * (len(ttft) - 1))], 3)}

    out["cascade_in_suite"] = cascade(lambda t: packaged_check)
    out["cascade_loso"] = cascade(lambda t: checks[t.suite])
    return out


def router_report() -> dict[str, Any]:
    """The request router on all labelled outcome rows: APGR in-suite (scorer fitted on every
    suite, out-of-fold) vs leave-one-suite-out (fitted on four suites, scored on the fifth)."""
    from edgecloud.router.training.evaluate import apgr, router_curve
    from edgecloud.router.scorers import LearnedScorer, RulesScorer
    from edgecloud.router.training.fit import out_of_fold_scores, train_scorer

    rows = [json.loads(line) for line in OUTCOMES.read_text().splitlines()]
    out: dict[str, Any] = {"rows": len(rows)}
    in_suite = out_of_fold_scores(rows)
    out["learned_in_suite_5fold"] = round(apgr(router_curve(rows, in_suite)), 4)
    loso = [0.0] * len(rows)
    per_suite = {}
    for suite in SUITES:
        train = [r for r in rows if r["suite"] != suite]
        scorer = LearnedScorer(train_scorer(train))
        held = [i for i, r in enumerate(rows) if r["suite"] == suite]
        for i in held:
            loso[i] = scorer.score(rows[i])
        mine = [rows[i] for i in held]
        try:
            per_suite[suite] = round(apgr(router_curve(mine, [loso[i] for i in held])), 4)
        except ValueError:  # no edge->cloud gap in this suite
            per_suite[suite] = None
    out["learned_loso"] = round(apgr(router_curve(rows, loso)), 4)
    out["learned_loso_per_suite"] = per_suite
    rules = RulesScorer()
    out["rules"] = round(apgr(router_curve(rows, [rules.score(r) for r in rows])), 4)
    out["random"] = 0.5
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-suite", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--configs", default="line:16:0.6,line:16:0.75,line:16:0.9,tokens:4:0.6,tokens:4:0.75,tokens:1:0.6",
                        help="token-mode configurations swept: span_stop:span_tokens:top1 gate, comma-separated")
    parser.add_argument("--rtt-tasks", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS / "collab.json"))
    parser.add_argument("--router-only", action="store_true", help="only the router report on all outcome rows")
    parser.add_argument("--rtt-only", metavar="JSON", help="rerun only the RTT phase (with the current defaults) "
                        "and put it into an earlier run's results")
    parser.add_argument("--extend", metavar="JSON", help="add --configs to an earlier run's results (same tasks; "
                        "its all-edge, all-cloud and verified answers are reused: greedy, so they would not change)")
    args = parser.parse_args()
    if args.router_only:
        print(json.dumps(router_report(), indent=2))
        return
    if args.rtt_only:
        earlier = json.loads(Path(args.rtt_only).read_text())
        tasks = pick_tasks(earlier["per_suite"])
        spread = tasks[:: max(1, len(tasks) // args.rtt_tasks)][: args.rtt_tasks]
        with bench_lock():
            server = ServeProcess(CLOUD_MODEL, ctx=4096).start(timeout=300)
            try:
                for t in spread:  # the cloud's prefix cache warm, as in the full run
                    with client_for(server.url, server.api_key) as client:
                        answer(client, t, 1, route="cloud", collab="off")
                earlier["rtt"] = rtt_phase(server, spread, min(earlier["max_tokens"], 128))
            finally:
                server.stop()
        Path(args.out).write_text(json.dumps(earlier, indent=2))
        print(json.dumps(earlier["rtt"], indent=2))
        return
    if args.extend:
        earlier = json.loads(Path(args.extend).read_text())
        args.per_suite, args.max_tokens = earlier["per_suite"], earlier["max_tokens"]
    tasks = pick_tasks(args.per_suite)
    out: dict[str, Any] = {"tasks": len(tasks), "per_suite": args.per_suite, "max_tokens": args.max_tokens,
                           "edge": DEFAULT_EDGE_MODEL, "cloud": CLOUD_MODEL}
    if args.extend:
        with bench_lock():
            server = ServeProcess(CLOUD_MODEL, ctx=4096).start(timeout=300)
            try:
                out = extend(args, tasks, server, earlier)
            finally:
                server.stop()
        Path(args.out).write_text(json.dumps(out, indent=2))
        plot(out, Path(args.out).with_suffix(".png"))
        print(json.dumps({k: v for k, v in out.items() if k != "answers"}, indent=2))
        return
    with bench_lock():
        server = ServeProcess(CLOUD_MODEL, ctx=4096).start(timeout=300)
        try:
            out.update(run(args, tasks, server))
        finally:
            server.stop()
    Path(args.out).write_text(json.dumps(out, indent=2))
    plot(out, Path(args.out).with_suffix(".png"))
    print(json.dumps({k: v for k, v in out.items() if k != "answers"}, indent=2))


_EDGE: Any = None


def client_for(url: str, key: str, **collab: Any) -> EdgeCloud:
    """A client on the one edge backend of this run (loaded once: no client pays the load in its TTFT)."""
    global _EDGE
    if _EDGE is None:
        from edgecloud.edge.llamacpp import LlamaCppBackend

        _EDGE = LlamaCppBackend(DEFAULT_EDGE_MODEL, n_ctx=4096)
        _EDGE.load()
    return EdgeCloud(edge_backend=_EDGE, cloud_base_url=url, cloud_model=CLOUD_MODEL, cloud_api_key=key,
                     config={"collab": collab} if collab else None)


def progress(label: str, i: int, n: int) -> None:
    print(f"\r{label}: {i}/{n}", end="" if i < n else "\n", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, tasks: list[Any], server: ServeProcess) -> dict[str, Any]:
    from edgecloud.remote.client import CloudBackend

    out: dict[str, Any] = {}
    answers: dict[str, list[dict[str, Any]]] = {}
    mt = args.max_tokens
    budget = {t.id: min(t.max_tokens, mt) for t in tasks}
    with client_for(server.url, server.api_key) as client:
        for name, params in (("all_edge", {"route": "edge", "collab": "off", "logprobs": True}),
                             ("all_cloud", {"route": "cloud", "collab": "off"})):
            answers[name] = []
            for i, t in enumerate(tasks):
                answers[name].append(answer(client, t, budget[t.id], **params))
                progress(name, i + 1, len(tasks))
        signal_rows: list[dict[str, Any]] = []
        with CloudBackend(server.url, CLOUD_MODEL, api_key=server.api_key) as cloud:
            for i, (t, a) in enumerate(zip(tasks, answers["all_edge"])):
                signal_rows += collect_signals(client, cloud, t, a["text"])
                progress("gate signals", i + 1, len(tasks))
        out["gate"] = gate_report(signal_rows)
        answers["verified"] = []
        for i, t in enumerate(tasks):
            answers["verified"].append(answer(client, t, budget[t.id], collab="verified"))
            progress("verified", i + 1, len(tasks))
    run_token_configs(args, tasks, server, answers)
    out.update(compare(answers))
    out["router_cascade"] = offline_router_and_cascade(tasks, answers["all_edge"], answers["all_cloud"])
    out["router_all_outcomes"] = router_report()
    spread = tasks[:: max(1, len(tasks) // args.rtt_tasks)][: args.rtt_tasks]  # every suite
    out["rtt"] = rtt_phase(server, spread, min(mt, 128))
    out["answers"] = answers
    return out


def run_token_configs(args: argparse.Namespace, tasks: list[Any], server: ServeProcess,
                      answers: dict[str, list[dict[str, Any]]]) -> None:
    budget = {t.id: min(t.max_tokens, args.max_tokens) for t in tasks}
    for spec in filter(None, args.configs.split(",")):
        stop, n, gate = spec.split(":")
        name = f"token_{stop}{n}_top1_{gate}"
        collab = {"gate": float(gate), "span_stop": stop, "span_tokens": int(n)}
        with client_for(server.url, server.api_key, mode="token", gate_signal="top1", **collab) as client:
            answers[name] = []
            for i, t in enumerate(tasks):
                answers[name].append(answer(client, t, budget[t.id]))
                progress(name, i + 1, len(tasks))


def extend(args: argparse.Namespace, tasks: list[Any], server: ServeProcess, earlier: dict[str, Any]) -> dict[str, Any]:
    """An earlier run plus more token-mode configurations, compared again."""
    answers = earlier["answers"]
    assert [a["id"] for a in answers["all_edge"]] == [t.id for t in tasks], "not the same tasks"
    run_token_configs(args, tasks, server, answers)
    out = {k: v for k, v in earlier.items() if k not in ("answers", "modes", "token_loso", "verified")}
    out.update(compare(answers))
    out["extended_with"] = args.configs
    out["answers"] = answers
    return out


def compare(answers: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Every mode summarised, the leave-one-suite-out choice of token configuration, verified vs cloud."""
    out: dict[str, Any] = {}
    q_edge = statistics.mean(r["pass"] for r in answers["all_edge"])
    q_cloud = statistics.mean(r["pass"] for r in answers["all_cloud"])
    out["modes"] = {name: {**summarise(results), "gap_recovered": gap_recovered(summarise(results)["quality"], q_edge, q_cloud),
                           "share_of_cloud_quality": round(summarise(results)["quality"] / q_cloud, 4) if q_cloud else None}
                    for name, results in answers.items()}
    token_configs = {n: r for n, r in answers.items() if n.startswith("token_")}
    loso = loso_choice(token_configs, answers["all_cloud"])
    loso["held_out"]["gap_recovered"] = gap_recovered(loso["held_out"]["quality"], q_edge, q_cloud)
    loso["held_out"]["share_of_cloud_quality"] = round(loso["held_out"]["quality"] / q_cloud, 4) if q_cloud else None
    out["token_loso"] = loso
    capped = loso_choice(token_configs, answers["all_cloud"], target=1.01, max_share=0.15)  # best quality <= 15 %
    capped["held_out"]["gap_recovered"] = gap_recovered(capped["held_out"]["quality"], q_edge, q_cloud)
    out["token_loso_at_most_15pct_cloud_tokens"] = capped
    reaching = [m for n, m in out["modes"].items() if n.startswith("token_") and m["quality"] >= 0.9 * q_cloud]
    out["token_share_at_90pct_of_cloud_quality"] = min((m["cloud_token_share"] for m in reaching), default=None)
    same = [v["text"] == c["text"] for v, c in zip(answers["verified"], answers["all_cloud"])]
    out_tokens = sum(sum((v["tokens"] or {}).values()) for v in answers["verified"])
    out["verified"] = {
        "identical_to_cloud": f"{sum(same)}/{len(same)}",
        "different": [v["id"] for v, s in zip(answers["verified"], same) if not s],
        "cloud_forward_passes_per_output_token": round(sum(v["cloud_calls"] or 0 for v in answers["verified"])
                                                       / max(1, out_tokens), 4),
        "wall_vs_cloud_only_rtt0": round(sum(v["seconds"] for v in answers["verified"])
                                         / sum(c["seconds"] for c in answers["all_cloud"]), 3),
    }
    return out


def rtt_phase(server: ServeProcess, tasks: list[Any], max_tokens: int) -> dict[str, Any]:
    """TTFT of edge-started answers (edge only vs token mode with the defaults) and wall time of
    verified vs all-cloud, with the cloud behind the latency proxy."""
    out = {}
    for rtt in (0.0, 0.05, 0.15):
        with LatencyProxy(("127.0.0.1", server.port), rtt_s=rtt, jitter_s=rtt / 10) as proxy:
            with client_for(proxy.url, server.api_key) as client:
                row: dict[str, Any] = {}
                for name, params in (("edge_only", {"route": "edge", "collab": "off"}), ("token_default", {}),
                                     ("cloud_only", {"route": "cloud", "collab": "off"}), ("verified", {"collab": "verified"})):
                    if rtt == 0.15 and name in ("cloud_only", "verified"):
                        continue
                    results = [answer(client, t, max_tokens, **params) for t in tasks]
                    s = summarise(results)
                    row[name] = {"ttft_p50": s["ttft_p50"], "ttft_p90": s["ttft_p90"],
                                 "seconds_per_answer": s["seconds_per_answer"], "cloud_token_share": s["cloud_token_share"]}
                out[f"{int(rtt * 1000)}ms"] = row
                progress("rtt", int(rtt * 1000), 150)
    return out


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    modes = out["modes"]
    tok = sorted((m["cloud_token_share"], m["quality"], n) for n, m in modes.items() if n.startswith("token_"))
    ax.plot([t[0] for t in tok], [t[1] for t in tok], "o", label="token mode (gate and span rule swept)")
    for share, quality, name in tok:
        ax.annotate(name.removeprefix("token_").replace("_top1_", " @"), (share, quality), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    for n, m in modes.items():
        if not n.startswith("token_"):
            ax.scatter([m["cloud_token_share"]], [m["quality"]], marker="s", label=n)
    ax.set_xlabel("share of answer tokens written by the cloud")
    ax.set_ylabel("tasks passed")
    ax.set_title(f"edge 0.5B + cloud 1.5B, {out['tasks']} tasks, greedy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
