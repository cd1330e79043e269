"""``edgecloud route``: label outcomes, train and evaluate the router's scorer, score requests."""

from __future__ import annotations

import random
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..errors import EdgeCloudError
from ..router.training.tasks import SUITES, Task

app = typer.Typer(help="Label, train, evaluate and apply the complexity router.", no_args_is_help=True)

DEFAULT_EDGE = "qwen2.5-coder-0.5b-instruct-q4"
DEFAULT_CLOUD = "qwen2.5-coder-1.5b-instruct-q4"


@app.command("label")
def label_command(
    out: Path = typer.Option(Path("outcomes.jsonl"), "--out", help="Outcome file to write (JSONL)."),
    suites: str = typer.Option(",".join(SUITES), "--suites", help=f"Comma-separated suites: {', '.join(SUITES)}."),
    corpus: str = typer.Option(
        "", "--corpus",
        help="Comma-separated families of the development corpus ('all' for every one) instead of --suites; "
             "every task at the corpus's max_tokens.",
    ),
    sides: str = typer.Option("edge,cloud", "--sides", help="Which sides to run now: edge, cloud or both."),
    edge_model: str = typer.Option(DEFAULT_EDGE, "--edge-model", help="The edge model (name or .gguf path)."),
    cloud_model: str = typer.Option(DEFAULT_CLOUD, "--cloud-model", help="The cloud model (name or .gguf path)."),
    threads: int = typer.Option(0, "--threads", min=0, help="llama.cpp threads (0: physical cores)."),
    limit: int = typer.Option(0, "--limit", min=0, help="Only the first N tasks (after the seeded shuffle)."),
    n_ctx: int = typer.Option(
        0, "--ctx", min=0, help="Context size per sequence (0: the longest task's prompt + max_tokens)."
    ),
    parallel: int = typer.Option(
        1, "--parallel", min=1, max=64,
        help="Sequences decoded together (batched llama.cpp; ~3x throughput at 8 on CPU). 1: one at a time.",
    ),
) -> None:
    """Run both models greedily on the task suites, grade every answer, write the outcome file.

    Each side's raw results go to OUT.<side>.jsonl as they come, so a stopped run resumes;
    the outcome file joins the tasks both sides have answered.
    """
    from ..edge.llamacpp import LlamaCppBackend
    from ..runtime.llamacpp_batch import BatchedGreedy
    from ..router.training.label import label_side, merge_outcomes
    from ..router.training.corpus import CORPUS_FAMILIES, load_corpus
    from ..router.training.tasks import load_tasks

    if corpus:
        families = CORPUS_FAMILIES if corpus == "all" else [s.strip() for s in corpus.split(",") if s.strip()]
        tasks = load_corpus(families)
    else:
        tasks = load_tasks([s.strip() for s in suites.split(",") if s.strip()])
    random.Random(0).shuffle(tasks)  # every prefix of the run covers every suite
    if limit:
        tasks = tasks[:limit]
    models = {"edge": edge_model, "cloud": cloud_model}
    for side in [s.strip() for s in sides.split(",") if s.strip()]:
        if side not in models:
            raise typer.BadParameter(f"unknown side {side!r}; use edge and/or cloud", param_hint="--sides")
        source: LlamaCppBackend | BatchedGreedy
        ctx = n_ctx or _fit_ctx(models[side], tasks, threads)
        if parallel > 1:
            source = BatchedGreedy(models[side], parallel=parallel, n_ctx=ctx * parallel, threads=threads)
        else:
            source = LlamaCppBackend(models[side], n_ctx=ctx, n_threads=threads or None, reuse_prefix=False)
        columns = (TextColumn(f"[bold]{side}[/] {models[side]}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[passed]} passed"), TimeElapsedColumn(), TimeRemainingColumn())
        with source, Progress(*columns, transient=False) as bar:
            job = bar.add_task(side, total=None, passed=0)
            passed = 0

            def step(done: int, total: int, row: dict) -> None:
                nonlocal passed
                passed += bool(row["pass"])
                bar.update(job, completed=done, total=total, passed=passed)

            rows = label_side(source, tasks, out, side, progress=step)
        typer.echo(f"{side}: {sum(r['pass'] for r in rows.values())}/{len(rows)} passed", err=True)
    count = merge_outcomes(tasks, out)
    typer.echo(f"{out}: {count} tasks answered by both sides", err=True)


