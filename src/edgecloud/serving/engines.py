"""The serving engines by name: what ``edgecloud serve --engine NAME`` builds or launches.

This module owns :class:`ServeOptions` (every engine option, as the CLI collects them),
:class:`Engine` (one engine: the options it takes besides the common ones, and how it is built:
an in-process backend the HTTP server serves, or an external server it launches) and the
registry :data:`ENGINES`. The CLI looks an engine up here and refuses, by name, an option the
engine does not take; a new engine is one :class:`Engine` entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..backend import Backend
from ..errors import ConfigError
from .batching import DEFAULT_MAX_QUEUE

__all__ = ["DEFAULT_MAX_QUEUE", "ENGINES", "Engine", "ServeOptions"]


@dataclass
class ServeOptions:
    """What ``edgecloud serve`` was asked for (``None``: not given, the engine's default)."""

    model: str
    max_batch: int
    ctx: int | None = None
    quant: str | None = None
    max_queue: int | None = None
    threads: int | None = None
    quant_config: str | None = None
    tensor_parallel_size: int | None = None
    tokenizer: str | None = None
    vllm_args: list[str] = field(default_factory=list)
    vllm_python: str | None = None
    dry_run: bool = False
    draft_model: str | None = None
    spec: str | None = None
    spec_k_max: int = 8
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    #: vllm: GiB of KV offloaded (``--kv-offloading-size``) and where to.
    kv_offload: float | None = None
    kv_offload_backend: str = "native"
    #: vllm: ``prefill=N,decode=M`` instances behind a proxy (None: one instance).
    disaggregate: str | None = None
    #: llamacpp: MiB of dropped slot prefixes kept in RAM, and on disk under ``kv_dir``.
    kv_ram_mib: int = 0
    kv_disk_mib: int = 0
    kv_dir: str | None = None
    #: vllm: load edgecloud's plugin (verified-mode checks from vLLM's prefix cache, in token sessions).
    vllm_plugin: bool = True

    @property
    def spec_mode(self) -> str:
        """The speculation mode: ``--spec``, else ``auto`` with a draft model, else ``off``."""
        return self.spec or ("auto" if self.draft_model else "off")

    @property
    def queue(self) -> int:
        return DEFAULT_MAX_QUEUE if self.max_queue is None else self.max_queue


@dataclass(frozen=True)
class Engine:
    """One serving engine: its name, the CLI options it takes besides the common ones, and either
    ``build`` (a backend the HTTP server serves in this process) or ``launch`` (an external server
    started and watched; returns its exit status)."""

    name: str
    options: frozenset[str]
    build: Callable[[ServeOptions], Backend] | None = None
    launch: Callable[[ServeOptions], int] | None = None

    def refused(self, given: dict[str, bool]) -> list[str]:
        """The options in ``given`` (CLI flag -> whether it was set) this engine does not take."""
        return sorted(name for name, set_ in given.items() if set_ and name not in self.options)


def _llamacpp(o: ServeOptions) -> Backend:
    from .llamacpp_engine import LlamaCppEngineBackend
    from ..runtime.spec_control import SpecConfig

    return LlamaCppEngineBackend(o.model, n_ctx=o.ctx, max_batch=o.max_batch, max_queue=o.queue, threads=o.threads,
                                 speculative=SpecConfig(mode=o.spec_mode, k_max=o.spec_k_max),  # type: ignore[arg-type]
                                 draft_model=o.draft_model, kv_ram_bytes=o.kv_ram_mib * 2**20,
                                 kv_disk_bytes=o.kv_disk_mib * 2**20, kv_dir=o.kv_dir or _default_kv_dir())


def _default_kv_dir() -> str:
    from ..store.cache import home_dir

    return str(home_dir() / "kv")


def _torch(o: ServeOptions) -> Backend:
    from .engine_backend import TorchEngineBackend
    from .engine_choice import choose_precision
    from ..runtime.spec_control import SpecConfig

    quant = o.quant or "auto"
    device, chosen, _ = choose_precision(quant)
    keep: tuple[str, ...] = ()
    if o.quant_config is not None:
        from ..quant.compare import load_quant_config

        keep = tuple(load_quant_config(o.quant_config).keep_high_precision)
        if chosen not in ("fp8", "fp8-checked"):
            raise ConfigError(f"--quant-config applies to fp8 weights; this server runs {chosen}")
    return TorchEngineBackend(
        o.model, precision="auto" if quant == "auto" else chosen, n_ctx=o.ctx, device=device,
        max_batch=o.max_batch, max_queue=o.queue, fp8_skip=keep,
        speculative=SpecConfig(mode=o.spec_mode, k_max=o.spec_k_max),  # type: ignore[arg-type]
        draft_model=o.draft_model,
    )


def _vllm(o: ServeOptions) -> int:
    from .vllm import VLLMSettings
    from .vllm_launch import launch_vllm

    spec = o.spec_mode if o.spec is not None or not o.draft_model else "draft"  # vLLM has no adaptive choice
    settings = VLLMSettings(
        model=o.model, host=o.host, port=o.port, api_key=o.api_key, quant=o.quant or "auto", max_batch=o.max_batch,
        ctx=o.ctx, tensor_parallel_size=o.tensor_parallel_size, served_model_name=o.served_model_name,
        tokenizer=o.tokenizer, threads=o.threads, spec=spec, draft_model=o.draft_model,  # type: ignore[arg-type]
        spec_k_max=o.spec_k_max, extra_args=list(o.vllm_args), kv_offload_gib=o.kv_offload,
        kv_offload_backend=o.kv_offload_backend, checks_plugin=o.vllm_plugin,  # type: ignore[arg-type]
    )
    return launch_vllm(settings, python=o.vllm_python, dry_run=o.dry_run, disaggregate=o.disaggregate)


_SPEC = frozenset({"--draft-model", "--spec", "--spec-k-max"})
#: Every engine by name (``auto`` is chosen among them by :mod:`.engine_choice`).
ENGINES: dict[str, Engine] = {
    "llamacpp": Engine("llamacpp", _SPEC | {"--max-queue", "--threads", "--kv-ram-mib", "--kv-disk-mib", "--kv-dir"},
                       build=_llamacpp),
    "torch": Engine("torch", _SPEC | {"--quant", "--max-queue", "--quant-config"}, build=_torch),
    "vllm": Engine("vllm", _SPEC | {"--quant", "--tensor-parallel-size", "--dry-run", "--tokenizer", "--vllm-arg",
                                    "--vllm-python", "--threads", "--kv-offload", "--kv-offload-backend", "--no-vllm-plugin",
                                    "--disaggregate"},
                   launch=_vllm),
}
