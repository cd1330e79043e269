"""The hybrid for a cloud that only chats (hosted APIs): which policy, chosen held out by family.

A hosted chat API neither scores a continuation nor continues an assistant message, so an answer
is written by one side; what is left to decide is which, and when. Candidates:

* ``router`` - the pre-generation score (:mod:`edgecloud.router.scorers`), before the edge writes;
* ``probe-N`` - the edge writes its first N tokens unseen; a logistic fit on their logprobs (mean,
  minimum, 10th percentile, share below p=0.5, top-1 margin, whether the answer already ended)
  says stream the edge's answer or ask the cloud for the whole answer (``collab="probe"``);
* ``probe-N+router`` - the same with the router's score as one more feature;
* ``cascade`` - the edge's whole answer, buffered, then the confidence check
  (:mod:`edgecloud.router.cascade`, as packaged);
* ``random`` and ``oracle`` as floor and ceiling.

Phases:

    python benchmarks/chat_only.py probe            # the edge's first 48 tokens on every labelled task
    python benchmarks/chat_only.py head --m 16      # the cloud's first M tokens, the edge's tail (lead mode)
    python benchmarks/chat_only.py lead-signal --m 48   # the edge's agreement with the cloud's opening
    python benchmarks/chat_only.py cloud-signal --m 16  # the cloud's own logprobs of its opening
    python benchmarks/chat_only.py report           # JSON to stdout + results/chat_only.json, probe.json
    python benchmarks/chat_only.py live --per-family 3 --rtt 0.05   # through the hosted-API stand-in

``probe`` runs the 0.5B edge (llama.cpp, greedy, one request at a time as a device runs them) on
the 344 tasks of ``results/corpus/outcomes.jsonl`` and keeps each token's logprob and top-2 margin.
``report`` replays: an answer the policy keeps on the edge is the edge's labelled answer (greedy:
the probe's tokens are its first tokens), one it escalates is the cloud's labelled answer, billed
whole (the probe's tokens never reach the cloud). Each probe fit is scored leave-one-family-out:
fitted on seven families, its threshold chosen there (the lowest escalation rate that keeps
``QUALITY_TARGET`` of all-cloud quality there), applied to the eighth. The packaged check
(``src/edgecloud/router/probe.json``) is the fit on all families with the threshold chosen the same
way. ``live`` answers a sample through :class:`~edgecloud.testing.HostedChatProxy` in front of a
real ``edgecloud serve`` (1.5B) with the default client and all-cloud, interleaved: TTFT,
end-to-end, whether anything raised, and the route notes.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _live import _answer, _interleave, _sample, _start_server

RESULTS = Path(__file__).parent / "results"
CORPUS = RESULTS / "corpus"
OUTCOMES = CORPUS / "outcomes.jsonl"
PROBES = CORPUS / "probe.edge.jsonl"
EDGE_MODEL = "qwen2.5-coder-0.5b-instruct-q4"
CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct-q4"
PROBE_TOKENS = 48
TOP = 5


def _corpus(edge: str) -> Path:
    """Where the edge-written corpus files live: ``corpus/`` for the corpus's own edge (the published
    0.5B), ``corpus/<edge>/`` for another edge (``head``, ``lead-signal``, ``lead-report --edge``)."""
    if edge == EDGE_MODEL:
        return CORPUS
    folder = CORPUS / Path(edge).name.removesuffix(".gguf")
    folder.mkdir(exist_ok=True)
    return folder


def _folder(args: argparse.Namespace) -> tuple[Path, Path]:
    """(outcomes file, folder for what a phase writes): the corpus's, or ``--tasks DIR``'s own
    (``DIR/outcomes.jsonl``: tasks labelled apart from the corpus, e.g. ``lead_copy.py fresh``)."""
    if args.tasks:
        return Path(args.tasks) / "outcomes.jsonl", Path(args.tasks)
    return OUTCOMES, _corpus(args.edge)


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run: that task is probed again
    return out


def probe(args: argparse.Namespace) -> None:
    from edgecloud.edge.llamacpp import LlamaCppBackend
    from edgecloud.types import ChatRequest

    done = {r["id"] for r in _rows(PROBES)}
    todo = [r for r in _rows(OUTCOMES) if r["id"] not in done]
    print(f"probing {len(todo)} tasks ({len(done)} done)", file=sys.stderr)
    with LlamaCppBackend(EDGE_MODEL) as edge, PROBES.open("a", encoding="utf-8") as fh:
        for i, row in enumerate(todo):
            request = ChatRequest(messages=row["messages"], max_tokens=min(PROBE_TOKENS, row["max_tokens"]),
                                  temperature=0.0, logprobs=True, top_logprobs=TOP)
            started, first, text, tokens = time.perf_counter(), None, "", []
            for chunk in edge.stream(request):
                for choice in chunk.choices:
                    if choice.delta.content and first is None:
                        first = time.perf_counter() - started
                    text += choice.delta.content or ""
                    for entry in (choice.logprobs.content if choice.logprobs else []):
                        alts = sorted((t.logprob for t in entry.top_logprobs), reverse=True)
                        second = next((a for a in alts if a < entry.logprob - 1e-9), alts[1] if len(alts) > 1 else -30.0)
                        tokens.append([round(entry.logprob, 5), round(second, 5)])
                    if choice.finish_reason is not None:
                        finish = choice.finish_reason
            out = {"id": row["id"], "tokens": tokens, "text": text, "finish": finish,
                   "ttft": round(first or 0.0, 4), "seconds": round(time.perf_counter() - started, 4),
                   "prefix_of_label": row["edge_answer"].startswith(text.rstrip())}
            fh.write(json.dumps(out) + "\n")
            fh.flush()
            if i % 20 == 0:
                print(f"{i + 1}/{len(todo)} {row['id']} {out['seconds']:.2f}s", file=sys.stderr)


# ---------------------------------------------------------------------------- cloud head, edge tail


def head(args: argparse.Namespace) -> None:
    """The cloud writes the first M tokens (its labelled greedy answer's), the edge the rest
    (greedy, batched: near-ties may round differently from one request at a time); graded."""
    from edgecloud.router.training.corpus import load_corpus
    from edgecloud.router.training.tasks import grade
    from edgecloud.runtime.llamacpp_batch import BatchedGreedy, BatchJob

    class Continuing(BatchedGreedy):
        def encode(self, messages: list[dict[str, str]]) -> list[int]:
            text = self._template.prompt(messages, continue_final=messages[-1]["role"] == "assistant")
            return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    tasks = {t.id: t for t in load_corpus(full=True)}
    outcomes, folder = _folder(args)
    out_path = folder / f"head-{args.m}.edge.jsonl"
    done = {r["id"] for r in _rows(out_path)}
    rows = [r for r in _rows(outcomes) if r["id"] not in done and r["id"] in tasks]
    with Continuing(args.edge, parallel=args.parallel, n_ctx=args.parallel * 1024) as runner, \
            out_path.open("a", encoding="utf-8") as fh:
        llm = runner._llm
        jobs, heads = [], {}
        for r in rows:
            ids = llm.tokenize(r["cloud_answer"].encode("utf-8"), add_bos=False, special=False)
            if len(ids) <= args.m:  # the cloud wrote the whole answer within its head
                fh.write(json.dumps({"id": r["id"], "head": r["cloud_answer"], "pass": r["cloud_pass"],
                                     "head_tokens": len(ids), "tail_tokens": 0, "cloud_whole": True}) + "\n")
                continue
            text = llm.detokenize(ids[: args.m]).decode("utf-8", errors="ignore")
            heads[r["id"]] = (text, args.m)
            jobs.append(BatchJob(r["id"], [*r["messages"], {"role": "assistant", "content": text}],
                                 max(1, r["max_tokens"] - args.m)))
        print(f"{len(jobs)} tails to write", file=sys.stderr)
        for i, result in enumerate(runner.run(jobs)):
            text, m = heads[result.key]
            answer = text + result.text
            fh.write(json.dumps({"id": result.key, "head": text, "tail": result.text,
                                 "pass": grade(tasks[result.key], answer), "head_tokens": m,
                                 "tail_tokens": result.tokens, "cloud_whole": False}) + "\n")
            fh.flush()
            if i % 25 == 0:
                print(f"{i + 1}/{len(jobs)}", file=sys.stderr)


def lead_signal(args: argparse.Namespace) -> None:
    """How the edge scores the cloud's opening (the lead of ``head-M``): each head token's logprob
    under the edge given the prompt and the tokens before it (one pass per task)."""
    from edgecloud.edge.llamacpp import LlamaCppBackend

    outcomes, folder = _folder(args)
    heads = {r["id"]: r for r in _rows(folder / f"head-{args.m}.edge.jsonl")}
    out_path = folder / f"lead-{args.m}.signal.jsonl"
    done = {r["id"] for r in _rows(out_path)}
    rows = [r for r in _rows(outcomes) if r["id"] in heads and r["id"] not in done]
    with LlamaCppBackend(args.edge, n_ctx=2048) as edge, out_path.open("a", encoding="utf-8") as fh:
        for i, r in enumerate(rows):
            prompt = edge.tokenize_chat(r["messages"])
            lead = edge.tokenize_text(heads[r["id"]]["head"])[: args.m]
            scores, _ = edge.score(prompt + lead, start=len(prompt), top_n=1)
            fh.write(json.dumps({"id": r["id"], "logprobs": [round(s.logprob, 5) for s in scores],
                                 "agree": [int(s.top[0][0] == s.token) if s.top else 0 for s in scores]}) + "\n")
            if i % 50 == 0:
                print(f"{i + 1}/{len(rows)}", file=sys.stderr)


def cloud_signal(args: argparse.Namespace) -> None:
    """How sure the cloud is of its own opening (what a hosted API's ``logprobs`` would say while it
    streams): each of its first M tokens' logprob and top-2 margin under the 1.5B (one pass per task)."""
    from edgecloud.edge.llamacpp import LlamaCppBackend

    out_path = CORPUS / f"cloud-{args.m}.signal.jsonl"
    done = {r["id"] for r in _rows(out_path)}
    rows = [r for r in _rows(OUTCOMES) if r["id"] not in done]
    with LlamaCppBackend(CLOUD_MODEL, n_ctx=2048) as cloud, out_path.open("a", encoding="utf-8") as fh:
        for i, r in enumerate(rows):
            prompt = cloud.tokenize_chat(r["messages"])
            opening = cloud.tokenize_text(r["cloud_answer"])[: args.m]
            if not opening:
                fh.write(json.dumps({"id": r["id"], "logprobs": [], "margins": []}) + "\n")
                continue
            scores, _ = cloud.score(prompt + opening, start=len(prompt), top_n=2)
            fh.write(json.dumps({"id": r["id"], "logprobs": [round(s.logprob, 5) for s in scores],
                                 "margins": [round(s.top[0][1] - s.top[1][1], 5) if len(s.top) > 1 else 99.0
                                             for s in scores]}) + "\n")
            if i % 50 == 0:
                print(f"{i + 1}/{len(rows)}", file=sys.stderr)


# ---------------------------------------------------------------------------- report (replay)

QUALITY_TARGET = 0.92  # of all-cloud quality on the families a threshold is chosen on (the bar is 0.90)
PROBE_LENGTHS = (8, 16, 32, 48)


def _joined() -> list[dict[str, Any]]:
    probes = {r["id"]: r for r in _rows(PROBES)}
    rows = [r for r in _rows(OUTCOMES) if r["id"] in probes]
    for r in rows:
        r["probe"] = probes[r["id"]]
    return rows


def _features(row: dict[str, Any], n: int, router: bool) -> list[float]:
    from edgecloud.router.probe import probe_features

    tokens = row["probe"]["tokens"]
    finished = row["probe"]["finish"] == "stop" and len(tokens) <= n
    x = probe_features([tuple(t) for t in tokens[:n]], finished)
    return x + [row["router_score"]] if router else x


def _fit(xs: list[list[float]], ys: list[int]) -> tuple[list[float], list[float], list[float], float]:
    """A standardised logistic fit: (mean, scale, weights, bias)."""
    from sklearn.linear_model import LogisticRegression

    cols = list(zip(*xs))
    mean = [statistics.fmean(c) for c in cols]
    scale = [statistics.pstdev(c) or 1.0 for c in cols]
    z = [[(v - m) / s for v, m, s in zip(x, mean, scale)] for x in xs]
    model = LogisticRegression(C=1.0, max_iter=1000).fit(z, ys)
    return mean, scale, [float(w) for w in model.coef_[0]], float(model.intercept_[0])


def _predict(fit: tuple[list[float], list[float], list[float], float], x: list[float]) -> float:
    mean, scale, weights, bias = fit
    zsum = bias + sum(w * (v - m) / s for w, v, m, s in zip(weights, x, mean, scale))
    return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, zsum))))


