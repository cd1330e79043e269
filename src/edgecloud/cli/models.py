"""``edgecloud models``: list the catalogue, pull a model, print a model's local path."""

from __future__ import annotations

import json

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from .. import store
from ..errors import EdgeCloudError

app = typer.Typer(help="List, pull and locate models.", no_args_is_help=True)


def _fail(exc: EdgeCloudError) -> None:
    typer.echo(f"edgecloud: error: {exc}", err=True)
    raise typer.Exit(2)


@app.command("list")
def list_models(json_output: bool = typer.Option(False, "--json", help="Print JSON, one object.")) -> None:
    """List the catalogue and whether each model is pulled."""
    rows = []
    for entry in store.catalogue().values():
        row = entry.summary()
        row["pulled"] = store.is_pulled(entry.name)
        row["fetchable_here"] = entry.fetchable_here
        row["path"] = str(store.model_file(entry.name)) if row["pulled"] else None
        rows.append(row)
    if json_output:
        typer.echo(json.dumps({"models": rows}, indent=2))
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("name", "params", "quant", "size", "source", "pulled"):
        table.add_column(col, no_wrap=True, justify="right" if col == "size" else "left")
    for row in rows:
        table.add_row(
            row["name"], row["parameters"], row["quantization"],
            f"{row['size_bytes'] / 2**30:.2f} GiB", row["source"], "yes" if row["pulled"] else "-",
        )
    Console().print(table)


@app.command("pull")
def pull_model(
    name: str = typer.Argument(..., help="Catalogue name (see `edgecloud models list`)."),
    force: bool = typer.Option(False, "--force", help="Fetch again even if a verified file is present."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Fetch, assemble and verify a model (a no-op when it is already verified)."""
    try:
        path = store.pull(name, progress=not quiet, force=force)
    except EdgeCloudError as exc:
        _fail(exc)
    typer.echo(str(path))


@app.command("path")
def model_path(
    name: str = typer.Argument(..., help="Catalogue name or local .gguf path."),
    pull: bool = typer.Option(False, "--pull", help="Pull the model if it is not there yet."),
) -> None:
    """Print the local path of a model (verified)."""
    try:
        path = store.resolve_model(name, pull=pull, progress=True)
    except EdgeCloudError as exc:
        _fail(exc)
    typer.echo(str(path))
