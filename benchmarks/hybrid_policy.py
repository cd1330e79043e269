"""The hybrid default, chosen on the development corpus held out by family, with what each answer costs.

Everything goes through the public client (``EdgeCloud``) with the real collaboration modes:

    python benchmarks/hybrid_policy.py run --name checked-0.7 --mode checked --trust 0.7
    python benchmarks/hybrid_policy.py run --name verified --mode verified
    python benchmarks/hybrid_policy.py run --name token-old --mode token --gate 0.3 --span-tokens 4
    python benchmarks/hybrid_policy.py live --rtt 0,50     # modes edge, cloud, token-old, checked-0.7, default
    python benchmarks/hybrid_policy.py report          # JSON to stdout, results/hybrid_policy.json + .png

``run`` answers the corpus sample (``--per-family`` tasks of each family both sides labelled, the
same sample for every run) with the 0.5B edge and the 1.5B cloud both in this process: the cloud
is a llama.cpp runtime behind the same :class:`~edgecloud.backend.Verifier` interface the HTTP
client offers (token sessions included), so a run measures the modes' decisions and their
token and pass counts without a server's noise; each answer is graded, and appended to
``results/corpus/runs/NAME.jsonl`` (a stopped run resumes). ``live`` runs a few tasks per family
against a real ``edgecloud serve`` child behind the latency proxy (RTT 0 and 50 ms): TTFT, end
to end time, and the server's own forward-pass counter beside the client's count. ``report``
joins the runs with the all-edge and all-cloud labels (``edgecloud route label --corpus``) and
the previous cascade (decided from those labels), and chooses the default leave-one-family-out:
for each family, the candidate with the lowest billed cost that reaches the quality target on
the other families, scored on the held-out one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from edgecloud import EdgeCloud  # noqa: E402
from edgecloud.edge.llamacpp import LlamaCppBackend  # noqa: E402
from edgecloud.router.training.corpus import CORPUS_FAMILIES, load_corpus  # noqa: E402
from edgecloud.router.training.tasks import Task, grade  # noqa: E402
from edgecloud.runtime.coupling import Coupling  # noqa: E402
from edgecloud.runtime.held import HeldGrammar  # noqa: E402
from edgecloud.runtime.scoring import Scored, TokenScore, TokenSession  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CORPUS = RESULTS / "corpus"
RUNS = CORPUS / "runs"
EDGE_MODEL = "qwen2.5-coder-0.5b-instruct-q4"
CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct-q4"
#: Quality the default must reach, as a share of all-cloud quality (held out).
QUALITY_TARGET = 0.95


class LocalCloud(LlamaCppBackend):
    """The cloud model in this process, answering what the HTTP client would: chat streams, and
    scoring rounds in a token session (it holds the session's tokens in its own KV, so a round is
    billed for the tokens it had not seen, as ``edgecloud serve`` bills them)."""

    target = "cloud"  # type: ignore[assignment]

    def score_in(self, session: TokenSession | None, tokens: list[int], *, start: int, top_n: int = 1,
                 coupling: Coupling | None = None, grammar: HeldGrammar | None = None,
                 keep_verified: bool = False) -> Scored:
        base = session.base(start) if session is not None else 0
        scores, nxt = self.score(tokens, start=start, top_n=top_n, coupling=coupling, grammar=grammar)
        if session is not None:
            session.supported, session.held = True, len(tokens)
        return Scored(scores, nxt, sent=len(tokens) - base, held=base)

    def token_texts(self, tokens: list[int]) -> list[str]:
        return [self.token_bytes(t).decode("utf-8", errors="replace") for t in tokens]

    def score_tokens(self, tokens: list[int], start: int) -> tuple[list[TokenScore], TokenScore]:
        return self.score(tokens, start=start, top_n=1)


def sample(per_family: int, families: tuple[str, ...] = CORPUS_FAMILIES) -> list[Task]:
    """The first ``per_family`` corpus tasks of each family (the corpus order is a seeded sample)."""
    out: list[Task] = []
    for family in families:
        out += load_corpus([family])[:per_family]
    return out


def _families(arg: str | None, per_family: int) -> tuple[str, ...]:
    """``--families``: a comma list, or by default every family whose sample (its first
    ``per_family`` tasks) both sides labelled."""
    if arg:
        unknown = set(arg.split(",")) - set(CORPUS_FAMILIES)
        if unknown:
            raise SystemExit(f"unknown families {sorted(unknown)}; choose from {', '.join(CORPUS_FAMILIES)}")
        return tuple(arg.split(","))
    ref = labels()
    return tuple(f for f in CORPUS_FAMILIES
                 if all({"edge", "cloud"} <= set(ref.get(t.id, {})) for t in load_corpus([f])[:per_family]))


def _read(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    return {r["id"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}


def answer(client: EdgeCloud, task: Task, **params: Any) -> dict[str, Any]:
    """One streamed answer through the public client: text, grade, timing, route and cost."""
    started = time.perf_counter()
    first = None
    parts: list[str] = []
    last = None
    for chunk in client.chat.completions.create(messages=task.messages, max_tokens=task.max_tokens, temperature=0,
                                                stream=True, **params):
        if chunk.text and first is None:
            first = time.perf_counter() - started
        parts.append(chunk.text)
        last = chunk
    assert last is not None and last.route is not None and last.cost is not None and last.usage is not None
    text = "".join(parts)
    cost = last.cost
    return {
        "id": task.id, "family": task.suite, "pass": grade(task, text), "text": text,
        "ttft": first, "seconds": round(time.perf_counter() - started, 3),
        "prompt_tokens": last.usage.prompt_tokens, "answer_tokens": last.usage.completion_tokens,
        "tokens": last.route.tokens, "cloud_calls": last.route.cloud_calls, "collab": last.route.collab,
        "fallbacks": len(last.route.fallbacks),
        "cost": cost.model_dump(include={"usd", "cloud_equivalent_usd", "vs_all_cloud", "cloud_input_tokens",
                                         "cloud_cached_tokens", "cloud_output_tokens", "cloud_calls", "cloud_passes",
                                         "all_cloud_passes", "passes_vs_all_cloud", "edge_seconds"}),
    }


def cmd_run(args: argparse.Namespace) -> None:
    collab: dict[str, Any] = {"mode": args.mode}
    for key in ("trust", "gate", "span_tokens", "max_calls", "draft_max"):
        value = getattr(args, key)
        if value is not None:
            collab[key] = value
    if args.mode == "token":
        collab.setdefault("span_stop", "tokens")
    out = Path(args.out_dir) / f"{args.name}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _read(out)
    tasks = [t for t in sample(args.per_family, _families(args.families, args.per_family)) if t.id not in done]
    edge = LlamaCppBackend(args.edge_model, n_ctx=args.ctx)
    cloud = LocalCloud(args.cloud_model, n_ctx=args.ctx)
    config = {"collab": collab, "fallback": {"max_retries": 0}}
    route = "cloud" if args.mode == "off-cloud" else "edge" if args.mode == "off-edge" else "auto"
    if args.mode.startswith("off-"):
        config["collab"] = {"mode": "off"}
    with edge, cloud, EdgeCloud(edge_backend=edge, cloud_backends=[cloud], cloud_model=args.cloud_model,
                                config=config) as client, out.open("a", encoding="utf-8") as fh:
        for i, task in enumerate(tasks):
            row = answer(client, task, route=route)
            row["config"] = collab
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            print(f"{args.name} {i + 1}/{len(tasks)} {task.id} pass={row['pass']} calls={row['cloud_calls']} "
                  f"vs_cloud={row['cost']['vs_all_cloud']} {row['seconds']}s", file=sys.stderr)


# ---------------------------------------------------------------------------- live: a real server, a real round trip

#: The modes ``live`` compares: (name, request parameters, collab settings).
LIVE_MODES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "edge": ({"route": "edge", "collab": "off"}, {}),
    "cloud": ({"route": "cloud", "collab": "off"}, {}),
    "token-old": ({"collab": "token"}, {"gate": 0.3, "span_tokens": 4, "span_stop": "tokens"}),
    "checked-0.7": ({"collab": "checked"}, {"trust": 0.7}),
    "default": ({}, {}),
}


def _server_passes(url: str) -> float:
    import httpx

    body = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith("edgecloud:forward_passes_total{"))


def cmd_live(args: argparse.Namespace) -> None:
    """TTFT and end-to-end time through a real ``edgecloud serve`` behind the latency proxy, and the
    server's own forward-pass count beside the client's, answer by answer (one at a time)."""
    from edgecloud.testing import LatencyProxy
    from faults import ServeProcess

    tasks = sample(args.per_family, _families(args.families, args.per_family))
    modes = args.modes.split(",")
    out: dict[str, Any] = {"tasks": len(tasks), "per_family": args.per_family, "rtt": {}}
    server = ServeProcess(CLOUD_MODEL, api_key="sk-live", ctx=args.ctx).start()
    try:
        for rtt_ms in (int(r) for r in args.rtt.split(",")):
            with LatencyProxy(("127.0.0.1", server.port), rtt_s=rtt_ms / 1000) as proxy:
                by_mode: dict[str, Any] = {}
                for mode in modes:
                    params, collab = LIVE_MODES[mode]
                    config = {"collab": collab, "fallback": {"max_retries": 0, "timeout_s": 120}}
                    rows = []
                    with EdgeCloud(edge_model=EDGE_MODEL, cloud_base_url=proxy.url, cloud_model=CLOUD_MODEL,
                                   cloud_api_key="sk-live", config=config) as client:
                        answer(client, tasks[0], **params)  # warm: both models loaded, caches as in use
                        for task in tasks:
                            before = _server_passes(server.url)
                            row = answer(client, task, **params)
                            row["server_passes"] = _server_passes(server.url) - before
                            rows.append(row)
                            print(f"live rtt={rtt_ms} {mode} {task.id} ttft={row['ttft']} {row['seconds']}s",
                                  file=sys.stderr)
                    ttfts = [r["ttft"] for r in rows if r["ttft"] is not None]
                    by_mode[mode] = {
                        "ttft_p50": _pct(ttfts, 0.5), "ttft_p90": _pct(ttfts, 0.9),
                        "seconds_mean": round(statistics.mean(r["seconds"] for r in rows), 3),
                        "quality": round(statistics.mean(r["pass"] for r in rows), 4),
                        "client_passes": sum(r["cost"]["cloud_passes"] for r in rows),
                        "server_passes": sum(r["server_passes"] for r in rows),
                        "cloud_calls_mean": round(statistics.mean(r["cloud_calls"] or 0 for r in rows), 2),
                    }
                edge_s = by_mode.get("edge", {}).get("seconds_mean")
                for stats in by_mode.values():
                    stats["e2e_vs_edge_only"] = round(stats["seconds_mean"] / edge_s, 3) if edge_s else None
                out["rtt"][str(rtt_ms)] = by_mode
    finally:
        server.stop()
    (RESULTS / "hybrid_policy_live.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


# ---------------------------------------------------------------------------- the report


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))], 4)


def labels() -> dict[str, dict[str, Any]]:
    """The all-edge and all-cloud outcomes per task id (``edgecloud route label --corpus``)."""
    out: dict[str, dict[str, Any]] = {}
    for stem in ("outcomes", "outcomes-long"):
        for side in ("edge", "cloud"):
            for tid, row in _read(CORPUS / f"{stem}.{side}.jsonl").items():
                out.setdefault(tid, {})[side] = row
    return out


def summarise(rows: list[dict[str, Any]], ref: dict[str, dict[str, Any]], prices: Any) -> dict[str, Any]:
    """Quality against all-cloud on the same tasks, and what the answers cost against all-cloud."""
    from edgecloud.observability.cost import CostModel, forward_passes

    model = CostModel(prices)
    both = [r for r in rows if r["id"] in ref and "cloud" in ref[r["id"]]]
    if not both:
        return {"tasks": 0}
    q = statistics.mean(r["pass"] for r in both)
    q_cloud = statistics.mean(ref[r["id"]]["cloud"]["pass"] for r in both)
    q_edge = statistics.mean(ref[r["id"]]["edge"]["pass"] for r in both if "edge" in ref[r["id"]])
    vs, passes_vs = [], []
    for r in both:
        c = ref[r["id"]]["cloud"]
        # the same answer all-cloud: its prompt and the cloud's own answer, priced and counted alike
        all_cloud_usd = model.cloud_usd(c["prompt_tokens"], c["tokens"])
        all_cloud_passes = forward_passes(c["prompt_tokens"], c["tokens"])
        vs.append(r["cost"]["usd"] / all_cloud_usd if all_cloud_usd else 0.0)
        passes_vs.append(r["cost"]["cloud_passes"] / all_cloud_passes if all_cloud_passes else 0.0)
    written = [sum((r["tokens"] or {}).values()) for r in both]
    cloud_written = [(r["tokens"] or {}).get("cloud", 0) for r in both]
    ttfts = [r["ttft"] for r in both if r["ttft"] is not None]
    return {
        "tasks": len(both), "quality": round(q, 4), "all_cloud_quality": round(q_cloud, 4),
        "all_edge_quality": round(q_edge, 4),
        "quality_vs_all_cloud": round(q / q_cloud, 4) if q_cloud else None,
        "gap_recovered": round((q - q_edge) / (q_cloud - q_edge), 4) if q_cloud != q_edge else None,
        "cloud_token_share": round(sum(cloud_written) / sum(written), 4) if sum(written) else 0.0,
        "cloud_calls_mean": round(statistics.mean(r["cloud_calls"] or 0 for r in both), 3),
        "cloud_calls_p50": _pct([float(r["cloud_calls"] or 0) for r in both], 0.5),
        "cost_vs_all_cloud_p50": _pct(vs, 0.5), "cost_vs_all_cloud_p90": _pct(vs, 0.9),
        "cost_vs_all_cloud_max": round(max(vs), 4),
        "cost_vs_all_cloud_pooled": round(sum(r["cost"]["usd"] for r in both)
                                          / sum(model.cloud_usd(ref[r["id"]]["cloud"]["prompt_tokens"],
                                                                ref[r["id"]]["cloud"]["tokens"]) for r in both), 4),
        "answers_above_all_cloud": sum(v > 1.0 for v in vs),
        "answers_above_1_5x": sum(v > 1.5 for v in vs),
        "passes_vs_all_cloud_p50": _pct(passes_vs, 0.5),
        "passes_vs_all_cloud_pooled": round(sum(r["cost"]["cloud_passes"] for r in both) / sum(
            forward_passes(ref[r["id"]]["cloud"]["prompt_tokens"], ref[r["id"]]["cloud"]["tokens"]) for r in both), 4),
        "ttft_p50": _pct(ttfts, 0.5), "ttft_p90": _pct(ttfts, 0.9),
        "seconds_mean": round(statistics.mean(r["seconds"] for r in both), 2),
    }


def lofo(runs: dict[str, list[dict[str, Any]]], ref: dict[str, dict[str, Any]], prices: Any,
         target: float = QUALITY_TARGET) -> dict[str, Any]:
    """Leave one family out: for each family, the run with the lowest pooled cost whose quality on
    the other families reaches ``target`` of all-cloud (else the best quality there), scored on the
    held-out family; and the same choice made on every family at once (in-suite)."""
    def choose(rows_of: dict[str, list[dict[str, Any]]]) -> str:
        scored = []
        for name, rows in rows_of.items():
            s = summarise(rows, ref, prices)
            if not s["tasks"]:
                continue
            ok = (s["quality_vs_all_cloud"] or 0) >= target
            scored.append((ok, -s["cost_vs_all_cloud_pooled"] if ok else s["quality_vs_all_cloud"] or 0, name))
        return max(scored)[2]

    held: list[dict[str, Any]] = []
    choices: dict[str, str] = {}
    for family in sorted({r["family"] for rows in runs.values() for r in rows}):
        others = {n: [r for r in rows if r["family"] != family] for n, rows in runs.items()}
        if not any(others.values()):
            continue
        best = choose(others)
        choices[family] = best
        held += [r for r in runs[best] if r["family"] == family]
    in_suite = choose(runs)
    return {"choices_held_out": choices, "held_out": summarise(held, ref, prices),
            "in_suite_choice": in_suite, "in_suite": summarise(runs[in_suite], ref, prices)}


def cascade_from_labels(ref: dict[str, dict[str, Any]], tasks: list[Task], prices: Any) -> dict[str, Any]:
    """The previous default (the request router, then the buffered cascade in its middle band),
    decided from the labelled answers: a low score keeps the edge's answer, a high one takes the
    cloud's, a middle one lets the packaged confidence check accept the edge's or escalate (both
    paid for)."""
    from edgecloud.observability.cost import CostModel
    from edgecloud.router.cascade import ConfidenceCheck, signals
    from edgecloud.router.policy import RoutePolicy
    from edgecloud.types import ChatRequest

    model, check, policy = CostModel(prices), ConfidenceCheck.packaged(), RoutePolicy()
    rows = []
    for t in tasks:
        r = ref.get(t.id, {})
        if "edge" not in r or "cloud" not in r:
            continue
        e, c = r["edge"], r["cloud"]
        decision = policy.decide(ChatRequest(messages=t.messages, max_tokens=t.max_tokens))
        if decision.cascade:
            sig = signals(t.prompt, e["answer"], finish_reason=e["finish"], logprobs=e["logprob"],
                          route_score=decision.score)
            accept = check.p_good(sig) >= check.threshold
        else:
            accept = decision.target == "edge"
        usd = 0.0 if accept else model.cloud_usd(c["prompt_tokens"], c["tokens"])
        rows.append({"id": t.id, "family": t.suite, "pass": e["pass"] if accept else c["pass"], "ttft": None,
                     "seconds": e["seconds"] + (0 if accept else c["seconds"]),
                     "tokens": {"edge": e["tokens"] if accept else 0, "cloud": 0 if accept else c["tokens"]},
                     "cloud_calls": 0 if accept else 1,
                     "cost": {"usd": usd, "cloud_passes": 0 if accept else c["tokens"] + 1}})
    return summarise(rows, ref, prices)


def cmd_report(args: argparse.Namespace) -> None:
    from edgecloud.config import Prices

    prices = Prices()
    ref = labels()
    runs = {p.stem: list(_read(p).values()) for p in sorted(RUNS.glob("*.jsonl"))}
    families = _families(args.families, args.per_family)
    tasks = sample(args.per_family, families)
    ids = {t.id for t in tasks}
    runs = {n: [r for r in rows if r["id"] in ids] for n, rows in runs.items()}
    edge_rows = [{"id": t.id, "family": t.suite, "pass": ref[t.id]["edge"]["pass"], "ttft": None,
                  "seconds": ref[t.id]["edge"]["seconds"], "tokens": {"edge": ref[t.id]["edge"]["tokens"], "cloud": 0},
                  "cloud_calls": 0, "cost": {"usd": 0.0, "cloud_passes": 0}} for t in tasks if "edge" in ref.get(t.id, {})]
    out: dict[str, Any] = {
        "tasks": len(tasks), "families": list(families), "quality_target": QUALITY_TARGET,
        "prices": prices.model_dump(),
        "all_edge": summarise(edge_rows, ref, prices),
        "previous_cascade": cascade_from_labels(ref, tasks, prices),
        "runs": {name: summarise(rows, ref, prices) for name, rows in runs.items()},
        "per_family": {name: {f: summarise([r for r in rows if r["family"] == f], ref, prices)
                              for f in families} for name, rows in runs.items()},
    }
    candidates = {n: rows for n, rows in runs.items() if n.startswith(tuple(args.candidates.split(",")))}
    if candidates:
        out["default_choice"] = lofo(candidates, ref, prices)
    live = RESULTS / "hybrid_policy_live.json"
    if live.exists():
        out["live"] = json.loads(live.read_text())
    (RESULTS / "hybrid_policy.json").write_text(json.dumps(out, indent=2) + "\n")
    print(_markdown(out) if args.markdown else json.dumps(out, indent=2))
    _plot(out)


#: Which ``live`` mode measured each row of the table (its TTFT and end-to-end time).
LIVE_ROW = {"all-edge": "edge", "token-old": "token-old", "checked-0.7": "checked-0.7"}


def _markdown(out: dict[str, Any]) -> str:
    """The README's table: one row per policy, ratios against the same answers all-cloud."""
    def f(v: Any, fmt: str = "{:.2f}") -> str:
        return "–" if v is None else fmt.format(v)

    default = out.get("default_choice", {}).get("in_suite_choice")
    rows = {"all-edge": out["all_edge"], "previous cascade": out["previous_cascade"], **out["runs"]}
    lines = ["| policy | quality vs all-cloud | cloud-written tokens | cloud calls / answer (mean, p50) | "
             "billed vs all-cloud (p50, max, pooled) | cloud passes vs all-cloud (pooled) | "
             "TTFT p50 / p90, RTT 0 · 50 ms | end-to-end vs edge-only, RTT 0 · 50 ms |",
             "|---|---|---|---|---|---|---|---|"]
    live = out.get("live", {}).get("rtt", {})
    for name, s in rows.items():
        if not s.get("tasks"):
            continue
        mode = "default" if name == default else LIVE_ROW.get(name)
        by_rtt = [live.get(r, {}).get(mode or "", {}) for r in ("0", "50")]
        ttft = " · ".join(f"{f(m.get('ttft_p50'))} / {f(m.get('ttft_p90'))} s" for m in by_rtt) if mode else "–"
        e2e = " · ".join(f(m.get("e2e_vs_edge_only")) + "×" for m in by_rtt) if mode else "–"
        label = f"**{name}** (default)" if name == default else name
        lines.append(
            f"| {label} | {f(s['quality_vs_all_cloud'], '{:.0%}')} | {f(s['cloud_token_share'], '{:.0%}')} | "
            f"{f(s['cloud_calls_mean'], '{:.1f}')}, {f(s['cloud_calls_p50'], '{:.0f}')} | "
            f"{f(s.get('cost_vs_all_cloud_p50'))}×, {f(s.get('cost_vs_all_cloud_max'))}×, "
            f"{f(s.get('cost_vs_all_cloud_pooled'))}× | {f(s.get('passes_vs_all_cloud_pooled'))}× | {ttft} | {e2e} |")
    held = out.get("default_choice", {}).get("held_out")
    if held and held.get("tasks"):
        lines.append(f"\nHeld out by family (each family answered by the policy chosen on the others): "
                     f"quality {held['quality_vs_all_cloud']:.0%} of all-cloud, billed "
                     f"{held['cost_vs_all_cloud_p50']:.2f}× all-cloud at p50 (pooled "
                     f"{held['cost_vs_all_cloud_pooled']:.2f}×), cloud passes {held['passes_vs_all_cloud_pooled']:.2f}×.")
    return "\n".join(lines)


