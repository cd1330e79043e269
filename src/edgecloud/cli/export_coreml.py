"""``edgecloud export coreml``: build a stateful INT4 Core ML ``.mlpackage`` (iOS 18 / macOS 15) from a GGUF model.

The work is :func:`edgecloud.quant.export_coreml.export_coreml`; this module owns the command:
its options, a progress display on stderr (one line per stage: load, trace, convert with
INT4 quantization, save), and the summary (path, size, time, the package's inputs, outputs
and states), or one JSON object with ``--json``. Conversion runs anywhere coremltools does;
running the package needs macOS 15+ (:class:`~edgecloud.edge.coreml.CoreMLBackend`).

Exit status: 0 on success, 2 for bad options or a model that cannot be exported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..errors import EdgeCloudError

__all__ = ["coreml_command"]


def coreml_command(
    model: str = typer.Option(..., "--model", "-m", help="Catalogue name or .gguf path."),
    out: Path = typer.Option(..., "--out", "-o", help="Package to write; must end in .mlpackage."),
    context: int = typer.Option(512, "--context", help="KV cache length in tokens (prompt + answer)."),
    int4_block: int = typer.Option(
        32, "--int4-block", help="Weights per INT4 scale: 16, 32, 64, ... dividing the model's widths."
    ),
    force: bool = typer.Option(False, "--force", help="Replace --out when it exists and is not empty."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Trace the model with its KV cache as Core ML states, convert it with INT4 weights, save the package."""
    from ..quant.export_coreml import STAGES, export_coreml, inspect_mlpackage
    from ..store import resolve_model

    err = Console(file=sys.stderr)  # bound now: the exporter silences sys.stderr while coremltools runs
    try:
        resolve_model(model, pull=True)  # a first pull shows its own progress bar
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                      transient=True) as bar:
            task = bar.add_task("starting", total=len(STAGES))

            def on_progress(stage: str) -> None:
                bar.update(task, completed=list(STAGES).index(stage), description=f"{stage}: {STAGES[stage]}")

            result = export_coreml(model, out, context=context, int4_block=int4_block, force=force,
                                   on_progress=on_progress)
        spec = inspect_mlpackage(result.path)
    except EdgeCloudError as exc:
        err.print(f"[red]edgecloud: error:[/red] {exc}", soft_wrap=True, highlight=False)
        raise typer.Exit(2) from None
    report = {**result.to_dict(), **{k: spec[k] for k in ("inputs", "outputs", "states", "weight_bytes", "int4_ops")}}
    if json_output:
        typer.echo(json.dumps(report, indent=2))
    else:
        _summary(report)


def _shape(shape: list[Any]) -> str:
    return "[" + ", ".join(f"{d[0]}..{d[1]}" if isinstance(d, list) else str(d) for d in shape) + "]"


def _summary(report: dict[str, Any]) -> None:
    out = Console(highlight=False, soft_wrap=True)
    stages = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in report["stage_seconds"].items())
    out.print(f"wrote {report['path']}")
    out.print(f"  {report['size_bytes'] / 1e6:.1f} MB ({report['weight_bytes'] / 1e6:.1f} MB of weights, "
              f"{report['int4_ops']} INT4 tensors, block {report['int4_block']}), context {report['context']} tokens")
    out.print(f"  {report['seconds']:.1f} s ({stages})")
    for kind in ("inputs", "outputs", "states"):
        features = ", ".join(f"{f['name']} {f['dtype']} {_shape(f['shape'])}" for f in report[kind])
        out.print(f"  {kind + ':':<8} {features}")
    out.print("  runs on macOS 15+ / iOS 18+: edgecloud.edge.coreml.CoreMLBackend(PATH)")
