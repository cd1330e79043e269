"""Scale-out through vLLM: ``edgecloud serve --engine vllm``.

This module owns the translation from edgecloud's serve settings to a ``vllm serve`` command
line, and the launcher that runs it. Our own torch engine serves one GPU; vLLM brings
tensor parallelism (several GPUs, one model), paged attention and its own continuous
batching, behind the same OpenAI-compatible API our clients already speak. Multi-node runs
add vLLM's own flags through ``extra_args`` (``--pipeline-parallel-size N`` with a Ray
cluster, ``--distributed-executor-backend ray``).

==========================  =====================================  ==============================
:class:`VLLMSettings`       ``vllm serve`` flag                     notes
==========================  =====================================  ==============================
``model``                   positional ``MODEL``                    see *Models* below
``quant="fp32"``            ``--dtype float32``
``quant="bf16"``            ``--dtype bfloat16``
``quant="fp8"``             ``--quantization fp8``                  see *FP8* below
``quant="auto"``            ``--dtype auto``                        vLLM picks (the config dtype)
``max_batch``               ``--max-num-seqs``                      sequences decoded together
``max_queue``               (none)                                  see *Queue* below
``ctx``                     ``--max-model-len``
``tensor_parallel_size``    ``--tensor-parallel-size``              default: every visible GPU
``prefix_caching``          ``--[no-]enable-prefix-caching``        on by default
``served_model_name``       ``--served-model-name``                 default: the catalogue name
``tokenizer``               ``--tokenizer``                         for GGUF files, see below
``gpu_memory_utilization``  ``--gpu-memory-utilization``            vLLM's default 0.9 if unset
``host`` / ``port``         ``--host`` / ``--port``
``api_key``                 ``--api-key``                           shown as ``***`` when printed
``extra_args``              appended last, verbatim                 any other vLLM flag
==========================  =====================================  ==============================

Models. A catalogue name resolves (pulled and verified by :func:`edgecloud.store.resolve_model`)
to its local GGUF file, which vLLM loads with its GGUF support (experimental in vLLM; recent
releases need the ``vllm-gguf-plugin`` package). The weights then stay in their GGUF
quantization (Q4_K_M for our catalogue) and ``--dtype`` only sets the activation dtype. vLLM
builds a tokenizer from the GGUF metadata unless ``tokenizer`` names the original Hugging Face
repo (e.g. ``Qwen/Qwen2.5-Coder-1.5B-Instruct``); vLLM recommends the latter because the
conversion is slow for large vocabularies. ``OWNER/REPO`` or ``hf://OWNER/REPO`` passes a Hugging
Face checkpoint through for vLLM to download; ``hf://OWNER/REPO/FILE.gguf`` and local paths
(a ``.gguf`` file or a checkpoint directory) are used as they are.

FP8. ``--quantization fp8`` is vLLM's online dynamic FP8: E4M3 weights with one scale per
weight tensor, activations scaled dynamically (per token on Ada/Hopper), lm_head kept high
precision. Our torch engine uses per-output-channel weight scales instead, so the two differ
slightly in rounding. vLLM overrides the quantization to ``gguf`` for a GGUF file, so FP8
needs an unquantized checkpoint (``OWNER/REPO``); asking for FP8 on a GGUF file is an error here
rather than a silent Q4 server.

Queue. vLLM has no bound on waiting requests (they queue in its scheduler until a slot frees),
so ``max_queue`` has no vLLM equivalent; it is kept so one settings object serves both engines,
and :func:`launch_vllm` says when it is ignored. Put a proxy with a concurrency limit in front
if you need 429s under overload.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Literal, get_args

from ..errors import BackendUnavailableError, InvalidRequestError
from ..store import HUB_PREFIX, get_entry, model_file, resolve_model

__all__ = [
    "INSTALL_HINT",
    "Quant",
    "VLLMSettings",
    "format_command",
    "launch_vllm",
    "visible_gpu_count",
    "vllm_available",
    "vllm_command",
    "vllm_model_source",
]

Quant = Literal["fp32", "bf16", "fp8", "auto"]

#: What each ``quant`` adds to the command line (a registry, not an ``elif`` chain).
QUANT_FLAGS: dict[str, tuple[str, ...]] = {
    "fp32": ("--dtype", "float32"),
    "bf16": ("--dtype", "bfloat16"),
    "fp8": ("--quantization", "fp8"),
    "auto": ("--dtype", "auto"),
}

INSTALL_HINT = (
    "install it with `pip install vllm` on a Linux machine with an NVIDIA CUDA GPU "
    "(vLLM publishes no macOS, Windows or CPU-only wheels for that command); "
    "to serve GGUF files with a recent vLLM also `pip install vllm-gguf-plugin`"
)

#: The module entry point, for environments where vLLM is importable but its script is not on PATH.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

_HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_REDACTED = "***"


@dataclass
class VLLMSettings:
    """Everything ``edgecloud serve --engine vllm`` passes on to vLLM (table in the module docstring)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    quant: Quant = "auto"
    #: Most sequences decoded in one step (``--max-num-seqs``); None keeps vLLM's default.
    max_batch: int | None = None
    #: No vLLM equivalent (vLLM's waiting queue is unbounded); kept for parity with our engine.
    max_queue: int | None = None
    #: Context length (``--max-model-len``); None keeps the model's own limit.
    ctx: int | None = None
    #: GPUs one model is split over; None means every visible CUDA GPU (at least 1).
    tensor_parallel_size: int | None = None
    prefix_caching: bool = True
    #: Name clients send as ``model``; None means the catalogue name (or the file's stem).
    served_model_name: str | None = None
    #: Hugging Face tokenizer repo or path, recommended for GGUF files.
    tokenizer: str | None = None
    gpu_memory_utilization: float | None = None
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.quant not in QUANT_FLAGS:
            raise InvalidRequestError(
                f"quant must be one of {', '.join(get_args(Quant))}, not {self.quant!r}", param="quant"
            )
        if not 0 < self.port < 65536:
            raise InvalidRequestError(f"port must be 1-65535, not {self.port}", param="port")
        for name in ("max_batch", "max_queue", "ctx", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name} must be at least 1, not {value}", param=name)
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(
                f"gpu_memory_utilization is a fraction in (0, 1], not {self.gpu_memory_utilization}",
                param="gpu_memory_utilization",
            )