def _fit_ctx(model: str, tasks: list[Task], threads: int) -> int:
    """The per-sequence context every task fits in: its templated prompt plus max_tokens, in 256-token steps."""
    from ..runtime.llamacpp_batch import BatchedGreedy

    with BatchedGreedy(model, parallel=1, n_ctx=256, threads=threads) as probe:
        need = max((len(probe.encode(t.messages)) + t.max_tokens for t in tasks), default=256)
    return -(-need // 256) * 256


def _scorer(kind: str, model: Path | None):  # type: ignore[no-untyped-def]
    from ..router.scorers import load_scorer

    try:
        return load_scorer(kind, model)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--scorer") from exc


@app.command("score")
def score_command(
    input_file: Path | None = typer.Option(None, "--input", help="JSONL requests (default: stdin)."),
    scorer: str = typer.Option("learned", "--scorer", help="learned or rules."),
    model: Path | None = typer.Option(None, "--model", help="A learned model JSON (default: the packaged one)."),
    edge_below: float | None = typer.Option(
        None, "--edge-below", help="Scores below this run on the edge (default: the scorer's own band)."
    ),
    cloud_above: float | None = typer.Option(
        None, "--cloud-above", help="Scores above this go to the cloud (default: the scorer's own band)."
    ),
) -> None:
    """Score JSONL requests ({"id", "messages"} or {"id", "prompt"}): one JSON line out per line in.

    A line that cannot be read yields {"id", "error"} and the run goes on.
    """
    import json
    import sys

    from ..router.policy import RoutePolicy

    chosen = _scorer(scorer, model)
    policy = RoutePolicy(scorer=chosen, edge_below=edge_below, cloud_above=cloud_above)
    stream = input_file.open(encoding="utf-8", errors="replace") if input_file else sys.stdin
    with stream:
        for n, line in enumerate(stream, 1):
            if not line.strip():
                continue
            ident: object = n
            try:
                item = json.loads(line)
                if not isinstance(item, dict):
                    raise ValueError("a request line must be a JSON object")
                ident = item.get("id", n)
                said = item.get("messages", item.get("prompt"))
                if not isinstance(said, (list, str)) or (isinstance(said, list) and not all(isinstance(m, dict)
                                                                                             for m in said)):
                    raise ValueError("give 'messages' (a list of message objects) or 'prompt' (a string)")
                decision = policy.decide(item)
                value = decision.score if decision.score is not None else chosen.score(item)
            except (ValueError, TypeError, EdgeCloudError) as exc:
                typer.echo(json.dumps({"id": ident, "error": f"line {n}: {exc}"}))
                continue
            target = "edge_then_cloud" if decision.cascade else decision.target
            typer.echo(json.dumps({"id": ident, "score": round(value, 4), "target": target, "reason": decision.reason}))


@app.command("eval")
def eval_command(
    data: Path = typer.Option(..., "--data", exists=True, dir_okay=False, help="Outcome file (JSONL)."),
    scorer: str = typer.Option("learned", "--scorer", help="learned or rules."),
    model: Path | None = typer.Option(None, "--model", help="A learned model JSON (default: the packaged one)."),
    split: str = typer.Option("test", "--split", help="test (held-out share), train, or all rows."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of the curves here."),
    json_output: bool = typer.Option(False, "--json", help="Print the JSON summary (default: a short table)."),
) -> None:
    """Replay outcomes: APGR, CPT(50%), CPT(80%) against a seeded random router and the oracle."""
    import json

    from ..router.training import evaluate as ev

    rows = ev.load_outcomes(data)
    if split != "all":
        train, test = ev.split_outcomes(rows)
        rows = test if split == "test" else train
    chosen = _scorer(scorer, model)
    scores = ev.score_rows(rows, chosen.score)
    out = ev.summary(rows, scores)
    out["scorer"] = chosen.name
    if plot is not None:
        curves = {chosen.name: ev.router_curve(rows, scores), "random": ev.router_curve(rows, ev.random_scores(rows)),
                  "oracle": ev.router_curve(rows, ev.oracle_scores(rows))}
        if chosen.name != "rules":
            from ..router.scorers import RulesScorer

            curves["rules"] = ev.router_curve(rows, ev.score_rows(rows, RulesScorer().score))
        ev.plot_curves(curves, plot)
        out["plot"] = str(plot)
    if json_output:
        typer.echo(json.dumps(out))
        return
    for key in ("scorer", "n", "apgr", "random_apgr", "oracle_apgr", "cpt50", "cpt80", "edge_quality", "cloud_quality"):
        typer.echo(f"{key:>14}  {out[key]}")


@app.command("train")
def train_command(
    data: Path = typer.Option(..., "--data", exists=True, dir_okay=False, help="Outcome file (JSONL)."),
    out: Path = typer.Option(..., "--out", help="Where to write the learned model (JSON)."),
    all_rows: bool = typer.Option(False, "--all", help="Train on every row (default: the train split only)."),
) -> None:
    """Fit the learned scorer on outcomes (the held-out split is left out unless --all)."""
    import json

    from ..router.training import evaluate as ev
    from ..router.training.fit import train_scorer

    rows = ev.load_outcomes(data)
    if not all_rows:
        rows, _ = ev.split_outcomes(rows)
    model = train_scorer(rows)
    out.write_text(json.dumps(model, indent=1) + "\n", encoding="utf-8")
    ngrams = f"{model['hash_dim']} hashed n-gram buckets" if model["hash_dim"] else "no n-grams"
    typer.echo(f"{out}: trained on {len(rows)} outcomes (C={model['C']}, {ngrams}, "
               f"cross-validated APGR {model['cv_apgr']})", err=True)


@app.command("cascade")
def cascade_command(
    data: Path = typer.Option(..., "--data", exists=True, dir_okay=False, help="Outcome file (JSONL)."),
    model: Path | None = typer.Option(None, "--model", help="Learned scorer for the bands (default: the packaged one)."),
    target: float = typer.Option(0.95, "--target", min=0.0, max=1.0, help="Share of cloud-only quality to reach."),
    max_cloud: float = typer.Option(
        0.5, "--max-cloud", min=0.0, max=1.0,
        help="Cloud budget: the share of requests that may reach the cloud (best quality within it if the target is not).",
    ),
    out: Path | None = typer.Option(None, "--out", help="Write the fitted check here (JSON)."),
    json_output: bool = typer.Option(False, "--json", help="Print the JSON summary."),
) -> None:
    """Fit the cascade's confidence check on the train split; report it on the held-out split.

    The escalation threshold is chosen on out-of-fold values of the train split: the fewest
    cloud calls reaching --target within the --max-cloud budget, else the best quality within it.

    Prints the held-out quality share and cloud fraction of the cascade alone (every request
    on the edge first) and behind the router's bands, and what each signal group adds.
    """
    import json

    from ..router.training import evaluate as ev
    from ..router.cascade import SIGNAL_NAMES
    from ..router.training.cascade_fit import GROUPS, ablation, evaluate_cascade, row_signals
    from ..router.scorers import LearnedScorer
    from ..router.training.fit import out_of_fold_scores

    rows = ev.load_outcomes(data)
    train, test = ev.split_outcomes(rows)
    scorer = _scorer("learned", model)
    typer.echo(f"checking {len(rows)} edge answers (code runs in the sandbox)…", err=True)
    # Train rows get out-of-fold scores (the packaged scorer was fitted on them, so its own scores
    # there are surer than on new requests); held-out rows get the scorer's.
    if isinstance(scorer, LearnedScorer):
        train_scores = out_of_fold_scores(train, c=scorer.model.get("C"))
    else:
        train_scores = ev.score_rows(train, scorer.score)
    test_scores = ev.score_rows(test, scorer.score)
    train_signals, test_signals = row_signals(train, train_scores), row_signals(test, test_scores)
    result = evaluate_cascade(train, test, train_signals, test_signals, train_scores, test_scores, target=target,
                              max_cloud=max_cloud, edge_below=scorer.bands[0], cloud_above=scorer.bands[1])
    check = result.pop("check")
    # the same check without the logprob signals, for edge runtimes that give none (torch, Core ML)
    no_logprobs = [n for n in SIGNAL_NAMES if n not in GROUPS["logprob"]]
    plain = evaluate_cascade(train, test, train_signals, test_signals, train_scores, test_scores, target=target,
                             max_cloud=max_cloud, edge_below=scorer.bands[0], cloud_above=scorer.bands[1],
                             use=no_logprobs)
    check.without_logprobs = plain.pop("check")
    result["without_logprobs"] = {name: plain[name] for name in ("cascade_all", "banded")}
    result["ablation"] = ablation(train, test, train_signals, test_signals, target=target, max_cloud=max_cloud)
    result.update(scorer=scorer.name, bands=list(scorer.bands), n_train=len(train), n_test=len(test), target=target,
                  max_cloud=max_cloud)
    if out is not None:
        out.write_text(json.dumps(check.to_json(), indent=1) + "\n", encoding="utf-8")
        result["check_file"] = str(out)
    if json_output:
        typer.echo(json.dumps(result))
        return
    for name in ("cascade_all", "banded"):
        t = result[name]["test"]
        typer.echo(f"{name:>12}  share of cloud quality {t['share_of_cloud_quality']:.3f}  "
                   f"cloud calls {t['cloud_fraction']:.3f}  (threshold {result[name]['threshold']})")
    for label, point in result["ablation"].items():
        if "error" in point:
            typer.echo(f"{label:>20}  {point['error']}")
        else:
            typer.echo(f"{label:>20}  share {point['share_of_cloud_quality']:.3f}  cloud {point['cloud_fraction']:.3f}")
