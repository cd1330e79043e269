"""The ``edgecloud`` command line: chat, models, plan, route, serve, quant, export, bridge.

Each sub-command lives in its own module; this one only builds the typer app and turns
edgecloud errors into a one-line message and exit code 2 instead of a traceback.
"""

from __future__ import annotations

import sys

import typer

from ..errors import EdgeCloudError
from . import bridge as _bridge
from . import chat as _chat
from . import export as _export
from . import models as _models
from . import plan as _plan
from . import quant as _quant
from . import route as _route
from . import serve as _serve

app = typer.Typer(
    name="edgecloud",
    help="Edge-cloud hybrid LLM inference: chat on-device, plan memory, manage models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(_models.app, name="models")
app.add_typer(_bridge.app, name="bridge")
app.add_typer(_route.app, name="route")
app.add_typer(_quant.app, name="quant")
app.add_typer(_export.app, name="export")
app.command("plan", help="Plan whether a model fits a device's memory budget.")(_plan.plan_command)
app.command("chat", help="Chat with a model: an interactive REPL, or one answer with --prompt.")(_chat.chat_command)
app.command("serve", help="Serve a model over the OpenAI API on this machine.")(_serve.serve_command)

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except EdgeCloudError as exc:
        typer.echo(f"edgecloud: error: {exc}", err=True)
        sys.exit(2)
