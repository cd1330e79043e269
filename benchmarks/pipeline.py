"""Verified mode on the user's clock: strict rounds, pipelined rounds, all-cloud and all-edge.

Phases:

    python benchmarks/pipeline.py breakdown                  # where a check's time goes
    python benchmarks/pipeline.py live --split --rtt 0.05    # one core each, as on two machines
    python benchmarks/pipeline.py live --rtt 0.05            # the shared 2-core box
    python benchmarks/pipeline.py live --split --engine vllm # the cloud: vLLM launched by edgecloud serve
    python benchmarks/pipeline.py ttft --per-family 12       # the first token alone, many tasks
    python benchmarks/pipeline.py report --tag stream        # one client's runs pooled by setup -> JSON + PNG

``breakdown`` times the parts of one verification round on this machine: the server's forward
pass for a check of ``k`` drafted tokens (the engine alone, 1 and 2 threads), the same check
through HTTP on loopback (request build, session resolution, scheduler hand-off, logprob
extraction, response: the difference), the edge's drafting per token and the cost of drafting
again from the cloud's token after a rejection (the edge's roll-back).

``live`` starts ``edgecloud serve`` (1.5B, llama.cpp) behind :class:`~edgecloud.testing.LatencyProxy`
and answers a sample of the development corpus (``--per-family`` tasks of each of its families)
through the public client, four ways per task in a rotating order: all-cloud, all-edge (0.5B),
verified with strict rounds and verified pipelined (the default). With ``--split`` this process and
its edge run on core 0 and the server with one thread on core 1 (``taskset``). Every request's
user message carries its own tag, so no answer reuses another's prompt KV. Reported: TTFT p50/p90,
end to end p50 and its ratio to all-cloud and to the slower side alone, tokens/s, checks per
answer, the server's own forward passes (its /metrics counter, read past the proxy) against
all-cloud's, the client's pass count, billed cost, and quality (graded as the corpus is). Verified
mode fits nothing on the corpus, so its in-suite and held-out figures are the same.

``ttft`` measures the first token alone, on more tasks than whole answers allow: each task's first
``--tokens`` tokens through the public client, all-cloud and the defaults in alternating order (each
first as often), each request with its own tag; the per-task ratio's p50 with a bootstrap 90 %
interval, and by family.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _live import _answer, _check_ms, _interleave, _median_ms, _sample, _serve, _start_server
from chat_only import CLOUD_MODEL, EDGE_MODEL, OUTCOMES, RESULTS, _rows
from edgecloud.store import DEFAULT_EDGE_MODEL

POLICIES = ("all-cloud", "all-edge", "strict", "pipelined")
#: With ``--engine vllm``: what ``auto`` runs against a plain vLLM (text spans: it holds no token
#: session) and against vLLM launched by ``edgecloud serve`` (verified, through its checks plugin).
VLLM_POLICIES = ("all-cloud", "all-edge", "token", "verified")
PINS: dict[str, dict[str, Any]] = {
    "all-cloud": {"route": "cloud", "collab": "off"},
    "all-edge": {"route": "edge", "collab": "off"},
    "strict": {"collab": {"mode": "verified", "pipeline": False}},
    "pipelined": {},  # the defaults: collab=auto runs verified mode, pipelined
    "two-in-flight": {"collab": {"checks_in_flight": 2}},  # pipelined, the next check sent ahead on a sure bet
    "no-floor": {"collab": {"draft_confidence": 0}},  # the defaults before blocks ended where the edge is unsure
    "opening-1": {"collab": {"opening_tokens": 1}},  # the sides taking turns: the cloud writes the first token only
    "opening-8": {"collab": {"opening_tokens": 8}},  # the sides taking turns: the cloud writes the first 8 tokens
    # the edge drafting during checks: the cloud streams no opening (the prompt's check gives its first token),
    # or the first 16 tokens
    "stream-0": {"collab": {"stream_opening": 0}},
    "stream-16": {"collab": {"stream_opening": 16}},
    "token": {"collab": "token"},
    "verified": {},
}


def breakdown(args: argparse.Namespace) -> None:
    import httpx

    from edgecloud.edge.llamacpp import LlamaCppBackend
    from edgecloud.remote.client import CloudBackend
    from edgecloud.serving.llamacpp_engine import LlamaCppEngineBackend
    from edgecloud.store import resolve_model

    out: dict[str, Any] = {"cloud": CLOUD_MODEL, "edge": EDGE_MODEL}
    context = list(range(1000, 1300))  # a 300-token context the slot holds
    passes: dict[str, dict[str, float]] = {}
    for threads in (1, 2):
        engine = LlamaCppEngineBackend(str(resolve_model(CLOUD_MODEL)), n_ctx=2048, max_batch=2, threads=threads)
        engine.load()
        try:
            engine.score(context, start=len(context) - 1)
            row = {}
            for k in (0, 1, 3, 7, 11, 15):
                times = []
                for rep in range(args.reps):
                    tokens = context + [2000 + 20 * rep + j for j in range(k + 1)]  # last round's extra token + k drafts
                    started = time.perf_counter()
                    engine.score(tokens, start=len(context) + 1)
                    times.append(time.perf_counter() - started)
                    engine.score(context, start=len(context) - 1)  # back to the held context
                row[str(k)] = _median_ms(times)
            passes[f"{threads}_threads"] = row
            print(f"pass ms by drafted tokens, {threads} thread(s): {row}", file=sys.stderr)
        finally:
            engine.close()
    out["server_pass_ms_by_k"] = passes

    port = 18000 + os.getpid() % 1000
    server = _serve(str(resolve_model(CLOUD_MODEL)), port, 1, 1)
    try:
        cloud = CloudBackend(f"http://127.0.0.1:{port}/v1", model=CLOUD_MODEL)
        http = _check_ms(cloud, (0, 3, 7, 11), args.reps)
        cloud.close()
        out["http_check_ms_by_k_1_thread"] = http
        out["outside_the_pass_ms_by_k"] = {k: round(http[k] - passes["1_threads"][k], 1) for k in http}
        print(f"the same check through HTTP on loopback: {http}", file=sys.stderr)
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        server.terminate()
        server.wait(30)

    edge = LlamaCppBackend(str(resolve_model(EDGE_MODEL)), n_threads=1, n_ctx=2048)
    try:
        prompt = edge.tokenize_chat([{"role": "user", "content": "Write a Python function that sorts a list."}])
        edge.draft(prompt, 1)
        started = time.perf_counter()
        line = edge.draft(prompt, 32)
        per_token = (time.perf_counter() - started) / len(line)
        rollbacks = []
        for cut in (4, 12, 20):
            edge.draft(prompt + line, 1)
            started = time.perf_counter()
            edge.draft(prompt + line[:cut] + [line[cut] + 1], 1)  # the cloud's other token at ``cut``
            rollbacks.append(time.perf_counter() - started)
        out["edge_draft_ms_per_token_1_thread"] = round(1000 * per_token, 1)
        out["edge_rollback_and_first_draft_ms"] = _median_ms(rollbacks)
    finally:
        edge.close()
    path = RESULTS / "pipeline_breakdown.json"
    path.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=1))


def _summary(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    cloud = results["all-cloud"]
    edge = results.get("all-edge", cloud)  # without all-edge, the slower side is the cloud
    summary: dict[str, Any] = {}
    for name, rows in results.items():
        ok = [r for r in rows if "raised" not in r]
        pairs = [(r, c, e) for r, c, e in zip(rows, cloud, edge) if all("raised" not in x for x in (r, c, e))]
        ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
        summary[name] = {
            "answers": len(rows), "raised": len(rows) - len(ok),
            "quality": round(sum(r["pass"] for r in ok) / max(1, len(ok)), 4),
            "ttft_p50": round(statistics.median(ttfts), 3),
            "ttft_p90": round(ttfts[int(0.9 * (len(ttfts) - 1))], 3),
            "seconds_p50": round(statistics.median(r["seconds"] for r in ok), 3),
            "tokens_per_s_p50": round(statistics.median(r["tokens"] / r["seconds"] for r in ok if r["seconds"]), 2),
            "ttft_vs_all_cloud_p50": round(statistics.median(
                r["ttft"] / c["ttft"] for r, c, _ in pairs if r["ttft"] and c["ttft"]), 3),
            "e2e_vs_all_cloud_p50": round(statistics.median(r["seconds"] / c["seconds"] for r, c, _ in pairs), 3),
            "e2e_vs_slower_side_p50": round(statistics.median(
                r["seconds"] / max(c["seconds"], e["seconds"]) for r, c, e in pairs), 3),
            "checks_per_answer_p50": statistics.median(r["cloud_calls"] for r in ok),
            "server_passes_vs_all_cloud_p50": round(statistics.median(
                r["server_passes"] / c["server_passes"] for r, c, _ in pairs if c["server_passes"]), 4),
            "server_passes_vs_all_cloud_pooled": round(
                sum(r["server_passes"] for r in ok) / max(1.0, sum(c["server_passes"] for c in cloud)), 4),
            "client_passes_vs_server_pooled": round(
                sum(r["client_passes"] for r in ok) / max(1.0, sum(r["server_passes"] for r in ok)), 4),
            "billed_vs_all_cloud_p50": round(statistics.median(r["billed"] or 0.0 for r in ok), 4),
            "billed_vs_all_cloud_max": round(max(r["billed"] or 0.0 for r in ok), 4),
            "fallbacks": sum(r["fallbacks"] for r in ok),
            "modes": sorted({str(r["collab"]) for r in ok}),
        }
    for name in summary:
        summary[name]["quality_vs_all_cloud"] = round(
            summary[name]["quality"] / max(1e-9, summary["all-cloud"]["quality"]), 3)
        summary[name]["quality_by_family"] = {
            fam: round(statistics.mean(r["pass"] for r in results[name] if r.get("family") == fam and "raised" not in r), 3)
            for fam in sorted({r["family"] for r in results[name]})}
    return summary


def live(args: argparse.Namespace) -> None:
    from edgecloud import EdgeCloud
    from edgecloud.router.training.corpus import load_corpus
    from edgecloud.router.training.tasks import grade
    from edgecloud.store import resolve_model
    from edgecloud.testing import LatencyProxy

    tasks = {t.id: t for t in load_corpus(full=True)}
    outcomes = _rows(OUTCOMES)
    sample = _sample(outcomes, args.per_family, args.skip)
    split, vllm = args.split, args.engine == "vllm"
    policies = VLLM_POLICIES if vllm else POLICIES
    chosen = tuple(args.policies.split(",")) if args.policies else policies
    if "all-cloud" not in chosen or any(p not in PINS for p in chosen):
        raise SystemExit(f"--policies: all-cloud and any of {', '.join(PINS)}")
    same_prompt = bool(args.temperature) or args.same_prompt
    server, port = _start_server(CLOUD_MODEL if vllm else str(resolve_model(CLOUD_MODEL)), split, args.engine)
    try:
        # the client makes its edge backends as a user's would: the edge model writes (all-edge), the
        # draft model drafts (verified); split, this process's affinity (core 0) gives them one thread
        with LatencyProxy(("127.0.0.1", port), rtt_s=args.rtt) as net, \
                EdgeCloud(args.edge, edge_draft_model=args.draft, cloud_base_url=f"{net.url}/v1",
                          cloud_model=CLOUD_MODEL, config={"fallback": {"timeout_s": 300}}) as client:
            _answer(client, {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})  # warm
            def sampled(row: dict[str, Any]) -> dict[str, Any]:  # one seed per task, the same for every policy
                seed = int(hashlib.sha256(row["id"].encode()).hexdigest()[:8], 16)
                return {"temperature": args.temperature, "seed": seed} if args.temperature else {}

            def tagged(tag: str) -> str:  # sampled, or --same-prompt: one prompt per task for every policy (the
                return tag.split("-")[0] if same_prompt else tag  # same positions, the same noise: texts compare)

            results = _interleave(sample, chosen, port,
                                  lambda name, row, tag: _answer(client, row, tag=tagged(tag), **PINS[name], **sampled(row)),
                                  lambda row, text: grade(tasks[row["id"]], text))
    finally:
        server.terminate()
        server.wait(30)
    summary = _summary(results)
    if same_prompt:  # the same prompt (and seed): the text all-cloud writes, whoever writes it with the cloud
        for name, rows in results.items():
            same = [r["text_sha"] == c["text_sha"] for r, c in zip(rows, results["all-cloud"])
                    if "raised" not in r and "raised" not in c]
            summary[name]["same_text_as_all_cloud"] = round(sum(same) / max(1, len(same)), 3)
    draft = client.hybrid.draft_model()  # another file than the edge model's drafts: its name is in the file's
    out = {"rtt_s": args.rtt, "split_cores": split, "temperature": args.temperature, "tasks": len(sample),
           "engine": args.engine, "same_prompt": args.same_prompt, "per_family": args.per_family, "edge": args.edge,
           "draft": draft or args.edge, "cloud": CLOUD_MODEL, "summary": summary,
           "answers": results}
    skip_tag = f"_skip{args.skip}" if args.skip else ""
    skip_tag += "" if args.edge == EDGE_MODEL else f"_{Path(args.edge).name.removesuffix('.gguf')}"  # not the corpus's
    skip_tag += f"_draft-{Path(draft).name.removesuffix('.gguf')}" if draft else ""
    name = f"pipeline_live_{_setup(out)}{skip_tag}{f'_{args.tag}' if args.tag else ''}.json"
    (RESULTS / name).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=1))


def ttft(args: argparse.Namespace) -> None:
    import random

    from edgecloud import EdgeCloud
    from edgecloud.store import resolve_model
    from edgecloud.testing import LatencyProxy

    sample = _sample(_rows(OUTCOMES), args.per_family, args.skip)
    server, port = _start_server(str(resolve_model(CLOUD_MODEL)), args.split)
    rows: list[dict[str, Any]] = []
    try:
        with LatencyProxy(("127.0.0.1", port), rtt_s=args.rtt) as net, \
                EdgeCloud(cloud_base_url=f"{net.url}/v1", cloud_model=CLOUD_MODEL,
                          config={"fallback": {"timeout_s": 300}}) as client:
            _answer(client, {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})  # warm
            for i, row in enumerate(sample):
                short = {**row, "max_tokens": args.tokens}
                got: dict[str, Any] = {}
                for name in (("all-cloud", "default") if i % 2 else ("default", "all-cloud")):
                    got[name] = _answer(client, short, tag=f"t{i}-{name}", **PINS["all-cloud" if name == "all-cloud"
                                                                                  else "pipelined"])
                rows.append({"id": row["id"], "family": row["suite"],
                             **{f"{n}_ttft": g.get("ttft") for n, g in got.items()},
                             "collab": got["default"].get("collab"),
                             "raised": [f"{n}: {g['raised']}" for n, g in got.items() if "raised" in g]})
                print(f"{i + 1}/{len(sample)} {row['id']}", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(30)
    paired = [r for r in rows if r["all-cloud_ttft"] and r["default_ttft"]]
    ratios = _ttft_ratios(paired)
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    summary = {
        "tasks": len(rows), "paired": len(paired), "raised": sum(bool(r["raised"]) for r in rows),
        "ttft_vs_all_cloud_p50": round(statistics.median(ratios), 3),
        "ttft_vs_all_cloud_p50_interval_90": [round(boot[100], 3), round(boot[1899], 3)],
        "ttft_p50": {n: round(statistics.median(r[f"{n}_ttft"] for r in paired), 3) for n in ("all-cloud", "default")},
        "ttft_p50_ratio_of_p50s": round(statistics.median(r["default_ttft"] for r in paired)
                                        / statistics.median(r["all-cloud_ttft"] for r in paired), 3),
        "by_family": {f: round(statistics.median(x for x, r in zip(ratios, paired) if r["family"] == f), 3)
                      for f in sorted({r["family"] for r in paired})},
        "modes": sorted({str(r["collab"]) for r in rows})}
    out = {"rtt_s": args.rtt, "split_cores": args.split, "tokens": args.tokens, "per_family": args.per_family,
           "skip": args.skip, "cloud": CLOUD_MODEL, "summary": summary, "rows": rows}
    name = (f"pipeline_ttft_{'split' if args.split else 'shared'}_rtt{int(round(args.rtt * 1000))}_skip{args.skip}"
            f"{f'_{args.tag}' if args.tag else ''}.json")
    (RESULTS / name).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=1))


def _setup(run: dict[str, Any]) -> str:
    """A live run's setup as its results file names it (``split_rtt50``, ``vllm_shared_rtt0_t0.7``):
    the engine, one prompt for every policy or not, split cores or the shared box, the round trip, the
    temperature. Runs of one setup (and one client) pool. (Runs from before a field was recorded
    had its default: the llama.cpp engine, a prompt of its own per policy.)"""
    engine = "vllm_" if run.get("engine") == "vllm" else ""
    same = "same_prompt_" if run.get("same_prompt") else ""
    sampled = f"_t{run['temperature']:g}" if run.get("temperature") else ""
    return f"{engine}{same}{'split' if run['split_cores'] else 'shared'}_rtt{int(round(run['rtt_s'] * 1000))}{sampled}"


def _ttft_ratios(rows: list[dict[str, Any]]) -> list[float]:
    """Per-task first-token ratios, the default client against all-cloud, of ``ttft`` rows where both answered."""
    return [r["default_ttft"] / r["all-cloud_ttft"] for r in rows if r["all-cloud_ttft"] and r["default_ttft"]]


def _pooled(tag: str) -> dict[str, Any]:
    """The live runs of one client (files ending in ``_{tag}``) pooled by setup (shared box or one
    core each, the round trip, the engine): each setup's answers of every run, summarised as one run
    for the policies every run of it answered (the slower side is the cloud where all-edge did not
    run); with the paired TTFT runs of the same tag."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(RESULTS.glob(f"pipeline_live_*_{tag}.json")):
        run = json.loads(path.read_text(encoding="utf-8"))
        groups.setdefault(_setup(run), []).append(run)
    out: dict[str, Any] = {"tag": tag, "setups": {}}
    for setup, runs in groups.items():
        common = [p for p in runs[0]["answers"] if all(p in r["answers"] for r in runs)]
        pooled = {p: [a for r in runs for a in r["answers"][p]] for p in common}
        out["setups"][setup] = {"runs": len(runs), "tasks": len(pooled["all-cloud"]),
                                "split_cores": runs[0]["split_cores"], "rtt_s": runs[0]["rtt_s"],
                                "summary": _summary(pooled)}
    ttfts = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(RESULTS.glob(f"pipeline_ttft_*_{tag}.json"))]
    ratios = _ttft_ratios([r for t in ttfts for r in t["rows"]])
    if ratios:
        out["ttft_alone"] = {"tasks": len(ratios), "ttft_vs_all_cloud_p50": round(statistics.median(ratios), 3)}
    return out


