"""``edgecloud export onnx``: build an ONNX Runtime GenAI folder (INT4 MatMulNBits, CPU) from a GGUF model.

The work is :func:`edgecloud.quant.export_onnx.export_onnx`; this module draws its progress
(one bar per stage: dequantize, tokenizer, build, verify) on stderr and prints the result:
where the folder is, how big, how long each stage took and a sample answer (``--json``: one
JSON object on stdout; otherwise stdout gets only the folder's path). Errors are one line and
exit status 2.
"""

from __future__ import annotations

import json as json_lib
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TaskProgressColumn, TextColumn, TimeElapsedColumn

from ..errors import EdgeCloudError

__all__ = ["onnx_command"]

_STAGE_TITLES = {
    "dequantize": "dequantize GGUF → float32 safetensors",
    "tokenizer": "tokenizer.json from the GGUF vocabulary",
    "build": "onnxruntime-genai builder (INT4 MatMulNBits)",
    "verify": "load and generate",
}


def onnx_command(
    model: str = typer.Option(..., "--model", "-m", help="Catalogue name or path to a .gguf file."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to create (it must not exist or be empty)."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists and is not empty."),
    block_size: int = typer.Option(32, "--block-size", help="MatMulNBits quantization block: 16, 32, 64, 128 or 256."),
    json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a summary."),
) -> None:
    """Dequantize a GGUF model and rebuild it as an INT4 ONNX Runtime GenAI folder for the CPU."""
    from ..quant.export_onnx import STAGES, export_onnx
    from ..store import resolve_model

    # Bound to the real stderr now: the builder's prints are captured while it runs.
    err = Console(file=sys.stderr)
    progress = Progress(
        TextColumn("{task.description:<46}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=err,
        redirect_stdout=False,
        redirect_stderr=False,
        disable=json,
    )
    tasks: dict[str, TaskID] = {
        stage: progress.add_task(_STAGE_TITLES[stage], total=None, start=False) for stage in STAGES
    }

    def report(stage: str, done: int, total: int) -> None:
        progress.start_task(tasks[stage])  # its clock starts with its first report
        progress.update(tasks[stage], completed=done, total=total or None)

    try:
        resolve_model(model, pull=True)  # a first pull draws its own bar: rich shows one live display at a time
        with progress:
            result = export_onnx(model, out, force=force, block_size=block_size, progress=report)
    except EdgeCloudError as exc:
        err.print(f"[red]edgecloud: error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from None
    summary = result.to_dict()
    if json:
        typer.echo(json_lib.dumps(summary))
        return
    stages = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in summary["seconds"].items())
    err.print(
        f"[green]built[/green] {summary['out']} · {summary['model']} ({summary['architecture']}) · "
        f"{summary['precision']} block {summary['block_size']} · {summary['onnx_bytes'] / 1024**2:,.1f} MiB · "
        f"{summary['total_seconds']:.1f} s ({stages})",
        soft_wrap=True,
    )
    err.print(f"[dim]sample answer: {summary['sample']!r} · chat with it: "
              f"edgecloud chat --backend onnx --model {summary['out']}[/dim]", soft_wrap=True)
    typer.echo(summary["out"])