def _threshold(scores: list[float], rows: list[dict[str, Any]], target: float) -> float:
    """The highest threshold (fewest escalations) whose answers keep ``target`` of all-cloud quality."""
    cloud_q = sum(r["cloud_pass"] for r in rows)
    for t in sorted(set(scores), reverse=True) + [-1.0]:
        q = sum((r["cloud_pass"] if s >= t else r["edge_pass"]) for s, r in zip(scores, rows))
        if q >= target * cloud_q:
            return t
    return -1.0


def _apgr(scores: list[float], rows: list[dict[str, Any]]) -> float:
    """Area under the gap-recovered curve, escalating tasks in order of ``scores`` (random: 0.5)."""
    q_edge, q_cloud = sum(r["edge_pass"] for r in rows), sum(r["cloud_pass"] for r in rows)
    gap = q_cloud - q_edge
    order = sorted(range(len(rows)), key=lambda i: -scores[i])
    q, area = q_edge, 0.0
    for i in order:
        q += rows[i]["cloud_pass"] - rows[i]["edge_pass"]
        area += (q - q_edge) / gap if gap else 0.0
    return area / len(rows)


def _billed(row: dict[str, Any], cloud_tokens: int | None) -> float:
    """What an answer costs against the same answer all-cloud at the default prices: the cloud
    billed for the prompt and ``cloud_tokens`` of its answer (None: nothing sent to the cloud)."""
    if cloud_tokens is None:
        return 0.0
    p, c = row["prompt_tokens"], max(1, row["cloud_tokens"])
    return min(1.0, (p * 0.5 + min(cloud_tokens, c) * 1.5) / (p * 0.5 + c * 1.5))


