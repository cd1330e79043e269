"""``edgecloud quant compare``: is FP8 safe for this model, and which layers must stay in bf16?

One command runs the model in fp32 and with its block linears in FP8 (quantize-dequantize on
CPU) over a text + code sample (the packaged one, or ``--data``), and reports top-1 agreement,
the relative change in next-token NLL (the *drift*), the mean KL and each layer's sensitivity.
With ``--protect auto`` the most sensitive layers (most KL removed per extra byte) are kept in
bf16 within the byte budget, and the choice is written as a quantization config that
``edgecloud serve --quant fp8 --quant-config FILE`` applies.

Exit status: 0 when the result is within ``--max-drift`` and ``--min-top1``, 1 when it is not
(usable as a CI gate), 2 for bad arguments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from ..errors import EdgeCloudError

__all__ = ["app", "read_texts"]

app = typer.Typer(help="Quantization tools: precision checks for FP8 serving.", no_args_is_help=True)


def read_texts(path: Path) -> dict[str, str]:
    """Texts to score from ``path``: a ``.jsonl`` of ``{"text": ..., "name": ...}`` lines, a
    folder of ``.txt``/``.md``/``.py`` files, or any one text file."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in {".txt", ".md", ".py"} and p.is_file())
        texts = {p.name: p.read_text(encoding="utf-8") for p in files}
    elif path.suffix == ".jsonl":
        texts = {}
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
                texts[str(row.get("name") or f"line{n}")] = str(row["text"])
            except (ValueError, KeyError, TypeError) as exc:
                raise typer.BadParameter(f"{path}:{n}: want a JSON object with a 'text' field ({exc})",
                                         param_hint="--data") from None
    else:
        texts = {path.name: path.read_text(encoding="utf-8")}
    texts = {k: v for k, v in texts.items() if v.strip()}
    if not texts:
        raise typer.BadParameter(f"{path} holds no text to score", param_hint="--data")
    return texts


@app.command("compare")
def compare_command(
    model: str = typer.Option(..., "--model", "-m", help="Catalogue name or .gguf path."),
    quant: str = typer.Option("fp8", "--quant", help="Low precision to check (fp8)."),
    data: Optional[Path] = typer.Option(
        None, "--data", exists=True, help="Text to score: a file, a .jsonl of {\"text\"} lines or a folder "
        "(default: the packaged code + prose sample)."
    ),
    max_drift: float = typer.Option(0.01, "--max-drift", help="Largest allowed NLL increase, as a fraction (0.01 = 1%)."),
    min_top1: float = typer.Option(0.97, "--min-top1", help="Smallest allowed top-1 agreement with fp32."),
    protect: str = typer.Option("auto", "--protect", help="auto: keep the most sensitive layers in bf16; none."),
    max_bytes_ratio: float = typer.Option(
        0.55, "--max-bytes-ratio", help="Byte budget for protection: linear weight bytes over their bf16 bytes."
    ),
    tokens: int = typer.Option(2000, "--tokens", min=16, help="Tokens scored in all."),
    calibration_tokens: int = typer.Option(256, "--calibration-tokens", min=16, help="Tokens for layer sensitivity."),
    save_config: Optional[Path] = typer.Option(
        None, "--save-config", help="Where to write the quantization config (default: MODEL.quant.json here)."
    ),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Compare a model in fp32 and in FP8: top-1 agreement, NLL drift, KL, per-layer sensitivity."""
    if max_drift <= 0:
        raise typer.BadParameter(f"must be > 0, got {max_drift}", param_hint="--max-drift")
    if not 0 < min_top1 <= 1:
        raise typer.BadParameter(f"must be in (0, 1], got {min_top1}", param_hint="--min-top1")
    if protect not in ("auto", "none"):
        raise typer.BadParameter(f"{protect!r}: use auto or none", param_hint="--protect")
    texts = read_texts(data) if data is not None else None
    from ..quant.compare import compare_precision, save_quant_config
    from ..store import resolve_model

    err = Console(stderr=True)
    try:
        path = resolve_model(model, pull=True)
        with err.status(f"measuring {path.name} in fp32 and {quant}…", spinner="dots"):
            result = compare_precision(path, quant, texts, tokens=tokens, protect=protect, min_top1=min_top1,
                                       max_nll_increase=max_drift, max_bytes_ratio=max_bytes_ratio,
                                       calibration_tokens=calibration_tokens)
    except EdgeCloudError as exc:
        err.print(f"[red]edgecloud: error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from None
    config_path = None
    if protect == "auto":
        config_path = save_quant_config(result, save_config or Path(f"{path.stem}.quant.json"))
        result["config"] = str(config_path)
    if json_output:
        typer.echo(json.dumps(result, indent=2))
    else:
        _report(result, max_drift, err)
    raise typer.Exit(0 if result["meets_targets"] else 1)


def _report(result: dict[str, Any], max_drift: float, err: Console) -> None:
    out = Console(highlight=False)
    un = result["unprotected"]
    table = Table(title=f"{result['model']}: fp32 vs {result['quant']} on {result['positions']} tokens")
    for column in ("", "top-1 agreement", "NLL drift", "KL mean", "weight bytes / bf16"):
        table.add_column(column, justify="right")
    table.add_row(f"all {result['quant']}", f"{un['top1_agreement']:.4f}", f"{un['nll_delta_pct']:+.3f} %",
                  f"{un['kl_mean']:.5f}", f"{un['weight_bytes_ratio']:.3f}")
    if result["protected"]:
        table.add_row(f"{len(result['protected'])} layers kept in bf16", f"{result['top1_agreement']:.4f}",
                      f"{result['nll_delta_pct']:+.3f} %", f"{result['kl_mean']:.5f}",
                      f"{result['weight_bytes_ratio']:.3f}")
    out.print(table)
    for layer in result["layers"][:8]:
        mark = "kept in bf16" if layer["protected"] else ""
        out.print(f"  {layer['name']:<24} KL alone {layer['kl']:.5f}  {mark}")
    verdict = "within" if result["meets_targets"] else "NOT within"
    out.print(f"{verdict} budget (drift ≤ {max_drift * 100:g} %, top-1 ≥ {result['targets']['min_top1']})")
    if result.get("config"):
        out.print(f"quantization config: {result['config']}  (edgecloud serve --quant fp8 --quant-config FILE)")