def report(args: argparse.Namespace) -> None:
    pooled = _pooled(args.tag)
    if not pooled["setups"]:
        raise SystemExit(f"no results/pipeline_live_*_{args.tag}.json: run `pipeline.py live ... --tag {args.tag}`")
    (RESULTS / f"pipeline_report_{args.tag}.json").write_text(json.dumps(pooled, indent=1) + "\n", encoding="utf-8")
    table = [{"setup": setup, "runs": g["runs"], "tasks": g["tasks"], "policy": name, **{
        k: s[k] for k in ("ttft_vs_all_cloud_p50", "e2e_vs_all_cloud_p50", "e2e_vs_slower_side_p50",
                          "server_passes_vs_all_cloud_pooled", "billed_vs_all_cloud_p50", "quality_vs_all_cloud")}}
        for setup, g in pooled["setups"].items() for name, s in g["summary"].items()]
    print(json.dumps({"table": table, "ttft_alone": pooled.get("ttft_alone")}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups = pooled["setups"]

    def label(setup: str) -> str:  # "one core each\nRTT 50 ms"
        g = groups[setup]
        return f"{'one core each' if g['split_cores'] else 'shared 2 cores'}\nRTT {int(round(g['rtt_s'] * 1000))} ms"

    setups = sorted(groups, key=lambda n: (not groups[n]["split_cores"], groups[n]["rtt_s"], n))
    policies = [p for p in ("all-cloud", "all-edge", "pipelined") if any(t["policy"] == p for t in table)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, title in ((axes[0], "e2e_vs_all_cloud_p50", "end to end p50 / all-cloud"),
                           (axes[1], "ttft_vs_all_cloud_p50", "TTFT p50 / all-cloud")):
        width = 0.8 / len(policies)
        for j, policy in enumerate(policies):
            values = [next((t[key] for t in table if t["setup"] == n and t["policy"] == policy), 0) for n in setups]
            ax.bar([i + width * j for i in range(len(setups))], values, width=width,
                   label="the default client" if policy == "pipelined" else policy)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(setups))],
                      [f"{label(n)}\n({groups[n]['tasks']} tasks)" for n in setups], fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(title)
    axes[0].legend(fontsize=8, loc="upper left", ncols=3, bbox_to_anchor=(0, 1.22))
    fig.suptitle(f"pooled runs of the client tagged {args.tag!r}", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "pipeline.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="phase", required=True)
    bd = sub.add_parser("breakdown")
    bd.add_argument("--reps", type=int, default=5)
    lv = sub.add_parser("live")
    lv.add_argument("--per-family", type=int, default=1)
    lv.add_argument("--skip", type=int, default=0, help="tasks of each family to skip (another sample)")
    lv.add_argument("--rtt", type=float, default=0.05, help="round trip to the cloud, seconds (LatencyProxy)")
    lv.add_argument("--split", action="store_true", help="this process and its edge on core 0, the server on core 1")
    lv.add_argument("--engine", choices=("llamacpp", "vllm"), default="llamacpp",
                    help="the cloud: edgecloud serve's llama.cpp engine, or vLLM launched by it (policies "
                         "all-cloud, all-edge, token: what auto runs on a plain vLLM, verified: the defaults)")
    lv.add_argument("--same-prompt", action="store_true",
                    help="one prompt per task for every policy (texts compare; later policies may find the "
                         "prompt's KV cached, so read latency from a run without it)")
    lv.add_argument("--edge", default=DEFAULT_EDGE_MODEL,
                    help="the edge model: a catalogue name or a GGUF path (default: the client's; a run with "
                         "another edge than the corpus's published 0.5B has its name in the file's)")
    lv.add_argument("--draft", default="auto",
                    help="what verified mode drafts with (the client's edge_draft_model: auto, a catalogue name or "
                         "GGUF path, '' for the edge model itself); a run whose drafts come from another file than "
                         "the edge model's has its name in the file's")
    lv.add_argument("--policies", default="", help="a comma-separated subset (all-cloud among them)")
    lv.add_argument("--tag", default="", help="appended to the results file's name (a run of a changed client)")
    lv.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (each task one seed, the same for every policy)")
    tt = sub.add_parser("ttft")
    tt.add_argument("--per-family", type=int, default=12)
    tt.add_argument("--skip", type=int, default=0, help="tasks of each family to skip (another sample)")
    tt.add_argument("--rtt", type=float, default=0.0, help="round trip to the cloud, seconds (LatencyProxy)")
    tt.add_argument("--split", action="store_true", help="this process and its edge on core 0, the server on core 1")
    tt.add_argument("--tokens", type=int, default=4, help="tokens asked of each answer (max_tokens)")
    tt.add_argument("--tag", default="", help="appended to the results file's name (a run of a changed client)")
    rp = sub.add_parser("report")
    rp.add_argument("--tag", default="stream", help="the client whose live runs (files ending in _TAG) are pooled")
    args = parser.parse_args()
    {"breakdown": breakdown, "live": live, "ttft": ttft, "report": report}[args.phase](args)


if __name__ == "__main__":
    main()
