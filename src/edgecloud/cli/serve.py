"""``edgecloud serve``: the OpenAI-compatible endpoint on this machine, or vLLM for scale-out.

Engines: ``torch`` (default; our engine with continuous batching, a prefix cache and
fp32 / bf16 / fp8 weights), ``llamacpp`` (the INT4 GGUF as is, one request at a time) and
``vllm`` (builds and runs the equivalent ``vllm serve`` command, see
:mod:`edgecloud.cloud.vllm`). With ``--draft-model`` / ``--spec`` the torch engine decodes
speculatively (:mod:`edgecloud.cloud.speculative`).
"""

from __future__ import annotations

import os

import typer

from ..errors import EdgeCloudError

ENGINES = ("torch", "llamacpp", "vllm")
QUANTS = ("auto", "fp32", "bf16", "fp8")
#: ``--spec`` values (kept here so the CLI does not import torch to check an argument).
SPEC_MODES = ("draft", "ngram", "auto", "off")
DEFAULT_CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct-q4"


def pick_device_and_precision(precision: str) -> tuple[str, str]:
    """``auto`` → FP8 where matmuls run natively in FP8, bf16 on other GPUs, fp32 on the CPU."""
    import torch

    from ..engine.fp8 import scaled_mm_supported

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if precision != "auto":
        return device, precision
    if scaled_mm_supported(device):
        return device, "fp8"
    return device, ("bf16" if device == "cuda" else "fp32")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"edgecloud: error: {message}", err=True)
    return typer.Exit(2)


def serve_command(
    model: str = typer.Option(DEFAULT_CLOUD_MODEL, "--model", "-m", help="Catalogue name or .gguf path."),
    engine: str = typer.Option(
        "torch", "--engine", "--runtime", help="torch (batched, fp32/bf16/fp8), llamacpp (INT4 as is) or vllm."
    ),
    quant: str = typer.Option(
        "auto", "--quant", "--precision", help="fp32, bf16, fp8, or auto (fp8 on CUDA sm89+, bf16 on CUDA, fp32 on CPU)."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: str | None = typer.Option(
        None, "--api-key", help="Require this bearer key on /v1 (default: $EDGECLOUD_API_KEY, else none)."
    ),
    max_batch: int = typer.Option(8, "--max-batch", min=1, help="Sequences decoded together (torch, vllm)."),
    max_queue: int = typer.Option(64, "--max-queue", min=0, help="Requests waiting for a slot before 429 (torch)."),
    ctx: int | None = typer.Option(None, "--ctx", help="Context size (default: the engine's choice)."),
    quant_config: str | None = typer.Option(
        None, "--quant-config", help="torch fp8: a quantization config (layers kept in high precision) from quant compare."
    ),
    tensor_parallel_size: int | None = typer.Option(
        None, "--tensor-parallel-size", help="vllm: GPUs to split the model over (default: all visible)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="vllm: print the vllm serve command instead of running it."),
    draft_model: str | None = typer.Option(
        None, "--draft-model", help="torch: a small model with the same tokenizer to draft tokens (llama.cpp INT4)."
    ),
    spec: str | None = typer.Option(
        None, "--spec", help="torch: speculative decoding: draft, ngram, auto or off (default: auto with --draft-model, else off)."
    ),
    spec_k_max: int = typer.Option(8, "--spec-k-max", min=1, max=32, help="torch: most draft tokens per step (adaptive below it)."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
) -> None:
    """Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)."""
    if engine not in ENGINES:
        raise _fail(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
    if quant not in QUANTS:
        raise _fail(f"unknown quant {quant!r}; use one of {', '.join(QUANTS)}")
    spec_mode = spec or ("auto" if draft_model else "off")
    if spec_mode not in SPEC_MODES:
        raise _fail(f"unknown --spec {spec_mode!r}; use one of {', '.join(SPEC_MODES)}")
    if spec_mode != "off" and engine != "torch":
        raise _fail(f"--spec runs on --engine torch (for vllm pass its own --speculative-config); got --engine {engine}")
    if spec_mode in ("draft", "auto") and not draft_model:
        raise _fail(f"--spec {spec_mode} needs --draft-model (e.g. qwen2.5-coder-0.5b-instruct-q4 for a qwen2.5-coder target)")
    key = api_key or os.environ.get("EDGECLOUD_API_KEY")
    try:
        if engine == "vllm":
            from ..cloud.vllm import VLLMSettings, launch_vllm

            settings = VLLMSettings(
                model=model, host=host, port=port, api_key=key, quant=quant,  # type: ignore[arg-type]
                max_batch=max_batch, ctx=ctx, tensor_parallel_size=tensor_parallel_size,
            )
            raise typer.Exit(launch_vllm(settings, dry_run=dry_run))
        from ..cloud.server import serve

        if engine == "torch":
            from ..cloud.engine_backend import TorchEngineBackend
            from ..cloud.speculative import SpecConfig

            device, chosen = pick_device_and_precision(quant)
            keep: tuple[str, ...] = ()
            if quant_config is not None:
                from ..quant.compare import load_quant_config

                keep = tuple(load_quant_config(quant_config).keep_high_precision)
                if chosen != "fp8":
                    raise _fail(f"--quant-config applies to fp8 weights; this server runs {chosen}")
            backend = TorchEngineBackend(
                model, precision=chosen, n_ctx=ctx, device=device, max_batch=max_batch, max_queue=max_queue,
                fp8_skip=keep, speculative=SpecConfig(mode=spec_mode, k_max=spec_k_max),  # type: ignore[arg-type]
                draft_model=draft_model,
            )
        else:
            from ..edge.llamacpp import LlamaCppBackend

            backend = LlamaCppBackend(model, n_ctx=ctx)
        serve(backend, host, port, api_key=key, log_level=log_level)
    except EdgeCloudError as exc:
        raise _fail(str(exc)) from None