def _summary(rows: list[dict[str, Any]], escalated: list[bool], passes: list[bool] | None = None,
             billed: list[float] | None = None) -> dict[str, Any]:
    """Quality and cost of a policy: ``escalated`` answers are the cloud's whole (unless ``passes`` and
    ``billed`` say otherwise, per row)."""
    n = len(rows)
    if passes is None:
        passes = [bool(r["cloud_pass"] if e else r["edge_pass"]) for r, e in zip(rows, escalated)]
    if billed is None:
        billed = [1.0 if e else 0.0 for e in escalated]
    q = sum(passes)
    q_cloud, q_edge = sum(r["cloud_pass"] for r in rows), sum(r["edge_pass"] for r in rows)
    ordered = sorted(billed)
    return {"tasks": n, "quality": round(q / n, 4), "quality_vs_all_cloud": round(q / q_cloud, 4),
            "gap_recovered": round((q - q_edge) / (q_cloud - q_edge), 4) if q_cloud != q_edge else None,
            "cloud_answers": round(sum(escalated) / n, 4), "billed_vs_all_cloud_p50": round(statistics.median(ordered), 4),
            "billed_vs_all_cloud_p90": round(ordered[int(0.9 * (n - 1))], 4),
            "billed_vs_all_cloud_mean": round(sum(billed) / n, 4),
            "answers_above_all_cloud": sum(b > 1.0 for b in billed)}


ZERO_SHOT = {"mean_logprob": -1.0, "share_below_half": 1.0, "mean_margin": -1.0}


def _zero_shot(n: int, feature: str) -> Any:
    """A signal with nothing fitted but its threshold: ``sign * feature`` of the first ``n`` tokens."""
    from edgecloud.router.probe import FEATURES

    j, sign = FEATURES.index(feature), ZERO_SHOT[feature]
    return lambda train: (lambda r: 1.0 / (1.0 + math.exp(-sign * _features(r, n, False)[j])))


