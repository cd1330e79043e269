"""``edgecloud serve``: the OpenAI-compatible endpoint on this machine, or vLLM for scale-out.

Engines: ``llamacpp`` (the GGUF's own INT4 weights, continuous batching over llama.cpp
sequences), ``torch`` (our engine: continuous batching, fp32 / bf16 / fp8 weights), ``vllm``
(vLLM's OpenAI server, started and watched; see :mod:`edgecloud.serving.vllm`), and ``auto``
(the default: :func:`edgecloud.serving.engine_choice.choose_engine` picks one for this machine
and says why). ``--draft-model`` / ``--spec`` decode speculatively on every engine.
Options an engine does not have are refused by name (exit 2), never ignored.
"""

from __future__ import annotations

import logging
import os

import typer

from ..errors import EdgeCloudError

QUANTS = ("auto", "fp32", "bf16", "fp8")
#: ``--spec`` values (kept here so the CLI does not import torch to check an argument).
SPEC_MODES = ("draft", "ngram", "auto", "off")
DEFAULT_CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct-q4"
DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_QUEUE = 64


def _fail(message: str) -> typer.Exit:
    typer.echo(f"edgecloud: error: {message}", err=True)
    return typer.Exit(2)


def _note(message: str) -> None:
    typer.echo(f"edgecloud: {message}", err=True)


