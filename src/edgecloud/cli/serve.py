"""``edgecloud serve``: the OpenAI-compatible endpoint on this machine.

Serves a model through the torch engine (fp32 / bf16 / fp8 weights) or through llama.cpp
(INT4 GGUF as is), behind :func:`edgecloud.cloud.server.serve`.
"""

from __future__ import annotations

import os

import typer

from ..errors import EdgeCloudError

RUNTIMES = ("torch", "llamacpp")
DEFAULT_CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct-q4"


def pick_device_and_precision(precision: str) -> tuple[str, str]:
    """``auto`` → FP8 where matmuls run natively in FP8, bf16 on other GPUs, fp32 on the CPU."""
    import torch

    from ..quant.fp8 import scaled_mm_supported

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if precision != "auto":
        return device, precision
    if scaled_mm_supported(device):
        return device, "fp8"
    return device, ("bf16" if device == "cuda" else "fp32")


def serve_command(
    model: str = typer.Option(DEFAULT_CLOUD_MODEL, "--model", "-m", help="Catalogue name or .gguf path."),
    runtime: str = typer.Option("torch", "--runtime", help="torch (fp32/bf16/fp8 weights) or llamacpp (INT4 as is)."),
    precision: str = typer.Option(
        "auto", "--precision", help="torch runtime: fp32, bf16, fp8, or auto (fp8 on CUDA sm89+, bf16 on CUDA, fp32 on CPU)."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: str | None = typer.Option(
        None, "--api-key", help="Require this bearer key on /v1 (default: $EDGECLOUD_API_KEY, else none)."
    ),
    ctx: int | None = typer.Option(None, "--ctx", help="Context size (default: the runtime's choice)."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
) -> None:
    """Serve a model over the OpenAI API (/v1/chat/completions, /v1/models, /health)."""
    from ..cloud.server import serve

    if runtime not in RUNTIMES:
        typer.echo(f"edgecloud: error: unknown runtime {runtime!r}; use one of {', '.join(RUNTIMES)}", err=True)
        raise typer.Exit(2)
    try:
        if runtime == "torch":
            from ..cloud.engine_backend import TorchEngineBackend

            device, chosen = pick_device_and_precision(precision)
            backend = TorchEngineBackend(model, precision=chosen, n_ctx=ctx, device=device)
        else:
            from ..edge.llamacpp import LlamaCppBackend

            backend = LlamaCppBackend(model, n_ctx=ctx)
        serve(backend, host, port, api_key=api_key or os.environ.get("EDGECLOUD_API_KEY"), log_level=log_level)
    except EdgeCloudError as exc:
        typer.echo(f"edgecloud: error: {exc}", err=True)
        raise typer.Exit(2) from None