def _signals() -> dict[str, Any]:
    """Each candidate: a fitter that takes training rows and returns a scoring function, so a
    held-out score always comes from a fit that did not see the row's family."""
    def probe_fitter(n: int, router: bool) -> Any:
        def fit(train: list[dict[str, Any]]) -> Any:
            f = _fit([_features(r, n, router) for r in train], [int(r["gain"]) for r in train])
            return lambda r: _predict(f, _features(r, n, router))
        return fit

    out: dict[str, Any] = {"router": lambda train: (lambda r: r["router_score"])}
    for n in PROBE_LENGTHS:
        for feature in ZERO_SHOT:
            out[f"probe-{n}:{feature}"] = _zero_shot(n, feature)
        out[f"probe-{n}:fitted"] = probe_fitter(n, False)
        out[f"probe-{n}:fitted+router"] = probe_fitter(n, True)
    out["cascade"] = lambda train: (lambda r: 1.0 - r["cascade_p_good"])
    out["answer-logprob"] = lambda train: (lambda r: -r["edge_logprob"]["mean"])
    return out


def report(args: argparse.Namespace) -> None:
    from edgecloud.router.cascade import ConfidenceCheck, signals
    from edgecloud.router.probe import FEATURES, ProbeCheck
    from edgecloud.router.scorers import load_scorer
    from edgecloud.types import ChatRequest

    rows = _joined()
    scorer, check = load_scorer("learned"), ConfidenceCheck.packaged()
    for r in rows:
        r["gain"] = (not r["edge_pass"]) and r["cloud_pass"]
        r["router_score"] = scorer.score(ChatRequest(messages=r["messages"], max_tokens=r["max_tokens"]))
        prompt = next(m["content"] for m in reversed(r["messages"]) if m["role"] == "user")
        sig = signals(prompt, r["edge_answer"], finish_reason=r["edge_finish"], logprobs=r["edge_logprob"],
                      route_score=r["router_score"])
        r["cascade_p_good"] = check.p_good(sig)
    families = sorted({r["suite"] for r in rows})
    prefix_ok = sum(r["probe"]["prefix_of_label"] for r in rows)
    result: dict[str, Any] = {
        "tasks": len(rows), "families": families, "quality_target_in_training": QUALITY_TARGET,
        "probe_text_is_prefix_of_labelled_answer": round(prefix_ok / len(rows), 4),
        "probe_seconds_p50": {n: round(statistics.median(_probe_seconds(r, n) for r in rows), 3)
                              for n in PROBE_LENGTHS},
        "all_edge": _summary(rows, [False] * len(rows)), "all_cloud": _summary(rows, [True] * len(rows)),
        "oracle": _summary(rows, [bool(r["gain"]) for r in rows]),
        "policies": {}, "apgr_held_out": {}, "apgr_in_suite": {},
        "notes": "router and cascade were fitted on this corpus: their held-out figures are in-suite ones",
    }
    rng = random.Random(0)
    for name, fitter in _signals().items():
        held_scores: dict[str, float] = {}
        escalated: dict[str, bool] = {}
        per_family = {}
        for fam in families:
            train = [r for r in rows if r["suite"] != fam]
            test = [r for r in rows if r["suite"] == fam]
            score = fitter(train)
            t = _threshold([score(r) for r in train], train, QUALITY_TARGET)
            for r in test:
                held_scores[r["id"]] = score(r)
                escalated[r["id"]] = held_scores[r["id"]] >= t
            per_family[fam] = _summary(test, [escalated[r["id"]] for r in test])
        result["apgr_held_out"][name] = round(_apgr([held_scores[r["id"]] for r in rows], rows), 4)
        whole = fitter(rows)
        result["apgr_in_suite"][name] = round(_apgr([whole(r) for r in rows], rows), 4)
        result["policies"][name] = {"held_out": _summary(rows, [escalated[r["id"]] for r in rows]),
                                    "per_family_held_out": per_family}
    result["apgr_held_out"]["random"] = round(_apgr([rng.random() for _ in rows], rows), 4)
    result["lead"] = _lead_policies(rows, families)
    # the packaged check: the zero-shot probe signal with the best held-out result
    zero_shot = [k for k in result["policies"] if k.startswith("probe-") and ":fitted" not in k]
    best = max(zero_shot, key=lambda k: (result["policies"][k]["held_out"]["quality_vs_all_cloud"] >= 0.9,
                                         -result["policies"][k]["held_out"]["billed_vs_all_cloud_mean"]))
    n, feature = int(best.split(":")[0].split("-")[1]), best.split(":")[1]
    score = _zero_shot(n, feature)(rows)
    threshold = _threshold([score(r) for r in rows], rows, QUALITY_TARGET)
    weights = tuple(ZERO_SHOT[feature] if f == feature else 0.0 for f in FEATURES)
    packaged = ProbeCheck(tokens=n, mean=(0.0,) * len(FEATURES), scale=(1.0,) * len(FEATURES), weights=weights,
                          bias=0.0, threshold=round(threshold, 6))
    result["packaged"] = {"policy": best, "tokens": n, "feature": feature, "threshold": round(threshold, 4),
                          "in_suite": _summary(rows, [score(r) >= threshold for r in rows]),
                          "held_out": result["policies"][best]["held_out"]}
    if args.write_check:
        path = Path(__file__).resolve().parents[1] / "src/edgecloud/router/data/probe.json"
        path.write_text(json.dumps(packaged.to_json(), indent=1) + "\n", encoding="utf-8")
    (RESULTS / "chat_only.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: result[k] for k in ("tasks", "all_edge", "oracle", "apgr_held_out", "packaged", "lead")},
                     indent=1))


LEAD_TARGETS = (0.90, 0.92)