def _plot(out: dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    points = {"all-edge": out["all_edge"], "previous cascade": out["previous_cascade"], **out["runs"]}
    for name, s in points.items():
        if not s.get("tasks"):
            continue
        x, y = s.get("cost_vs_all_cloud_pooled") or 0.0, s.get("quality_vs_all_cloud") or 0.0
        ax.scatter([x], [y])
        ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.scatter([1.0], [1.0], marker="*", s=120)
    ax.annotate("all-cloud", (1.0, 1.0), fontsize=7, xytext=(3, -10), textcoords="offset points")
    ax.axhline(QUALITY_TARGET, linestyle=":", linewidth=0.8)
    ax.set_xlabel("billed cost vs the same answers all-cloud (pooled)")
    ax.set_ylabel("quality vs all-cloud")
    ax.set_title(f"Hybrid modes on the development corpus ({out['tasks']} tasks, "
                 f"{len(out['families'])} families)")
    fig.tight_layout()
    fig.savefig(RESULTS / "hybrid_policy.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="answer the corpus sample with one mode, in this process")
    run.add_argument("--name", required=True)
    run.add_argument("--mode", required=True, choices=["checked", "verified", "token", "off-edge", "off-cloud"])
    run.add_argument("--trust", type=float)
    run.add_argument("--gate", type=float)
    run.add_argument("--span-tokens", type=int)
    run.add_argument("--max-calls", type=int)
    run.add_argument("--draft-max", type=int)
    run.add_argument("--families", help="comma list (default: every family both sides labelled)")
    run.add_argument("--per-family", type=int, default=14)
    run.add_argument("--ctx", type=int, default=5120)
    run.add_argument("--edge-model", default=EDGE_MODEL)
    run.add_argument("--cloud-model", default=CLOUD_MODEL)
    run.add_argument("--out-dir", default=str(RUNS), help="where NAME.jsonl goes (default: results/corpus/runs)")
    live = sub.add_parser("live", help="TTFT and time through a real server at a given round trip")
    live.add_argument("--modes", default=",".join(LIVE_MODES))
    live.add_argument("--rtt", default="0,50")
    live.add_argument("--families", help="comma list (default: every family both sides labelled)")
    live.add_argument("--per-family", type=int, default=2)
    live.add_argument("--ctx", type=int, default=5120)
    report = sub.add_parser("report", help="join the runs with the labels; choose the default held out by family")
    report.add_argument("--families", help="comma list (default: every family both sides labelled)")
    report.add_argument("--per-family", type=int, default=14)
    report.add_argument("--markdown", action="store_true", help="print the README's table instead of the JSON")
    report.add_argument("--candidates", default="checked,verified,token")
    args = parser.parse_args()
    {"run": cmd_run, "live": cmd_live, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