def visible_gpu_count() -> int:
    """CUDA GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else torch's count, else 0."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        # "-1" or an empty value hides every GPU; CUDA stops at the first invalid id.
        devices = [d for d in env.split(",") if d.strip()]
        return 0 if not devices or devices[0].strip() == "-1" else len(devices)
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count())


def _default_tensor_parallel_size(model: str) -> int:
    """Every visible GPU, lowered to a divisor of the head count when the catalogue knows it.

    vLLM refuses a tensor-parallel size that does not divide the attention heads (12 heads on
    8 GPUs fails at start-up), so the default picks the largest size that works.
    """
    gpus = max(1, visible_gpu_count())
    entry = get_entry(model)
    n_head = int(entry.spec.get("n_head", 0)) if entry is not None and entry.spec else 0
    if n_head <= 0:
        return gpus
    return max(size for size in range(1, gpus + 1) if n_head % size == 0)


def _default_served_name(model: str) -> str:
    if model.startswith(HUB_PREFIX):
        model = model.removeprefix(HUB_PREFIX)
    return Path(model).stem if model.endswith(".gguf") else model


def vllm_model_source(model: str, *, pull: bool = True) -> str:
    """What vLLM gets as its model: a local path or a Hugging Face repo id.

    A catalogue name becomes its verified GGUF file, pulled first when ``pull``; with
    ``pull=False`` a model not pulled yet shows the path it will have (for dry runs).
    An existing local file or directory is used as it is, ``OWNER/REPO`` and
    ``hf://OWNER/REPO`` pass through for vLLM to download, and ``hf://OWNER/REPO/FILE.gguf`` is
    fetched by the store. Anything else raises :class:`~edgecloud.errors.ModelNotFoundError`.
    """
    if model.startswith(HUB_PREFIX):
        repo = model.removeprefix(HUB_PREFIX).strip("/")
        return repo if _HF_REPO_ID.match(repo) else str(resolve_model(model))
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if not path.exists() and _HF_REPO_ID.match(model) and not model.endswith(".gguf"):
        return model
    if get_entry(model) is not None and not pull:
        target = model_file(model)
        return str(resolve_model(model, pull=False, progress=False)) if target.is_file() else str(target)
    return str(resolve_model(model, pull=pull))


def vllm_command(settings: VLLMSettings, *, pull: bool = True) -> list[str]:
    """The ``vllm serve`` argv equivalent to ``settings``.

    ``pull`` is passed to :func:`vllm_model_source`. Raises
    :class:`~edgecloud.errors.InvalidRequestError` for FP8 on a GGUF file (see the module
    docstring), and the store's errors for a model that cannot be found.
    """
    source = vllm_model_source(settings.model, pull=pull)
    if settings.quant == "fp8" and source.endswith(".gguf"):
        raise InvalidRequestError(
            f"vLLM serves {source} in its own GGUF quantization and ignores --quantization fp8; "
            "for FP8 pass the original Hugging Face checkpoint as the model "
            "(for example Qwen/Qwen2.5-Coder-1.5B-Instruct), or pick quant bf16/fp32/auto for the GGUF file",
            param="quant",
        )
    tp = settings.tensor_parallel_size or _default_tensor_parallel_size(settings.model)
    argv = ["vllm", "serve", source, *QUANT_FLAGS[settings.quant]]
    argv += ["--tensor-parallel-size", str(tp)]
    argv += ["--enable-prefix-caching" if settings.prefix_caching else "--no-enable-prefix-caching"]
    if settings.max_batch is not None:
        argv += ["--max-num-seqs", str(settings.max_batch)]
    if settings.ctx is not None:
        argv += ["--max-model-len", str(settings.ctx)]
    if settings.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
    if settings.tokenizer is not None:
        argv += ["--tokenizer", settings.tokenizer]
    argv += ["--served-model-name", settings.served_model_name or _default_served_name(settings.model)]
    argv += ["--host", settings.host, "--port", str(settings.port)]
    if settings.api_key:
        argv += ["--api-key", settings.api_key]
    return argv + list(settings.extra_args)


def format_command(argv: Sequence[str]) -> str:
    """``argv`` as a shell line, with the ``--api-key`` value replaced by ``***``."""
    shown = list(argv)
    for i, arg in enumerate(shown[:-1]):
        if arg == "--api-key":
            shown[i + 1] = _REDACTED
    return shlex.join(shown)


def _vllm_executable() -> str | None:
    """The ``vllm`` script next to this interpreter first (same venv), else the one on PATH."""
    beside = Path(sys.executable).with_name("vllm")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("vllm")


def _vllm_importable() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def vllm_available() -> bool:
    """True when a ``vllm`` executable or an importable ``vllm`` package is present."""
    return _vllm_executable() is not None or _vllm_importable()


def _runnable(argv: list[str]) -> list[str]:
    """``argv`` with ``vllm serve MODEL`` made concrete for what is installed."""
    executable = _vllm_executable()
    if executable is not None:
        return [executable, *argv[1:]]
    # The module entry point takes the model as --model rather than positionally.
    return [sys.executable, "-m", API_SERVER_MODULE, "--model", argv[2], *argv[3:]]


def launch_vllm(settings: VLLMSettings, *, dry_run: bool = False) -> int:
    """Run vLLM's OpenAI server for ``settings`` until it exits; return its exit status.

    SIGINT and SIGTERM received here are forwarded to vLLM (started in its own session so a
    terminal's Ctrl-C reaches it once, through us) and the wait continues until it has shut
    down. A vLLM killed by signal N returns ``128 + N``, as a shell reports it.
    ``dry_run`` prints the command and returns 0 without starting anything (or pulling a
    model). Raises :class:`~edgecloud.errors.BackendUnavailableError` when vLLM is not
    installed, with the install command and the command that would have run.
    """
    if settings.max_queue is not None:
        print(
            f"edgecloud: note: vLLM has no waiting-queue limit; max_queue={settings.max_queue} is ignored",
            file=sys.stderr,
        )
    available = vllm_available()
    if dry_run or not available:
        argv = vllm_command(settings, pull=False)
        shown = format_command(_runnable(argv) if available else argv)
        if dry_run:
            print(shown)
            return 0
        raise BackendUnavailableError(
            f"vLLM is not installed in this environment ({sys.executable}); {INSTALL_HINT}. "
            f"The command would have been:\n  {shown}"
        )
    argv = _runnable(vllm_command(settings, pull=True))
    print(f"edgecloud: starting {format_command(argv)}", file=sys.stderr)
    try:
        child = subprocess.Popen(argv, start_new_session=True)
    except OSError as exc:
        raise BackendUnavailableError(f"could not start vLLM ({exc.strerror}); {INSTALL_HINT}") from exc

    def forward(signum: int, frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    # Python lets only the main thread install signal handlers; elsewhere the caller owns them.
    in_main_thread = threading.current_thread() is threading.main_thread()
    signals = (signal.SIGINT, signal.SIGTERM) if in_main_thread else ()
    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        returncode = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - returncode if returncode < 0 else returncode