def _lead_policies(rows: list[dict[str, Any]], families: list[str], corpus: Path = CORPUS) -> dict[str, Any]:
    """Lead mode replayed: ``lead-M`` (the cloud's first M tokens, then the edge's tail, always;
    ``head`` phase) and ``lead-M:SIGNAL@TARGET`` (the edge takes over only where it agrees with the
    cloud's opening, ``lead-signal`` phase; elsewhere the cloud writes the whole answer), the
    threshold chosen leave-one-family-out for ``TARGET`` of all-cloud quality on the other families.
    ``corpus``: another edge's folder (``_corpus``) replays its tails and agreement; the later-chances
    and second-signal replays are the corpus edge's only."""
    out: dict[str, Any] = {}
    for path in sorted(corpus.glob("head-*.edge.jsonl")):
        m = int(path.name.split("-")[1].split(".")[0])
        led = {r["id"]: r for r in _rows(path)}
        if len([r for r in rows if r["id"] in led]) < len(rows):
            out[f"lead-{m}"] = {"incomplete": f"{len(led)} of {len(rows)} tasks"}
            continue
        passes = [bool(led[r["id"]]["pass"]) for r in rows]
        billed = [_billed(r, led[r["id"]]["head_tokens"]) for r in rows]
        out[f"lead-{m}"] = {"held_out": _summary(rows, [True] * len(rows), passes, billed),
                            "per_family": {f: _summary([r for r in rows if r["suite"] == f],
                                                       [True] * sum(r["suite"] == f for r in rows),
                                                       [p for p, r in zip(passes, rows) if r["suite"] == f],
                                                       [b for b, r in zip(billed, rows) if r["suite"] == f])
                                           for f in families}}
        signals = {r["id"]: r for r in _rows(corpus / f"lead-{m}.signal.jsonl")}
        if len(signals) < len(rows):
            continue
        features = {
            "agree": lambda r: -sum(signals[r["id"]]["agree"]) / max(1, len(signals[r["id"]]["agree"])),
            "mean_logprob": lambda r: -statistics.fmean(signals[r["id"]]["logprobs"] or [0.0]),
        }
        for name, surprise in features.items():
            for target in LEAD_TARGETS:
                whole: dict[str, bool] = {}
                for fam in families:
                    train = [r for r in rows if r["suite"] != fam]
                    q_cloud, chosen = sum(r["cloud_pass"] for r in train), -1e9
                    for t in sorted({surprise(r) for r in train}, reverse=True) + [-1e9]:
                        q = sum((r["cloud_pass"] if surprise(r) >= t else led[r["id"]]["pass"]) for r in train)
                        if q >= target * q_cloud:  # the fewest whole cloud answers that keep the target
                            chosen = t
                            break
                    for r in rows:
                        if r["suite"] == fam:
                            whole[r["id"]] = surprise(r) >= chosen
                p = [bool(r["cloud_pass"] if whole[r["id"]] else led[r["id"]]["pass"]) for r in rows]
                b = [1.0 if whole[r["id"]] else _billed(r, led[r["id"]]["head_tokens"]) for r in rows]
                out[f"lead-{m}:{name}@{target}"] = {
                    "held_out": _summary(rows, [True] * len(rows), p, b),
                    "whole_by_check": round(sum(whole.values()) / len(rows), 4)}
        # the shipped setting and the quality-side alternative (collab.lead_agree 0.85: the edge takes
        # over where it agrees with 14 or more of the 16; 0.9: 15 or more), in-suite: one threshold
        agree = features["agree"]
        for shipped in (0.85, 0.9):
            whole = {r["id"]: -agree(r) < shipped for r in rows}
            p = [bool(r["cloud_pass"] if whole[r["id"]] else led[r["id"]]["pass"]) for r in rows]
            b = [1.0 if whole[r["id"]] else _billed(r, led[r["id"]]["head_tokens"]) for r in rows]
            out[f"lead-{m}:agree>={shipped} (in-suite)"] = {
                "held_out": _summary(rows, [True] * len(rows), p, b),
                "whole_by_check": round(sum(whole.values()) / len(rows), 4)}
    if corpus == CORPUS:
        out.update(_rolling_lead(rows, families))
        out.update(_second_signal_lead(rows, families))
    return out


def lead_report(args: argparse.Namespace) -> None:
    """Lead mode replayed with another edge's tails and agreement (``head`` and ``lead-signal`` run
    with ``--edge``), beside the corpus edge's: ``results/chat_only_lead.<edge>.json``."""
    rows = _joined()
    families = sorted({r["suite"] for r in rows})
    lead, corpus_edge = _lead_policies(rows, families, _corpus(args.edge)), _lead_policies(rows, families)
    out = {"edge": args.edge, "tasks": len(rows), "lead": lead,
           "corpus_edge": {"edge": EDGE_MODEL, "lead": {k: v for k, v in corpus_edge.items() if k in lead}}}
    (RESULTS / f"chat_only_lead.{Path(args.edge).name.removesuffix('.gguf')}.json").write_text(
        json.dumps(out, indent=1) + "\n", encoding="utf-8")
    for name, row in out["lead"].items():
        print(f"{name:40s} {row.get('held_out', row)}")


