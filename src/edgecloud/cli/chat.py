"""``edgecloud chat``: an interactive streaming REPL, or one answer with ``--prompt``.

One-shot mode prints only the answer on stdout (where it ran, why, speed and cost go to
stderr) so it composes in pipelines. The REPL keeps the conversation (the edge runtime
reuses its KV prefix turn after turn), streams with rich, tags each answer with its route in
a dim footer, and Ctrl-C stops the current answer, not the program. With ``--cloud-url`` the
edge starts every answer and the cloud writes the parts the edge is unsure of (token mode;
``--collab`` picks another way, ``--route`` pins a side): in the REPL the cloud's text is shown
in magenta, the footer says how many tokens each side wrote, and ``/stats`` the totals with the
share of answer tokens the cloud wrote.
``--backend`` picks the edge runtime: llama.cpp (default), torch (the engine on cuda/mps/cpu) or
onnx (an ``edgecloud export onnx`` folder, given as ``--model DIR``, run by onnxruntime-genai).
``--tools FILE.json`` offers the model tools that run on this machine
(:mod:`edgecloud.cli.chat_tools`): each call runs, its result goes back to the model, and the
calls are shown on stderr as they happen. ``--session NAME`` resumes a conversation after the CLI
was closed (:mod:`edgecloud.cli.chat_session`): its history is read back and its KV loaded from
the edge's disk tier, so the next turn does not recompute what was said.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from ..client import DEFAULT_EDGE_MODEL, EdgeCloud
from ..config import EDGE_RUNTIMES
from ..errors import EdgeCloudError
from ..store import resolve_model
from ..tools.spec import ToolCall
from ..types import ChatCompletionChunk, ChatMessage, RouteInfo, Usage
from .chat_session import check_name, load_history, save_history
from .chat_tools import MAX_ROUNDS, LocalTool, load_tools, run_call, shown_arguments

DEFAULT_MODEL = DEFAULT_EDGE_MODEL


#: Runtimes whose ``--model`` is an export folder (``edgecloud export onnx --out DIR``), not a GGUF model to pull.
_FOLDER_MODELS = frozenset({"onnx"})

#: How text the cloud wrote is shown in the chat (the edge's is plain).
CLOUD_STYLE = "magenta"
_HELP = ("/reset clears the conversation · /stats shows speed, routes and cost · /exit quits · "
         "Ctrl-C stops an answer")


@dataclass
class TurnStats:
    """Timing of one answer, as the user felt it."""

    ttft_s: float | None = None
    total_s: float = 0.0
    usage: Usage | None = None
    chars: int = 0
    finish_reason: str | None = None
    route: RouteInfo | None = None
    cost_usd: float | None = None
    #: The answer's cost against the same answer all-cloud.
    cost_vs_cloud: float | None = None
    #: The tool calls the answer made.
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.ttft_s is None or self.usage is None or self.usage.completion_tokens < 2:
            return None
        decode_time = self.total_s - self.ttft_s
        return (self.usage.completion_tokens - 1) / decode_time if decode_time > 0 else None

    def line(self) -> str:
        ttft = f"{self.ttft_s * 1000:.0f} ms" if self.ttft_s is not None else "-"
        tps = self.decode_tokens_per_s
        speed = f"{tps:.1f} tok/s" if tps is not None else "-"
        u = self.usage
        where = "-"
        if self.route is not None:
            where = f"{self.route.target}/{self.route.backend} ({self.route.reason})"
            for f in self.route.fallbacks:
                where += f" · fell back {f['from']}→{f['to']} ({f['cause']}, after {f['at_chars']} chars)"
            tokens = self.route.tokens
            if self.route.collab not in (None, "off", "cascade") and tokens:
                written = sum(tokens.values())
                share = 100.0 * tokens.get("cloud", 0) / written if written else 0.0
                where += (f" · {tokens.get('cloud', 0)} of {written} tokens by the cloud ({share:.0f}%, "
                          f"{self.route.cloud_calls} cloud calls)")
        if u is None:  # stopped before the final chunk: no token counts
            return f"{where} · TTFT {ttft} · {self.chars} characters before it stopped · finish {self.finish_reason}"
        cost = f" · ${self.cost_usd:.6f}" if self.cost_usd else ""
        if self.cost_usd and self.cost_vs_cloud is not None:
            cost += f" ({self.cost_vs_cloud:.2f}x all-cloud)"
        return (
            f"{where} · TTFT {ttft} · {speed} · {u.completion_tokens} tokens out · "
            f"{u.prompt_tokens} prompt ({u.cached_tokens} cached) · finish {self.finish_reason}{cost}"
        )


def stream_answer(
    client: EdgeCloud, messages: list[ChatMessage], params: dict[str, Any], write: Callable[[str, str], object]
) -> tuple[str, TurnStats]:
    """Stream one answer through ``write(text, side)`` (``side``: who wrote it, edge or cloud);
    Ctrl-C stops it and keeps the text so far."""
    stats = TurnStats()
    parts: list[str] = []
    start = time.perf_counter()
    chunks = client.chat.completions.create(messages=messages, stream=True, **params)
    try:
        for chunk in chunks:
            _take(chunk, stats, parts, write, start)
    except KeyboardInterrupt:
        stats.finish_reason = "cancelled"
    finally:
        chunks.close()
        stats.total_s = time.perf_counter() - start
    return "".join(parts), stats


def _take(
    chunk: ChatCompletionChunk, stats: TurnStats, parts: list[str], write: Callable[[str, str], object], start: float
) -> None:
    text = chunk.text
    if text:
        if stats.ttft_s is None:
            stats.ttft_s = time.perf_counter() - start
        parts.append(text)
        stats.chars += len(text)
        write(text, chunk.route.target if chunk.route is not None else "edge")
    if chunk.usage is not None:
        stats.usage = chunk.usage
    if chunk.route is not None:
        stats.route = chunk.route
    if chunk.cost is not None:
        stats.cost_usd, stats.cost_vs_cloud = chunk.cost.usd, chunk.cost.vs_all_cloud
    for choice in chunk.choices:
        if choice.finish_reason is not None:
            stats.finish_reason = choice.finish_reason
        for call in choice.delta.tool_calls or []:  # edgecloud streams each call whole
            if call.id and call.function is not None and call.function.name:
                stats.calls.append(call.call())


def answer_turn(
    client: EdgeCloud, messages: list[ChatMessage], params: dict[str, Any], write: Callable[[str, str], object],
    tools: dict[str, LocalTool], note: Callable[[str], object],
) -> tuple[str, TurnStats]:
    """One answer; with ``tools``, every call the model makes runs (``note`` tells the user) and
    the model answers again with the results, up to :data:`MAX_ROUNDS` times. ``messages``
    gains the calls and results."""
    text, stats = stream_answer(client, messages, params, write)
    rounds = 1
    while tools and stats.calls and stats.finish_reason == "tool_calls":
        messages.append(ChatMessage(role="assistant", content=text, tool_calls=stats.calls))
        for call in stats.calls:
            result = run_call(tools, call)
            note(f"→ {call.function.name}({shown_arguments(call)}) = {result}")
            messages.append(ChatMessage(role="tool", tool_call_id=call.id, content=result))
        rounds += 1
        # the last round must answer in words: no more calls
        last = {"tool_choice": "none"} if rounds >= MAX_ROUNDS else {}
        text, stats = stream_answer(client, messages, {**params, **last}, write)
    return text, stats


def chat_command(
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="Answer this one prompt and exit."),
    model: str = typer.Option(
        DEFAULT_MODEL, "--model", "-m", help="Catalogue name or path to a .gguf file (--backend onnx: an export folder)."
    ),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Most tokens to generate per answer."),
    temperature: float = typer.Option(0.7, "--temperature", "-t", help="0 = greedy."),
    system: str | None = typer.Option(None, "--system", help="System prompt (default: the model's own)."),
    device: str = typer.Option("this", "--device", help="Device profile the memory plan is made for."),
    ctx: int | None = typer.Option(None, "--ctx", help="Context size (default: the planner's choice)."),
    seed: int | None = typer.Option(None, "--seed", help="Sampling seed for reproducible answers."),
    route: str = typer.Option("auto", "--route", help="auto (the router decides), edge or cloud."),
    collab: str | None = typer.Option(
        None, "--collab", help="How edge and cloud share an answer: auto, off, checked, token, verified, cascade, "
                               "lead or probe (default: the settings' collab.mode, auto).",
    ),
    backend: str = typer.Option("llamacpp", "--backend", help=f"Edge runtime: {', '.join(EDGE_RUNTIMES)}."),
    cloud_url: list[str] = typer.Option(
        [], "--cloud-url", help="OpenAI-compatible endpoint (repeat for fallbacks; or EDGECLOUD_CLOUD_BASE_URL)."
    ),
    cloud_model: str | None = typer.Option(None, "--cloud-model", help="Model the endpoint serves."),
    cloud_key: str | None = typer.Option(
        None, "--cloud-key", envvar="EDGECLOUD_CLOUD_API_KEY", help="API key for the endpoint.", show_default=False
    ),
    tools_file: Path | None = typer.Option(
        None, "--tools", help="JSON list of tools the model may call, each with the 'run' command that computes it "
                              "(see examples/tools/tools.json).",
    ),
    session: str | None = typer.Option(
        None, "--session", help="Keep this conversation under NAME: the next `edgecloud chat --session NAME` resumes "
                                "it (history and KV), also after the CLI was closed.",
    ),
    speculate: str | None = typer.Option(
        None, "--speculate", help="Speculative decoding on the device: auto (prompt lookup; the default), ngram, off, "
                                  "or a smaller draft model of the same family (catalogue name or .gguf path).",
    ),
) -> None:
    """Chat: on this machine, or routed per question between it and a cloud endpoint."""
    err = Console(stderr=True)
    if route not in ("auto", "edge", "cloud"):
        raise typer.BadParameter(f"{route!r} is not a route; use auto, edge or cloud", param_hint="--route")
    if backend not in EDGE_RUNTIMES:
        raise typer.BadParameter(f"{backend!r} is not an edge backend; use {', '.join(EDGE_RUNTIMES)}",
                                 param_hint="--backend")
    try:
        tools = load_tools(tools_file) if tools_file is not None else {}
        saved = load_history(check_name(session)) if session is not None else []
        client = EdgeCloud(edge_model=model, n_ctx=ctx, device=device, cloud_base_url=cloud_url or None,
                           cloud_model=cloud_model, cloud_api_key=cloud_key, edge_runtime=backend, collab=collab,
                           session=session, edge_speculate=speculate)
        if backend in _FOLDER_MODELS:
            client.edge  # an ONNX folder that is not an export fails here, with the other set-up errors
    except EdgeCloudError as exc:
        err.print(f"[red]edgecloud: error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from None
    try:
        # Load (and pull on first use, with a progress bar) before the first prompt.
        # Pull (with its progress bar) and verify before the spinner: rich shows one live
        # display at a time.
        if backend not in _FOLDER_MODELS:
            resolve_model(model, pull=True)
        drafter = client.hybrid.draft_model() if client.hybrid.clouds else None
        if drafter is not None:  # what verified mode drafts with (made once, with its own progress)
            resolve_model(drafter, pull=True)
        assert client.edge is not None  # --model always names one
        if prompt is None:
            with err.status(f"loading {model}…", spinner="dots"):
                client.hybrid.load()
        else:
            client.hybrid.load()
    except EdgeCloudError as exc:
        err.print(f"[red]edgecloud: error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from None
    history: list[ChatMessage] = [ChatMessage(role="system", content=system)] if system else []
    if saved:
        history = saved
        turns = sum(m.role == "user" for m in saved)
        err.print(f"resumed session {session!r}: {turns} turns", style="dim", soft_wrap=True, markup=False)
    keep = (lambda messages: save_history(session, messages)) if session is not None else (lambda messages: None)
    params = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "route": route,
              "tools": [t.spec for t in tools.values()] or None}
    with client:  # the client built the edge runtime, so it closes it
        if prompt is not None:
            _one_shot(client, history, prompt, params, tools, err, keep)
        else:
            _repl(client, history, model, params, tools, err, keep)


def _totals(client: EdgeCloud) -> str:
    t = client.stats()
    return (f"{t['requests']} answers: {t['edge_requests']} on the edge, {t['cloud_requests']} on the cloud, "
            f"{t['fallbacks']} fallbacks · {t['cloud_answer_tokens']} of "
            f"{t['edge_answer_tokens'] + t['cloud_answer_tokens']} answer tokens by the cloud "
            f"({100 * t['cloud_token_share']:.0f}%) · cost ${t['cost_usd']:.6f} · saved ${t['saved_usd']:.6f} "
            f"vs all-cloud ({t['saved_pct']:.0f}%)")


def _one_shot(
    client: EdgeCloud, history: list[ChatMessage], prompt: str, params: dict[str, Any], tools: dict[str, LocalTool],
    err: Console, keep: Callable[[list[ChatMessage]], None],
) -> None:
    try:
        messages = [*history, ChatMessage(role="user", content=prompt)]
        write = lambda t, side: (sys.stdout.write(t), sys.stdout.flush())  # noqa: E731 - stdout: the answer only
        answer, stats = answer_turn(client, messages, params, write, tools,
                                    lambda line: err.print(line, style="dim", soft_wrap=True, markup=False))
    except EdgeCloudError as exc:
        err.print(f"[red]edgecloud: error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from None
    keep([*messages, ChatMessage(role="assistant", content=answer)])
    sys.stdout.write("\n")
    sys.stdout.flush()
    err.print(f"[dim]{stats.line()}[/dim]", soft_wrap=True)


def _repl(
    client: EdgeCloud, history: list[ChatMessage], model: str, params: dict[str, Any], tools: dict[str, LocalTool],
    err: Console, keep: Callable[[list[ChatMessage]], None],
) -> None:
    out = Console(highlight=False)
    where = "on this device" if not client.settings.cloud_base_url else f"routed: {model} ⇄ {client.settings.cloud_model}"
    out.print(f"[bold]edgecloud chat[/bold] · {model} · {where}\n[dim]{_HELP}[/dim]")
    last: TurnStats | None = None
    while True:
        try:
            line = out.input("[bold green]you›[/bold green] ")
        except EOFError:
            out.print()
            return
        except KeyboardInterrupt:
            out.print("\n[dim](use /exit or Ctrl-D to quit)[/dim]")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            history[:] = [m for m in history if m.role == "system"]
            keep(history)
            out.print("[dim]conversation cleared[/dim]")
            continue
        if text == "/stats":
            out.print(f"[dim]{last.line() if last else 'no answer yet'}\n{_totals(client)}[/dim]", soft_wrap=True)
            continue
        if text in ("/help", "/?"):
            out.print(f"[dim]{_HELP}[/dim]")
            continue
        turn = [*history, ChatMessage(role="user", content=text)]
        out.print("[bold cyan]ai›[/bold cyan] ", end="")
        try:
            answer, last = answer_turn(
                client, turn, params,
                lambda t, side: out.print(t, end="", markup=False, style=CLOUD_STYLE if side == "cloud" else None),
                tools, lambda line: out.print(f"\n{line}", style="dim", markup=False),
            )
        except EdgeCloudError as exc:
            out.print(f"\n[red]error:[/red] {exc}")
            continue
        history[:] = turn
        out.print()
        if last.finish_reason == "cancelled":
            out.print("[dim](stopped)[/dim]")
        out.print(f"[dim]{last.line()}[/dim]", soft_wrap=True)
        history.append(ChatMessage(role="assistant", content=answer))
        keep(history)
