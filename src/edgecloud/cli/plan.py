"""``edgecloud plan``: will a model fit a device, at what context, with which KV cache?"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from ..edge.device import device_names
from ..config import load_settings
from ..edge.memory import KV_CACHE_TYPES, MemoryPlan, plan, plan_onnx, with_kv_tiers
from ..errors import EdgeCloudError
from ..runtime.hardware import cpu_budget
from ..store.catalogue import draft_model_for

__all__ = ["plan_command"]

_MiB = 1024**2


def _mib(n: int) -> str:
    return f"{n / _MiB:,.1f} MiB"


def _plan(model: str, device: str, ctx: int | None, kv_cache_type: str | None) -> MemoryPlan:
    """A GGUF model is planned for llama.cpp; a folder (an ONNX export) for onnxruntime-genai."""
    if not Path(model).expanduser().is_dir():
        return plan(model, device, ctx, kv_cache_type=kv_cache_type)
    if kv_cache_type is not None:
        raise typer.BadParameter("an ONNX export keeps its KV cache in float32; leave it out", param_hint="--kv-cache-type")
    return plan_onnx(model, device, ctx)


def plan_command(
    model: str = typer.Option(
        ..., "--model", help="Catalogue name, path to a local .gguf file, or an `edgecloud export onnx` folder."
    ),
    device: str = typer.Option("this", "--device", help=f"Device profile: {', '.join(device_names())}."),
    ctx: Optional[int] = typer.Option(None, "--ctx", help="Context tokens to plan for (default: the largest that fits, up to 8192)."),
    kv_cache_type: Optional[str] = typer.Option(
        None, "--kv-cache-type", help=f"Force the KV cache type: {', '.join(KV_CACHE_TYPES)} (default: f16, quantized only when needed)."
    ),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object."),
    cloud_base_url: Optional[str] = typer.Option(
        None, "--cloud-base-url", help="Also ask this cloud endpoint what it can do (a few one-token requests) "
                                       "and say which collaboration mode collab=auto runs with it."),
    cloud_model: Optional[str] = typer.Option(None, "--cloud-model", help="The model the cloud endpoint serves."),
) -> None:
    """Plan a model's memory on a device: weights, KV cache, compute buffers, and whether it fits."""
    try:
        result = _plan(model, device, ctx, kv_cache_type)
        if not Path(model).expanduser().is_dir():  # the KV tiers are the llama.cpp runtime's; an ONNX export has none
            cache = load_settings().cache
            result = with_kv_tiers(result, cache.ram_mib * _MiB, cache.disk_mib * _MiB, cache.folder())
        cloud = _cloud(cloud_base_url, cloud_model, onnx=Path(model).expanduser().is_dir())
        drafter = _drafter(model, device, ctx, kv_cache_type)
    except EdgeCloudError as exc:
        typer.echo(f"edgecloud: error: {exc}", err=True)
        raise typer.Exit(2) from None
    cpu = cpu_budget()
    if json_output:
        typer.echo(json.dumps({**result.to_dict(), "cpu": {**asdict(cpu), "said": cpu.describe()},
                               **({"cloud": cloud} if cloud else {}), **({"drafter": drafter} if drafter else {})}))
        return
    table = Table(title=f"{result.model} on {result.device}", show_header=False)
    table.add_column("item")
    table.add_column("value", justify="right")
    table.add_row("fits", "[green]yes[/green]" if result.fits else "[red]no[/red]")
    table.add_row("context", f"{result.n_ctx:,} tokens (max {result.max_context:,})")
    table.add_row("KV cache", f"{result.kv_cache_type}, flash attention {'on' if result.flash_attn else 'off'}")
    table.add_row("GPU layers", str(result.gpu_layers))
    table.add_row("CPU", cpu.describe())
    table.add_row("weights", _mib(result.weights_bytes))
    table.add_row("KV cache", _mib(result.kv_bytes))
    table.add_row("compute buffers", _mib(result.compute_bytes))
    table.add_row("runtime overhead", _mib(result.overhead_bytes))
    table.add_row("total", _mib(result.total_bytes))
    table.add_row("budget", _mib(result.budget_bytes))
    per_token = result.kv_bytes_per_token
    if result.ram_tier_bytes:
        table.add_row("saved KV in RAM", f"{_mib(result.ram_tier_bytes)} (~{result.ram_tier_bytes // max(1, per_token):,} "
                                         "tokens; evicted to disk, outside the total)")
    if result.disk_tier_bytes:
        free = f", {_mib(result.disk_free_bytes)} free there" if result.disk_free_bytes is not None else ""
        short = (result.disk_free_bytes is not None and result.disk_free_bytes < result.disk_tier_bytes)
        table.add_row("saved KV on disk", f"{'[yellow]' if short else ''}{_mib(result.disk_tier_bytes)} "
                                          f"(~{result.disk_tier_bytes // max(1, per_token):,} tokens{free})"
                                          f"{'[/yellow]' if short else ''}")
    console = Console()
    console.print(table)
    console.print(result.reason)
    if drafter:
        console.print(f"verified mode drafts with {drafter['model']} (edge_draft_model): "
                      f"{_mib(drafter['weights_bytes'])} more weights, loaded beside it on the first verified answer "
                      "(edge_draft_model='' drafts with the edge model itself)")
    if cloud:
        found = Table(title=f"cloud {cloud['endpoint']} ({cloud['model']})", show_header=False)
        found.add_column("capability")
        found.add_column("", justify="right")
        for name, ok in cloud["capabilities"].items():
            found.add_row(name, "[green]yes[/green]" if ok else "[red]no[/red]" if ok is False else "not tried")
        console.print(found)
        console.print(f"collab=auto runs {cloud['auto_mode']} mode: {cloud['why']}")
        console.print(f"with temperature above 0: {cloud['auto_mode_sampled']} mode: {cloud['why_sampled']}")


