"""``edgecloud chat``: an interactive streaming REPL, or one answer with ``--prompt``.

One-shot mode prints only the answer on stdout (stats go to stderr) so it composes in
pipelines. The REPL keeps the conversation (the edge runtime reuses its KV prefix turn after
turn), streams with rich, and Ctrl-C stops the current answer, not the program.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console

from ..client import DEFAULT_EDGE_MODEL, EdgeCloud
from ..errors import EdgeCloudError
from ..store import resolve_model
from ..types import ChatCompletionChunk, ChatMessage, RouteInfo, Usage

DEFAULT_MODEL = DEFAULT_EDGE_MODEL

_HELP = "/reset clears the conversation · /stats shows the last answer's speed · /exit quits · Ctrl-C stops an answer"


@dataclass
class TurnStats:
    """Timing of one answer, as the user felt it."""

    ttft_s: float | None = None
    total_s: float = 0.0
    usage: Usage | None = None
    chars: int = 0
    finish_reason: str | None = None
    route: RouteInfo | None = None

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
        where = f"{self.route.target}/{self.route.backend}" if self.route else "-"
        if u is None:  # stopped before the final chunk: no token counts
            return f"{where} · TTFT {ttft} · {self.chars} characters before it stopped · finish {self.finish_reason}"
        return (
            f"{where} · TTFT {ttft} · {speed} · {u.completion_tokens} tokens out · "
            f"{u.prompt_tokens} prompt ({u.cached_tokens} cached) · finish {self.finish_reason}"
        )


def stream_answer(
    client: EdgeCloud, messages: list[ChatMessage], params: dict[str, Any], write: Callable[[str], object]
) -> tuple[str, TurnStats]:
    """Stream one answer through ``write``; Ctrl-C stops it and keeps the text so far."""
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
    chunk: ChatCompletionChunk, stats: TurnStats, parts: list[str], write: Callable[[str], object], start: float
) -> None:
    text = chunk.text
    if text:
        if stats.ttft_s is None:
            stats.ttft_s = time.perf_counter() - start
        parts.append(text)
        stats.chars += len(text)
        write(text)
    if chunk.usage is not None:
        stats.usage = chunk.usage
    if chunk.route is not None:
        stats.route = chunk.route
    for choice in chunk.choices:
        if choice.finish_reason is not None:
            stats.finish_reason = choice.finish_reason


def chat_command(
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="Answer this one prompt and exit."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Catalogue name or path to a .gguf file."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Most tokens to generate per answer."),
    temperature: float = typer.Option(0.7, "--temperature", "-t", help="0 = greedy."),
    system: str | None = typer.Option(None, "--system", help="System prompt (default: the model's own)."),
    device: str = typer.Option("this", "--device", help="Device profile the memory plan is made for."),
    ctx: int | None = typer.Option(None, "--ctx", help="Context size (default: the planner's choice)."),
    seed: int | None = typer.Option(None, "--seed", help="Sampling seed for reproducible answers."),
) -> None:
    """Chat with a model on this machine."""
    err = Console(stderr=True)
    client = EdgeCloud(edge_model=model, n_ctx=ctx, device=device)
    try:
        # Load (and pull on first use, with a progress bar) before the first prompt.
        # Pull (with its progress bar) and verify before the spinner: rich shows one live
        # display at a time.
        resolve_model(model, pull=True)
        if prompt is None:
            with err.status(f"loading {model}…", spinner="dots"):
                client.edge.load()
        else:
            client.edge.load()
    except EdgeCloudError as exc:
        err.print(f"[red]edgecloud: error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from None
    history: list[ChatMessage] = [ChatMessage(role="system", content=system)] if system else []
    with client:
        if prompt is not None:
            _one_shot(client, history, prompt, max_tokens, temperature, seed, err)
        else:
            _repl(client, history, model, max_tokens, temperature, seed, err)


def _params(max_tokens: int | None, temperature: float, seed: int | None) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}


def _one_shot(
    client: EdgeCloud,
    history: list[ChatMessage],
    prompt: str,
    max_tokens: int | None,
    temperature: float,
    seed: int | None,
    err: Console,
) -> None:
    try:
        messages = [*history, ChatMessage(role="user", content=prompt)]
        write = lambda t: (sys.stdout.write(t), sys.stdout.flush())  # noqa: E731
        _, stats = stream_answer(client, messages, _params(max_tokens, temperature, seed), write)
    except EdgeCloudError as exc:
        err.print(f"[red]edgecloud: error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from None
    sys.stdout.write("\n")
    sys.stdout.flush()
    err.print(f"[dim]{stats.line()}[/dim]", soft_wrap=True)


def _repl(
    client: EdgeCloud,
    history: list[ChatMessage],
    model: str,
    max_tokens: int | None,
    temperature: float,
    seed: int | None,
    err: Console,
) -> None:
    out = Console(highlight=False)
    out.print(f"[bold]edgecloud chat[/bold] · {model} · on this device\n[dim]{_HELP}[/dim]")
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
            out.print("[dim]conversation cleared[/dim]")
            continue
        if text == "/stats":
            out.print(f"[dim]{last.line() if last else 'no answer yet'}[/dim]", soft_wrap=True)
            continue
        if text in ("/help", "/?"):
            out.print(f"[dim]{_HELP}[/dim]")
            continue
        history.append(ChatMessage(role="user", content=text))
        out.print("[bold cyan]ai›[/bold cyan] ", end="")
        try:
            answer, last = stream_answer(
                client, history, _params(max_tokens, temperature, seed), lambda t: out.print(t, end="", markup=False)
            )
        except EdgeCloudError as exc:
            history.pop()
            out.print(f"\n[red]error:[/red] {exc}")
            continue
        out.print()
        if last.finish_reason == "cancelled":
            out.print("[dim](stopped)[/dim]")
        history.append(ChatMessage(role="assistant", content=answer))
