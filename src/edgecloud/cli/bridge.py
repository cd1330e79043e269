"""``edgecloud bridge``: serve the JSON-RPC bridge over stdio, or print its JSON Schema.

``edgecloud bridge --stdio`` is what a host app spawns (see :mod:`edgecloud.bridge`).
Stdout carries protocol lines only: before serving, file descriptor 1 is pointed at stderr,
so nothing else (Python ``print``, llama.cpp's C logging) can corrupt the stream.
``edgecloud bridge schema`` prints the JSON Schema of every message.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, BinaryIO

import typer

from ..bridge.protocol import schema
from ..bridge.server import DEFAULT_MAX_LINE_BYTES, Bridge
from ..bridge.stdio import serve_stdio
from ..client import EdgeCloud
from ..errors import EdgeCloudError

app = typer.Typer(help="JSON-RPC bridge for host apps (mobile, desktop): serve it over stdio, print its schema.",
                  add_completion=False)


def _protocol_stdout() -> BinaryIO:
    """A private handle on the real stdout; fd 1 and ``sys.stdout`` become stderr."""
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


@app.callback(invoke_without_command=True)
def bridge_command(
    ctx: typer.Context,
    stdio: bool = typer.Option(False, "--stdio", help="Serve requests on stdin, answers on stdout, until EOF."),
    model: str | None = typer.Option(None, "--model", "-m", help="Edge model: catalogue name or .gguf path "
                                     "(default: the client's, from EDGECLOUD_EDGE_MODEL / edgecloud.toml)."),
    cloud_url: list[str] = typer.Option(
        [], "--cloud-url", help="OpenAI-compatible endpoint (repeat for fallbacks; or EDGECLOUD_CLOUD_BASE_URL)."
    ),
    cloud_model: str | None = typer.Option(None, "--cloud-model", help="Model the endpoint serves."),
    cloud_key: str | None = typer.Option(
        None, "--cloud-key", envvar="EDGECLOUD_CLOUD_API_KEY", help="API key for the endpoint.", show_default=False
    ),
    max_line_bytes: int = typer.Option(DEFAULT_MAX_LINE_BYTES, "--max-line-bytes", min=1024,
                                       help="Longest request line accepted; longer ones answer -32600."),
) -> None:
    """Serve the bridge over stdio (``--stdio``), or run a sub-command."""
    if ctx.invoked_subcommand is not None:
        return
    if not stdio:
        typer.echo(ctx.get_help())
        raise typer.Exit(2)
    options: dict[str, Any] = {"cloud_base_url": cloud_url or None, "cloud_model": cloud_model,
                               "cloud_api_key": cloud_key}
    if model is not None:
        options["edge_model"] = model
    try:
        client = EdgeCloud(**options)
    except EdgeCloudError as exc:
        typer.echo(f"edgecloud: error: {exc}", err=True)
        raise typer.Exit(2) from None
    protocol = _protocol_stdout()
    with client:
        code = serve_stdio(sys.stdin.buffer, protocol, bridge=Bridge(client), max_line_bytes=max_line_bytes)
    raise typer.Exit(code)


@app.command("schema")
def schema_command() -> None:
    """Print the JSON Schema of every bridge message (generate host code from it)."""
    typer.echo(json.dumps(schema(), indent=2))