def _drafter(model: str, device: str, ctx: int | None, kv_cache_type: str | None) -> dict[str, object] | None:
    """The file verified mode drafts with beside ``model`` (``edge_draft_model``), and its weights."""
    if Path(model).expanduser().is_dir():
        return None
    name = draft_model_for(model, load_settings().edge_draft_model)
    if name is None:
        return None
    return {"model": name, "weights_bytes": _plan(name, device, ctx, kv_cache_type).weights_bytes}


def _cloud(base_url: str | None, model: str | None, *, onnx: bool) -> dict[str, object] | None:
    """What the cloud endpoint can do, and the mode ``collab="auto"`` runs with this edge model."""
    if base_url is None:
        return None
    from ..collab.auto import choose_mode
    from ..remote.client import CloudBackend

    settings = load_settings()
    model = model or settings.cloud_model
    if not model:
        raise typer.BadParameter("name the model the endpoint serves", param_hint="--cloud-model")
    key = settings.cloud_api_key.get_secret_value() if settings.cloud_api_key is not None else None
    with CloudBackend(base_url, model, api_key=key) as backend:
        backend.load()
        found = backend.discover()
    table = found.table()
    runtime = "onnx" if onnx else "llamacpp"  # what plans a folder, what plans a GGUF file
    sides = dict(runtime=runtime, drafts=not onnx, logprobs=True, scores=bool(table["score"]) and
                 table["token_ids"] is not False, continues=table["continue"] is not False,
                 sessions=table["sessions"] is not False)
    mode, why = choose_mode(**sides)  # type: ignore[arg-type]
    sampled, sampled_why = choose_mode(**sides, couples=table["coupling"] is not False)  # type: ignore[arg-type]
    return {**found.snapshot(), "auto_mode": mode or "off", "why": why,
            "auto_mode_sampled": sampled or "off", "why_sampled": sampled_why}