def serve_command(
    model: str = typer.Option(DEFAULT_CLOUD_MODEL, "--model", "-m", help="Catalogue name, .gguf path (or, for vllm, a checkpoint directory or OWNER/REPO)."),
    engine: str = typer.Option(
        "auto", "--engine", "--runtime",
        help="auto (chosen for this machine, reason printed), llamacpp (INT4 GGUF, continuous batching), torch (fp32/bf16/fp8) or vllm.",
    ),
    quant: str | None = typer.Option(
        None, "--quant", "--precision",
        help="torch/vllm: fp32, bf16, fp8, or auto (FP8 on CUDA sm89+ after a self-check, bf16 on other GPUs and bf16 CPUs, else fp32).",
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: str | None = typer.Option(
        None, "--api-key", help="Require this bearer key on /v1 (default: $EDGECLOUD_API_KEY, else none)."
    ),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="The model name clients send (default: the catalogue name or file stem)."),
    max_batch: int | None = typer.Option(
        None, "--max-batch", min=1, help=f"Sequences decoded together (default {DEFAULT_MAX_BATCH}); --engine auto "
                                         "weighs it as the expected load."),
    max_queue: int | None = typer.Option(None, "--max-queue", min=0, help=f"llamacpp/torch: requests waiting for a slot before 429 (default {DEFAULT_MAX_QUEUE})."),
    ctx: int | None = typer.Option(None, "--ctx", help="Context per request (default: the engine's choice)."),
    threads: int | None = typer.Option(None, "--threads", min=1, help="llamacpp/vllm on CPU: compute threads (default: every core)."),
    quant_config: str | None = typer.Option(
        None, "--quant-config", help="torch fp8: a quantization config (layers kept in high precision) from quant compare."
    ),
    tensor_parallel_size: int | None = typer.Option(
        None, "--tensor-parallel-size", help="vllm: GPUs to split the model over (default: all visible)."
    ),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="vllm: a Hugging Face tokenizer (default: the checkpoint's own)."),
    vllm_args: list[str] = typer.Option([], "--vllm-arg", help="vllm: one more vLLM flag, passed verbatim (repeat it; e.g. --vllm-arg=--enforce-eager)."),
    vllm_python: str | None = typer.Option(None, "--vllm-python", help="vllm: the Python whose environment has vLLM (default: $EDGECLOUD_VLLM_PYTHON, else this one)."),
    vllm_plugin: bool = typer.Option(
        True, "--vllm-plugin/--no-vllm-plugin",
        help="vllm: load edgecloud's plugin, so verified-mode checks read vLLM's prefix cache in token sessions "
             "(off: vLLM recomputes the whole context for every check, as plain vLLM does).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="vllm: print the command instead of running it."),
    kv_offload: float | None = typer.Option(
        None, "--kv-offload", help="vllm: GiB of KV blocks offloaded out of GPU memory and reused from there "
                                   "(vLLM's --kv-offloading-size; needs vLLM >= 0.11).",
    ),
    kv_ram_mib: int = typer.Option(
        0, "--kv-ram-mib", min=0, help="llamacpp: keep prefixes that slots drop (sessions between turns) in this much "
                                       "RAM and give them back to the next request that starts with them.",
    ),
    kv_disk_mib: int = typer.Option(
        0, "--kv-disk-mib", min=0, help="llamacpp: spill what the RAM tier evicts to this much disk (under --kv-dir).",
    ),
    kv_dir: str | None = typer.Option(None, "--kv-dir", help="llamacpp: folder of the disk tier (default: kv under the edgecloud cache)."),
    disaggregate: str | None = typer.Option(
        None, "--disaggregate", help="vllm: prefill=N,decode=M instances (ports after --port) behind a proxy on "
                                     "--port that sends the prompt to a prefill instance and the answer to a decode one.",
    ),
    kv_offload_backend: str = typer.Option(
        "native", "--kv-offload-backend", help="vllm: native (vLLM's CPU tier) or lmcache (LMCache, installed beside vLLM).",
    ),
    draft_model: str | None = typer.Option(
        None, "--draft-model", help="A small model with the same tokenizer that drafts tokens (e.g. qwen2.5-coder-0.5b-instruct-q4)."
    ),
    spec: str | None = typer.Option(
        None, "--spec", help="Speculative decoding: draft, ngram, auto (ours only) or off (default: auto with --draft-model, else off)."
    ),
    spec_k_max: int = typer.Option(8, "--spec-k-max", min=1, max=32, help="Most draft tokens per step (adaptive below it; vllm: fixed)."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
) -> None:
    """Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)."""
    from ..serving.engines import ENGINES, ServeOptions

    if engine not in ("auto", *ENGINES):
        raise _fail(f"unknown engine {engine!r}; use one of auto, {', '.join(ENGINES)}")
    if quant is not None and quant not in QUANTS:
        raise _fail(f"unknown quant {quant!r}; use one of {', '.join(QUANTS)}")
    options = ServeOptions(
        model=model, max_batch=max_batch or DEFAULT_MAX_BATCH, ctx=ctx, quant=quant, max_queue=max_queue, threads=threads,
        quant_config=quant_config, tensor_parallel_size=tensor_parallel_size, tokenizer=tokenizer,
        vllm_args=list(vllm_args), vllm_python=vllm_python, dry_run=dry_run, draft_model=draft_model, spec=spec,
        spec_k_max=spec_k_max, host=host, port=port, api_key=api_key or os.environ.get("EDGECLOUD_API_KEY"),
        served_model_name=served_model_name, kv_offload=kv_offload, kv_offload_backend=kv_offload_backend,
        kv_ram_mib=kv_ram_mib, kv_disk_mib=kv_disk_mib, kv_dir=kv_dir, disaggregate=disaggregate,
        vllm_plugin=vllm_plugin,
    )
    if options.spec_mode not in SPEC_MODES:
        raise _fail(f"unknown --spec {options.spec_mode!r}; use one of {', '.join(SPEC_MODES)}")
    if options.spec_mode in ("draft", "auto") and not draft_model:
        raise _fail(f"--spec {options.spec_mode} needs --draft-model (e.g. qwen2.5-coder-0.5b-instruct-q4 for a "
                    "qwen2.5-coder target)")
    level = logging.getLevelName(log_level.upper())
    logging.basicConfig(level=level if isinstance(level, int) else logging.INFO, format="edgecloud: %(message)s")
    given = {
        "--quant": quant is not None, "--max-queue": max_queue is not None, "--threads": threads is not None,
        "--quant-config": quant_config is not None, "--tensor-parallel-size": tensor_parallel_size is not None,
        "--tokenizer": tokenizer is not None, "--vllm-arg": bool(vllm_args), "--vllm-python": vllm_python is not None,
        "--dry-run": dry_run, "--draft-model": draft_model is not None, "--spec": spec is not None,
        "--kv-offload": kv_offload is not None, "--kv-offload-backend": kv_offload_backend != "native",
        "--kv-ram-mib": kv_ram_mib > 0, "--kv-disk-mib": kv_disk_mib > 0, "--kv-dir": kv_dir is not None,
        "--disaggregate": disaggregate is not None, "--no-vllm-plugin": not vllm_plugin,
    }
    try:
        chosen = ENGINES[_auto_engine(vllm_python, given, max_batch, quant) if engine == "auto" else engine]
        refused = chosen.refused(given)
        if refused:
            raise _fail(f"{', '.join(refused)} {'does' if len(refused) == 1 else 'do'} not apply to --engine "
                        f"{chosen.name}; leave {'it' if len(refused) == 1 else 'them'} out or pick another engine")
        if chosen.launch is not None:
            raise typer.Exit(chosen.launch(options))
        assert chosen.build is not None
        from ..serving.server import serve

        backend = chosen.build(options)
        serve(backend, host, port, model_name=served_model_name, api_key=options.api_key, log_level=log_level,
              on_loaded=lambda: _note(backend.describe()))
    except EdgeCloudError as exc:
        raise _fail(str(exc)) from None


def _auto_engine(vllm_python: str | None, given: dict[str, bool], max_batch: int | None, quant: str | None) -> str:
    from ..serving.engine_choice import choose_engine
    from ..serving.engines import ENGINES
    from ..serving.vllm_launch import find_vllm

    found = find_vllm(vllm_python)
    usable = found is not None and found.problem is None
    choice = choose_engine(vllm_version=found.version if usable else None, vllm_on_cpu=bool(found and found.cpu),
                           streams=max_batch, quant=quant, refuses=lambda name: ENGINES[name].refused(given))
    _note(f"--engine auto: {choice.engine}: {choice.reason}")
    return choice.engine