def _chosen_held_out(rows: list[dict[str, Any]], families: list[str], grid: list[Any],
                     outcome: Callable[[dict[str, Any], Any], tuple[Any, ...]], target: float) -> dict[str, Any]:
    """For each family, the setting of ``grid`` chosen on the other seven: the lowest mean bill there
    (``outcome(row, setting)`` gives (passed, billed, ...)) that keeps ``target`` of all-cloud
    quality; the first such setting on a tie, None where none keeps it."""
    train = {fam: [i for i, r in enumerate(rows) if r["suite"] != fam] for fam in families}
    q_cloud = {fam: sum(rows[i]["cloud_pass"] for i in train[fam]) for fam in families}
    best: dict[str, tuple[float, Any]] = {fam: (math.inf, None) for fam in families}
    for g in grid:
        every = [outcome(r, g) for r in rows]  # once per setting, then read by each family's train set
        for fam in families:
            res = [every[i] for i in train[fam]]
            bill = statistics.fmean(o[1] for o in res)
            if sum(o[0] for o in res) >= target * q_cloud[fam] and bill < best[fam][0]:
                best[fam] = (bill, g)
    return {fam: best[fam][1] for fam in families}


def _second_signal_lead(rows: list[dict[str, Any]], families: list[str]) -> dict[str, Any]:
    """Lead mode where a second signal also has a say, after the cloud's first 16 tokens: the cloud's
    own confidence in its opening (``cloud_*``: what a hosted API's ``logprobs`` tell while it
    streams; ``cloud-signal`` phase) or the edge's in its own first 16 tokens (``probe_*``: the
    probe's features, ``probe`` phase). The edge takes over where the signal is high enough alone
    (``SIGNAL>=``), where the edge's agreement holds and the signal is high or low enough
    (``agree&SIGNAL>=``, ``agree&SIGNAL<=``), or where either holds (``agree|SIGNAL>=``); thresholds
    chosen leave-one-family-out, the lowest mean bill on the other seven families that keeps
    ``TARGET`` of all-cloud quality. Many candidates on one corpus: a lone one that lands on the
    bar held out is luck until it holds on tasks it was not picked on, so ``lead-16:nested@TARGET``
    also chooses the rule itself (agreement alone among them) with its thresholds on the other
    seven families: the held-out figure of choosing a rule on data."""
    from edgecloud.router.probe import FEATURES

    heads = {r["id"]: r for r in _rows(CORPUS / "head-16.edge.jsonl")}
    edge = {r["id"]: r["agree"] for r in _rows(CORPUS / "lead-16.signal.jsonl")}
    cloud = {r["id"]: r for r in _rows(CORPUS / "cloud-16.signal.jsonl")}
    if any(len(d) < len(rows) for d in (heads, edge, cloud)):
        return {"lead-second-signal": {"incomplete": "needs head-16, lead-16.signal, cloud-16.signal"}}
    signals: dict[str, Any] = {
        "cloud_mean_logprob": lambda r: statistics.fmean(cloud[r["id"]]["logprobs"] or [0.0]),
        "cloud_min_margin": lambda r: min(cloud[r["id"]]["margins"] or [99.0])}
    for j, name in enumerate(FEATURES):
        signals[f"probe_{name}"] = (lambda j: (lambda r: _features(r, 16, False)[j]))(j)
    value = {name: {r["id"]: signal(r) for r in rows} for name, signal in signals.items()}
    agree = {r["id"]: sum(edge[r["id"]]) / max(1, len(edge[r["id"]])) for r in rows}

    def outcome(r: dict[str, Any], take: bool) -> tuple[bool, float]:
        h = heads[r["id"]]
        if take and not h["cloud_whole"]:
            return bool(h["pass"]), _billed(r, 16)
        return bool(r["cloud_pass"]), 1.0

    agreements = [k / 16 for k in range(10, 17)]
    # every rule: its grid of (agreement, signal cut) settings and whether the edge takes over
    rules: dict[str, tuple[list[Any], Callable[[dict[str, Any], Any], bool]]] = {
        "lead-16:agree>=": ([(a, None) for a in agreements], lambda r, g: agree[r["id"]] >= g[0])}
    for name in signals:
        v = value[name]
        ordered = sorted(v.values())
        cuts = [ordered[i * (len(ordered) - 1) // 20] for i in range(21)]  # the signal's 5 % quantiles
        both = [(a, c) for a in agreements for c in cuts]
        rules.update({
            f"lead-16:{name}>=": ([(None, c) for c in cuts], lambda r, g, v=v: v[r["id"]] >= g[1]),
            f"lead-16:agree&{name}>=": (both, lambda r, g, v=v: agree[r["id"]] >= g[0] and v[r["id"]] >= g[1]),
            f"lead-16:agree&{name}<=": (both, lambda r, g, v=v: agree[r["id"]] >= g[0] and v[r["id"]] <= g[1]),
            f"lead-16:agree|{name}>=": (both, lambda r, g, v=v: agree[r["id"]] >= g[0] or v[r["id"]] >= g[1]),
        })
    out: dict[str, Any] = {}
    for target in ROLLING_TARGETS[:2]:
        for key, (grid, rule) in rules.items():
            if key == "lead-16:agree>=":
                continue  # the shipped rule: lead-16:agree@TARGET
            chosen = _chosen_held_out(rows, families, grid, lambda r, g: outcome(r, rule(r, g)), target)
            res = [outcome(r, chosen[r["suite"]] is not None and rule(r, chosen[r["suite"]])) for r in rows]
            out[f"{key}@{target}"] = {
                "held_out": _summary(rows, [True] * len(rows), [p for p, _ in res], [b for _, b in res])}
        flat = [(key, g) for key, (grid, _) in rules.items() for g in grid]
        picked = _chosen_held_out(rows, families, flat, lambda r, kg: outcome(r, rules[kg[0]][1](r, kg[1])), target)
        res = [outcome(r, picked[r["suite"]] is not None and rules[picked[r["suite"]][0]][1](r, picked[r["suite"]][1]))
               for r in rows]
        out[f"lead-16:nested@{target}"] = {
            "held_out": _summary(rows, [True] * len(rows), [p for p, _ in res], [b for _, b in res]),
            "rules_chosen": sorted({kg[0] for kg in picked.values() if kg is not None})}
    return out


ROLLING_TARGETS = (0.90, 0.91, 0.92)
WINDOW = 16


def _rolling_lead(rows: list[dict[str, Any]], families: list[str]) -> dict[str, Any]:
    """Lead mode with more than one chance to take over (measured, not shipped): the edge scores the
    cloud's opening every ``WINDOW`` tokens, up to the last checkpoint, and takes over at the first
    checkpoint where it agrees with at least the threshold of the last ``WINDOW`` tokens (``window``) or
    of everything so far (``all``); past the last one the cloud writes the answer. Needs ``head-M`` for
    every checkpoint M and ``lead-48.signal``; one threshold, chosen leave-one-family-out as the lowest
    mean bill on the other seven families that keeps ``TARGET`` of all-cloud quality. Held out, a later
    take-over loses quality the bill does not buy back: agreeing with a stretch mid-answer says less
    about finishing it than agreeing with the opening (README, lead mode)."""
    heads = {m: {r["id"]: r for r in _rows(CORPUS / f"head-{m}.edge.jsonl")} for m in (16, 32, 48)}
    signal = {r["id"]: r["agree"] for r in _rows(CORPUS / "lead-48.signal.jsonl")}
    if any(len(h) < len(rows) for h in heads.values()) or len(signal) < len(rows):
        return {"lead-rolling": {"incomplete": "needs head-16/32/48 and lead-48.signal (chat_only.py head, lead-signal)"}}

    def outcome(r: dict[str, Any], checkpoints: tuple[int, ...], window: str, t: float) -> tuple[bool, float, int]:
        """(passed, billed, where the edge took over: 0 for never) of one answer under one rule."""
        agree = signal[r["id"]]
        for c in checkpoints:
            h = heads[c][r["id"]]
            if h["cloud_whole"]:  # the cloud finished within this checkpoint: its answer
                break
            seen = agree[c - WINDOW:c] if window == "window" else agree[:c]
            if sum(seen) / len(seen) >= t:
                return bool(h["pass"]), _billed(r, c), c
        return bool(r["cloud_pass"]), 1.0, 0

    thresholds = [k / WINDOW for k in range(WINDOW + 1)]
    out: dict[str, Any] = {}
    for checkpoints in ((16,), (16, 32), (16, 32, 48)):
        for window in ("window", "all") if len(checkpoints) > 1 else ("window",):
            key = f"lead-rolling-{'/'.join(map(str, checkpoints))}:{window}"
            for target in ROLLING_TARGETS:
                chosen = {f: 1.01 if t is None else t  # 1.01: the edge never takes over
                          for f, t in _chosen_held_out(rows, families, thresholds,
                                                       lambda r, t: outcome(r, checkpoints, window, t), target).items()}
                res = [outcome(r, checkpoints, window, chosen[r["suite"]]) for r in rows]
                took = [c for _, _, c in res]
                out[f"{key}@{target}"] = {
                    "held_out": _summary(rows, [True] * len(rows), [p for p, _, _ in res], [b for _, b, _ in res]),
                    "thresholds_chosen": sorted(set(chosen.values())),
                    "took_over_at": {str(c): round(took.count(c) / len(rows), 4) for c in (0, *checkpoints)},
                    "per_family_held_out": {
                        f: _summary([r for r in rows if r["suite"] == f], [True] * sum(r["suite"] == f for r in rows),
                                    [p for (p, _, _), r in zip(res, rows) if r["suite"] == f],
                                    [b for (_, b, _), r in zip(res, rows) if r["suite"] == f])
                        for f in families}}
            for t in (0.8125, 0.875, 0.9375):  # fixed settings, in-suite: 13, 14 and 15 of every 16
                res = [outcome(r, checkpoints, window, t) for r in rows]
                out[f"{key}>={t} (in-suite)"] = {
                    "held_out": _summary(rows, [True] * len(rows), [p for p, _, _ in res], [b for _, b, _ in res])}
    return out


def _probe_seconds(row: dict[str, Any], n: int) -> float:
    """Seconds until the edge had written ``n`` tokens (time to first token, then its own pace)."""
    p = row["probe"]
    per_token = (p["seconds"] - p["ttft"]) / max(1, len(p["tokens"]) - 1)
    return p["ttft"] + per_token * (min(n, len(p["tokens"])) - 1)


# ---------------------------------------------------------------------------- live, through the stand-in

LIVE_POLICIES = ("all-cloud", "all-edge", "default", "probe")
LIVE_COLLAB: dict[str, Any] = {"probe": "probe"}  # each policy's collab setting on top of the defaults


def live(args: argparse.Namespace) -> None:
    from edgecloud import EdgeCloud
    from edgecloud.edge.llamacpp import LlamaCppBackend
    from edgecloud.router.training.corpus import load_corpus
    from edgecloud.router.training.tasks import grade
    from edgecloud.store import resolve_model
    from edgecloud.testing import HostedChatProxy, LatencyProxy

    tasks = {t.id: t for t in load_corpus(full=True)}
    outcomes = _rows(OUTCOMES)
    sample = _sample(outcomes, args.per_family, args.skip)
    policies = tuple(args.policies.split(","))
    split = args.split
    server, port = _start_server(str(resolve_model(CLOUD_MODEL)), split)
    try:
        with HostedChatProxy(f"http://127.0.0.1:{port}") as hosted, \
                LatencyProxy(("127.0.0.1", hosted.port), rtt_s=args.rtt) as net, \
                LlamaCppBackend(EDGE_MODEL, n_threads=1 if split else None) as edge:
            url = f"{net.url}/v1"
            config = {"fallback": {"timeout_s": 300}}
            own = [p for p in policies if p not in ("all-cloud", "all-edge")] or ["default"]
            clients = {p: EdgeCloud(edge_backend=edge, cloud_base_url=url, cloud_model=CLOUD_MODEL, config=config,
                                    **({"collab": LIVE_COLLAB[p]} if p in LIVE_COLLAB else {}))
                       for p in own}
            clients["all-cloud"] = clients["all-edge"] = clients[own[0]]
            pins = {"all-cloud": {"route": "cloud", "collab": "off"}, "all-edge": {"route": "edge", "collab": "off"}}
            warm = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
            for name in own:
                _answer(clients[name], warm)  # capabilities learned, models warm
            results = _interleave(sample, policies, port,
                                  lambda name, row, tag: _answer(clients[name], row, tag=tag, **pins.get(name, {})),
                                  lambda row, text: grade(tasks[row["id"]], text))
            for c in {id(c): c for c in clients.values()}.values():
                c.close()
    finally:
        server.terminate()
        server.wait(30)
    for rows in results.values():
        rows.sort(key=lambda r: r["id"])
    summary = {}
    cloud = results["all-cloud"]
    for name, rows in results.items():
        ok = [r for r in rows if "raised" not in r]
        ratio = [r["seconds"] / c["seconds"] for r, c in zip(rows, cloud) if "raised" not in r and "raised" not in c]
        summary[name] = {
            "answers": len(rows), "raised": len(rows) - len(ok),
            "quality": round(sum(r["pass"] for r in ok) / max(1, len(ok)), 4),
            "ttft_p50": round(statistics.median(r["ttft"] for r in ok if r["ttft"] is not None), 3),
            "ttft_p90": round(sorted(r["ttft"] for r in ok if r["ttft"] is not None)[int(0.9 * (len(ok) - 1))], 3),
            "seconds_p50": round(statistics.median(r["seconds"] for r in ok), 3),
            "e2e_vs_all_cloud_p50": round(statistics.median(ratio), 3) if ratio else None,
            "billed_vs_all_cloud_p50": round(statistics.median(r["billed"] or 0.0 for r in ok), 4),
            "server_passes_vs_all_cloud_p50": round(statistics.median(
                r["server_passes"] / c["server_passes"] for r, c in zip(rows, cloud)
                if "raised" not in r and "raised" not in c and c["server_passes"]), 4),
            "server_passes_vs_all_cloud_pooled": round(
                sum(r.get("server_passes", 0) for r in ok) / max(1.0, sum(c.get("server_passes", 0) for c in cloud)), 4),
            "modes": sorted({str(r["collab"]) for r in ok}),
        }
    for name in summary:
        summary[name]["ttft_vs_all_cloud_p50"] = round(summary[name]["ttft_p50"] / summary["all-cloud"]["ttft_p50"], 3)
        summary[name]["quality_vs_all_cloud"] = round(summary[name]["quality"] / max(1e-9, summary["all-cloud"]["quality"]), 3)
    out = {"rtt_s": args.rtt, "split_cores": split, "tasks": len(sample), "per_family": args.per_family,
           "skip": args.skip,
           "method": "policies interleaved per task in a rotating order; each request's user message starts with "
                     "its own tag, so no request reuses another's prompt KV; graded as in the corpus",
           "edge": EDGE_MODEL, "cloud": CLOUD_MODEL, "summary": summary, "answers": results}
    name = args.out or f"chat_only_live{'_split' if split else ''}.json"
    (RESULTS / name).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="phase", required=True)
    sub.add_parser("probe")
    hd = sub.add_parser("head")
    hd.add_argument("--m", type=int, default=16, help="tokens the cloud writes first")
    hd.add_argument("--parallel", type=int, default=8)
    ls = sub.add_parser("lead-signal")
    ls.add_argument("--m", type=int, default=16)
    lr = sub.add_parser("lead-report")
    for phase in (hd, ls, lr):
        phase.add_argument("--edge", default=EDGE_MODEL,
                           help="the edge writing tails (catalogue name or .gguf); another than the corpus's "
                                "keeps its files in corpus/<edge>/")
    for phase in (hd, ls):
        phase.add_argument("--tasks", help="a folder with its own outcomes.jsonl (tasks outside the corpus), "
                                           "where this phase writes too")
    cs = sub.add_parser("cloud-signal")
    cs.add_argument("--m", type=int, default=16)
    rep = sub.add_parser("report")
    rep.add_argument("--tokens", type=int, default=16, help="probe length of the packaged check")
    rep.add_argument("--write-check", action="store_true", help="write src/edgecloud/router/data/probe.json")
    lv = sub.add_parser("live")
    lv.add_argument("--per-family", type=int, default=3)
    lv.add_argument("--rtt", type=float, default=0.05, help="round trip to the cloud, seconds (LatencyProxy)")
    lv.add_argument("--split", action="store_true", help="this process and its edge on core 0, the server on core 1")
    lv.add_argument("--skip", type=int, default=0, help="leave out each family's first SKIP tasks")
    lv.add_argument("--policies", default=",".join(LIVE_POLICIES), help=f"of {', '.join(LIVE_POLICIES)}")
    lv.add_argument("--out", help="results file name (default chat_only_live[_split].json)")
    args = parser.parse_args()
    {"probe": probe, "head": head, "lead-signal": lead_signal, "cloud-signal": cloud_signal, "report": report,
     "live": live, "lead-report": lead_report}[args.phase](args)


if __name__ == "__main__":
    main()
