"""The memory-budget planner: will this model, at this context, fit this device?

This module owns :class:`MemoryPlan` and :func:`plan`, plus :func:`model_spec` (a spec from a
local GGUF file, or from the catalogue entry's ``spec`` when the file is not on disk), and
:func:`plan_onnx`, the same prediction for an ONNX Runtime export (see its docstring). The
plan is a prediction of the process's resident memory once llama.cpp has loaded the model and
filled the context, and :meth:`MemoryPlan.llama_kwargs` is the exact llama.cpp configuration
the prediction assumes; the llama.cpp backend passes it unchanged.

The model (calibrated against llama-cpp-python's peak RSS, see
``benchmarks/memory_accuracy.py``)::

    total    = weights + kv + compute + overhead
    weights  = all tensor bytes (use_mmap=False: read into anonymous memory, so resident
               exactly once; with mmap, llama.cpp's CPU repacking would touch both the file
               pages and the repacked copy)
    kv       = n_layer * kv_cells * n_head_kv * (head_dim_k * bytes(type_k) + head_dim_v * bytes(type_v))
               kv_cells = n_ctx rounded up to 256 (llama.cpp pads the cache)
    compute  = the part of llama.cpp's compute buffer a full ubatch really touches:
               n_ubatch * 4 * (c_embd * n_embd + c_ff * n_ff + n_head * min(kv_cells, c_kq))
               + the n_vocab * 4 logits row
    overhead = process baseline (Python, numpy, llama.cpp libraries) + vocabulary tables
               (grows with n_vocab) + llama-cpp-python's per-context arrays

Flash attention is always on: it keeps the CPU compute buffer independent of the KQ matrix
and it is what lets llama.cpp quantize the V cache (q8_0 / q4_0).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError, ModelNotFoundError
from .device import DeviceProfile, get_device
from ..store.onnx_manifest import GENAI_CONFIG, load_manifest
from ..runtime.gguf import GGML_TYPE_SIZES, ModelSpec, read_gguf_spec

__all__ = [
    "ModelSpec",
    "MemoryPlan",
    "KV_CACHE_TYPES",
    "DEFAULT_MAX_CONTEXT",
    "plan",
    "plan_memory",
    "with_kv_tiers",
    "plan_onnx",
    "model_spec",
    "read_gguf_spec",
    "kv_cache_bytes",
    "kv_cells",
]

MiB = 1024**2
GiB = 1024**3

#: ctx=None plans at most this many tokens even when more would fit: beyond 8k, prefill on
#: an edge CPU takes minutes, and chat/code-completion prompts rarely need more.
DEFAULT_MAX_CONTEXT = 8192
#: The smallest context a plan will offer; below this a chat turn does not fit.
MIN_CONTEXT = 512
#: llama.cpp rounds the KV cache up to this many cells.
CTX_PAD = 256
#: Prompt tokens per forward pass (llama.cpp's default n_batch = n_ubatch = 512).
N_BATCH = 512

#: Cache type name -> ggml type id (what llama_cpp.Llama(type_k=..., type_v=...) takes).
KV_CACHE_TYPES: dict[str, int] = {"f16": 1, "q8_0": 8, "q4_0": 2}
_KV_PREFERENCE = ("f16", "q8_0", "q4_0")

# Calibrated on llama-cpp-python 0.3.36 (x86-64, CPU) through the SDK's own LlamaCppBackend (what an app
# runs, imports included); see benchmarks/memory_accuracy.py.
_BASELINE_BYTES = 85 * MiB  # python + numpy + the SDK's own imports (pydantic, jinja2, httpx...) + libllama/libggml
_PER_VOCAB_BYTES = 300  # llama.cpp vocab tables + llama-cpp-python token caches, per token
_C_EMBD = 6.0  # live n_embd-wide f32 activations per token at the compute peak
_C_FF = 2.0  # live n_ff-wide f32 activations per token (gate/up) at the compute peak
_C_KQ = 256  # flash attention works on K/V tiles of at most this many cells per head
_GPU_RUNTIME_BYTES = {"cuda": 400 * MiB, "metal": 64 * MiB}


def _type_bytes(ggml_type: int) -> float:
    _, block, size = GGML_TYPE_SIZES[ggml_type]
    return size / block


def kv_cells(n_ctx: int) -> int:
    """KV cache cells llama.cpp allocates for ``n_ctx`` (rounded up to a multiple of 256)."""
    return -(-n_ctx // CTX_PAD) * CTX_PAD


def kv_cache_bytes(spec: ModelSpec, n_ctx: int, kv_cache_type: str = "f16", *, n_layers: int | None = None) -> int:
    """Bytes of the K and V caches for ``n_ctx`` tokens (all layers unless ``n_layers``)."""
    t = _KV_TYPE(kv_cache_type)
    per_cell = spec.n_head_kv * (spec.head_dim_k + spec.head_dim_v) * _type_bytes(KV_CACHE_TYPES[t])
    layers = spec.n_layer if n_layers is None else n_layers
    return int(layers * kv_cells(n_ctx) * per_cell)


def _KV_TYPE(name: str) -> str:
    if name not in KV_CACHE_TYPES:
        raise InvalidRequestError(
            f"unknown kv_cache_type {name!r}; use one of {', '.join(KV_CACHE_TYPES)}", param="kv_cache_type"
        )
    return name


def _compute_bytes(spec: ModelSpec, n_ctx: int) -> int:
    """Resident part of llama.cpp's CPU compute buffer while a full ubatch is evaluated."""
    n_ubatch = min(N_BATCH, n_ctx)
    per_token = _C_EMBD * spec.n_embd + _C_FF * spec.n_ff + spec.n_head * min(kv_cells(n_ctx), _C_KQ)
    return int(n_ubatch * 4 * per_token + spec.n_vocab * 4)


def _overhead_bytes(spec: ModelSpec, n_ctx: int) -> int:
    """Process baseline + vocabulary tables + llama-cpp-python's per-context arrays."""
    python_arrays = n_ctx * 4 + spec.n_vocab * 12  # input_ids, the sampler's candidates array
    return int(_BASELINE_BYTES + _PER_VOCAB_BYTES * spec.n_vocab + python_arrays)


@dataclass(frozen=True)
class _Estimate:
    n_ctx: int
    kv_cache_type: str
    weights: int
    kv: int
    compute: int
    overhead: int
    gpu_layers: int
    gpu_bytes: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.overhead


def _estimate(spec: ModelSpec, device: DeviceProfile, n_ctx: int, kv_type: str) -> _Estimate:
    weights = spec.weights_bytes
    kv = kv_cache_bytes(spec, n_ctx, kv_type)
    compute = _compute_bytes(spec, n_ctx)
    overhead = _overhead_bytes(spec, n_ctx)
    gpu_layers, gpu_used = 0, 0
    if device.has_gpu:
        gpu_layers, gpu_used = _gpu_split(spec, device, n_ctx, kv_type, compute)
        overhead += _GPU_RUNTIME_BYTES.get(device.gpu_backend or "", 0)
    return _Estimate(n_ctx, kv_type, weights, kv, compute, overhead, gpu_layers, gpu_used)


def _gpu_split(spec: ModelSpec, device: DeviceProfile, n_ctx: int, kv_type: str, compute: int) -> tuple[int, int]:
    """(layers offloaded, GPU bytes they use): the most layers whose weights + KV fit the GPU share.

    The GPU also holds a compute buffer like the CPU one, and the output layer once every
    block is offloaded (llama.cpp's n_gpu_layers = n_layer + 1 convention is not used: the
    output layer follows the last block).
    """
    per_layer = spec.layer_bytes + kv_cache_bytes(spec, n_ctx, kv_type, n_layers=1)
    room = device.gpu_bytes - compute
    if room <= 0:
        return 0, 0
    layers = min(spec.n_layer, int(room // max(per_layer, 1)))
    used = layers * per_layer + (compute if layers else 0)
    if layers == spec.n_layer and used + spec.output_bytes <= device.gpu_bytes:
        used += spec.output_bytes
    elif layers == spec.n_layer:
        layers -= 1
        used -= per_layer
    return layers, used


def _fits(est: _Estimate, device: DeviceProfile) -> bool:
    if device.has_gpu and not device.unified_memory:
        # discrete GPU: the offloaded part lives in VRAM, the rest in host RAM
        return est.total <= device.budget_bytes and est.gpu_bytes <= device.gpu_bytes
    return est.total <= device.budget_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """A predicted memory footprint and the llama.cpp settings that make it come true."""

    fits: bool
    reason: str
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    overhead_bytes: int
    total_bytes: int
    budget_bytes: int
    max_context: int
    n_ctx: int
    kv_cache_type: str
    flash_attn: bool
    gpu_layers: int
    model: str
    device: str
    n_batch: int = N_BATCH
    cpu_threads: int = 4
    model_path: str | None = None
    #: The tiers of saved KV states (:func:`with_kv_tiers`): RAM, kept apart from ``total_bytes``
    #: (its states are evicted to fit), and disk, with the free space where it lives.
    ram_tier_bytes: int = 0
    disk_tier_bytes: int = 0
    disk_free_bytes: int | None = None
    spec: ModelSpec | None = field(default=None, repr=False, compare=False)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token of context takes (what a saved state costs per token)."""
        return self.kv_bytes // max(1, self.n_ctx)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of the plan (without the spec)."""
        data = asdict(self)
        data.pop("spec")
        data["n_ubatch"] = min(self.n_batch, self.n_ctx)
        return data

    def llama_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``llama_cpp.Llama(model_path=..., **kwargs)`` matching this plan.

        ``logits_all`` stays False: with it llama-cpp-python keeps an n_ctx x n_vocab float32
        score matrix (5 GiB for a 151k-vocab model at 8k context) that no plan budgets for.
        """
        n_ubatch = min(self.n_batch, self.n_ctx)
        kv_type = KV_CACHE_TYPES[self.kv_cache_type]
        return {
            "n_ctx": self.n_ctx,
            "n_batch": n_ubatch,
            "n_ubatch": n_ubatch,
            "type_k": kv_type,
            "type_v": kv_type,
            "flash_attn": self.flash_attn,
            "n_gpu_layers": self.gpu_layers,
            "use_mmap": False,
            "use_mlock": False,
            "logits_all": False,
            "offload_kqv": True,
            "n_threads": self.cpu_threads,
        }


def with_kv_tiers(plan: MemoryPlan, ram_bytes: int, disk_bytes: int, disk_dir: str | os.PathLike[str] | None) -> MemoryPlan:
    """``plan`` with the RAM and disk tiers of saved KV states counted (``edgecloud plan`` shows
    them: how many tokens of conversation each holds, and whether the disk has the room)."""
    free = None
    if disk_dir is not None and disk_bytes > 0:
        folder = Path(disk_dir).expanduser()
        probe = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if probe is not None:
            free = shutil.disk_usage(probe).free
    return replace(plan, ram_tier_bytes=ram_bytes, disk_tier_bytes=disk_bytes, disk_free_bytes=free)


def model_spec(name_or_path: str | os.PathLike[str] | ModelSpec) -> ModelSpec:
    """The spec of a local GGUF file, a pulled catalogue model, or a catalogue entry's ``spec``.

    A catalogue model that is not on disk is planned from its ``spec`` block, so models that
    cannot be fetched here (3B hub-only entries) can still be planned.
    """
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    from .. import store

    if store.is_local_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(f"no model file at {path}")
        return read_gguf_spec(path)
    name = str(name_or_path)
    entry = store.require_entry(name)
    path = store.model_file(name)
    if path.is_file():
        spec = read_gguf_spec(path)
        return ModelSpec.from_dict({**spec.to_dict(), "path": str(path)}, name=name)
    if not entry.spec:
        raise ModelNotFoundError(
            f"model {name!r} is not pulled and its catalogue entry has no spec; "
            f"run `edgecloud models pull {name}` first"
        )
    return ModelSpec.from_dict({"file_bytes": entry.size_bytes, **entry.spec}, name=name)


def _check_ctx(ctx: Any) -> int | None:
    if ctx is None:
        return None
    if isinstance(ctx, bool) or not isinstance(ctx, int):
        raise InvalidRequestError(f"ctx must be a positive integer number of tokens, got {ctx!r}", param="ctx")
    if ctx <= 0:
        raise InvalidRequestError(f"ctx must be a positive number of tokens, got {ctx}", param="ctx")
    return ctx


def _max_context(spec: ModelSpec, device: DeviceProfile, kv_type: str, limit: int) -> int:
    """Largest context (a multiple of 256, or ``limit``) that fits; 0 if not even MIN_CONTEXT fits."""
    return _largest_fitting(lambda n_ctx: _fits(_estimate(spec, device, n_ctx, kv_type), device), limit)


def _largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
    """Largest context (a multiple of 256, or ``limit``) for which ``fits``; 0 below MIN_CONTEXT."""
    if fits(limit):
        return limit
    lo, hi = 0, limit // CTX_PAD  # in units of CTX_PAD
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * CTX_PAD):
            lo = mid
        else:
            hi = mid - 1
    best = lo * CTX_PAD
    return best if best >= MIN_CONTEXT else 0


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def plan(
    model: str | os.PathLike[str] | ModelSpec,
    device: str | DeviceProfile = "this",
    ctx: int | None = None,
    *,
    kv_cache_type: str | None = None,
) -> MemoryPlan:
    """Plan ``model`` on ``device`` at ``ctx`` tokens (None: the largest context that fits).

    Never raises because something does not fit: the plan says ``fits=False`` and its
    ``reason`` says what to change. Raises InvalidRequestError for a bad ``ctx`` /
    ``kv_cache_type`` / device name, ModelNotFoundError / ModelIntegrityError for a model that
    cannot be read.
    """
    ctx = _check_ctx(ctx)
    if kv_cache_type is not None:
        _KV_TYPE(kv_cache_type)
    spec = model_spec(model)
    dev = get_device(device)
    train = spec.n_ctx_train or DEFAULT_MAX_CONTEXT
    desired = ctx if ctx is not None else min(train, DEFAULT_MAX_CONTEXT)
    types = (kv_cache_type,) if kv_cache_type else _KV_PREFERENCE
    maxima = {t: _max_context(spec, dev, t, train) for t in types}

    chosen = next((t for t in types if maxima[t] >= desired), None)
    reasons: list[str] = []
    if ctx is not None and ctx > train:
        chosen = chosen or types[0]
        n_ctx, fits = ctx, False
        reasons.append(f"ctx {ctx} exceeds the {train} tokens {spec.name} was trained for; use ctx <= {train}")
    elif chosen is not None:
        n_ctx, fits = desired, True
        why = f"{desired}-token context"
        if chosen != types[0]:
            reasons.append(f"{why} fits with a {chosen} KV cache ({types[0]} would need more than the budget)")
        else:
            reasons.append(f"{why} fits with a {chosen} KV cache")
    elif ctx is None and any(maxima.values()):
        # nothing reaches the desired context: take the cache type that gives the most context
        chosen = max(types, key=lambda t: (maxima[t], -types.index(t)))
        n_ctx, fits = maxima[chosen], True
        reasons.append(f"largest context that fits is {n_ctx} tokens with a {chosen} KV cache")
    else:
        chosen = types[-1]
        n_ctx, fits = desired if ctx is not None else MIN_CONTEXT, False
    est = _estimate(spec, dev, n_ctx, chosen)
    if not fits and not reasons:
        reasons.append(_advice(spec, dev, est, ctx, maxima))
    elif fits:
        reasons.append(f"{_gib(est.total)} of the {_gib(dev.budget_bytes)} budget on {dev.name}")
    return MemoryPlan(
        fits=fits,
        reason="; ".join(reasons),
        weights_bytes=est.weights,
        kv_bytes=est.kv,
        compute_bytes=est.compute,
        overhead_bytes=est.overhead,
        total_bytes=est.total,
        budget_bytes=dev.budget_bytes,
        max_context=maxima[chosen],
        n_ctx=n_ctx,
        kv_cache_type=chosen,
        flash_attn=True,
        gpu_layers=est.gpu_layers,
        model=spec.name,
        device=dev.name,
        cpu_threads=dev.cpu_threads,
        model_path=spec.path,
        spec=spec,
    )


plan_memory = plan


def _advice(spec: ModelSpec, dev: DeviceProfile, est: _Estimate, ctx: int | None, maxima: dict[str, int]) -> str:
    """What to change when nothing fits."""
    base = f"{spec.name} needs {_gib(est.total)} at {est.n_ctx} tokens but {dev.name} allows {_gib(dev.budget_bytes)}"
    best = max(maxima.values())
    if best:
        t = max(maxima, key=lambda k: maxima[k])
        return f"{base}; use ctx <= {best} (with kv_cache_type={t}), a smaller model, or a bigger device"
    floor = _estimate(spec, dev, MIN_CONTEXT, "q4_0").total
    if spec.weights_bytes >= dev.budget_bytes:
        return f"{base}; the weights alone ({_gib(spec.weights_bytes)}) exceed the budget: use a smaller model or a bigger device"
    return f"{base}; even {MIN_CONTEXT} tokens need {_gib(floor)}: use a smaller model or a bigger device"


# ---------------------------------------------------------------------- ONNX Runtime exports

# Calibrated on onnxruntime 1.32 + onnxruntime-genai 0.18 (x86-64, CPU) against the peak RSS of
# the INT4 exports of SmolLM2-135M and Qwen2.5-Coder-0.5B (``edgecloud export onnx``) at 130 to
# 3000-token prompts with a 4096-token cache: the prediction is within 5% of both.
_ORT_BASELINE_BYTES = 174 * MiB  # python + onnxruntime + onnxruntime-genai + the tokenizer tables
_ORT_WEIGHTS_FACTOR = 1.32  # resident bytes per byte of model.onnx.data: MatMulNBits prepacks its blocks
_ORT_C_ACT = 16  # live hidden-size-wide float32 activations per prompt token at the compute peak
_ORT_KV_BYTES = 4  # the CPU export's KV cache is its io dtype, float32


@dataclass(frozen=True)
class _OnnxModel:
    """What the planner reads from an export folder (genai_config.json + the weights file)."""

    name: str
    path: str
    n_layer: int
    n_embd: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    context_length: int
    data_bytes: int

    def kv_bytes(self, n_ctx: int) -> int:
        # onnxruntime-genai allocates the whole cache up front (past_present_share_buffer)
        return self.n_layer * n_ctx * self.n_head_kv * self.head_dim * 2 * _ORT_KV_BYTES

    def compute_bytes(self, n_ctx: int) -> int:
        chunk = min(N_BATCH, n_ctx)  # the backend prefills N_BATCH tokens at a time
        return int(chunk * 4 * _ORT_C_ACT * self.n_embd + self.n_vocab * 4)


def _onnx_model(folder: str | os.PathLike[str]) -> _OnnxModel:
    import json


    manifest = load_manifest(folder)  # ModelNotFoundError for a folder that is not an export
    path = Path(folder).expanduser()
    config = json.loads((path / GENAI_CONFIG).read_text(encoding="utf-8"))["model"]
    decoder = config["decoder"]
    data = sum(p.stat().st_size for p in path.iterdir() if p.name.endswith((".onnx", ".onnx.data")))
    return _OnnxModel(
        name=manifest.model,
        path=str(path),
        n_layer=int(decoder["num_hidden_layers"]),
        n_embd=int(decoder["hidden_size"]),
        n_head_kv=int(decoder["num_key_value_heads"]),
        head_dim=int(decoder["head_size"]),
        n_vocab=int(config["vocab_size"]),
        context_length=int(config.get("context_length") or manifest.context_length),
        data_bytes=data,
    )


def plan_onnx(
    folder: str | os.PathLike[str], device: str | DeviceProfile = "this", ctx: int | None = None
) -> MemoryPlan:
    """Plan an ``edgecloud export onnx`` folder run by onnxruntime-genai on ``device``'s CPU.

    The same shape as :func:`plan` (``total = weights + kv + compute + overhead``, the largest
    context that fits when ``ctx`` is None, at most :data:`DEFAULT_MAX_CONTEXT`) with
    onnxruntime's numbers: resident weights are the ONNX weight file plus MatMulNBits'
    prepacked copies, the KV cache is float32 and allocated for the whole context at once,
    and there is no GPU share (the export is for the CPU). ``kv_cache_type`` is ``"f32"``.
    """
    ctx = _check_ctx(ctx)
    model = _onnx_model(folder)
    dev = get_device(device)
    weights = int(model.data_bytes * _ORT_WEIGHTS_FACTOR)

    def total(n_ctx: int) -> int:
        return weights + model.kv_bytes(n_ctx) + model.compute_bytes(n_ctx) + _ORT_BASELINE_BYTES

    limit = model.context_length
    largest = _largest_fitting(lambda n_ctx: total(n_ctx) <= dev.budget_bytes, limit)
    desired = ctx if ctx is not None else min(limit, DEFAULT_MAX_CONTEXT)
    if ctx is not None and ctx > limit:
        n_ctx, fits = ctx, False
        reason = f"ctx {ctx} exceeds the {limit} tokens {model.name} was built for; use ctx <= {limit}"
    elif largest >= desired:
        n_ctx, fits = desired, True
        reason = f"{desired}-token context fits; {_gib(total(desired))} of the {_gib(dev.budget_bytes)} budget on {dev.name}"
    elif ctx is None and largest:
        n_ctx, fits = largest, True
        reason = f"largest context that fits is {largest} tokens; {_gib(total(largest))} of the {_gib(dev.budget_bytes)} budget"
    else:
        n_ctx, fits = desired, False
        advice = f"use ctx <= {largest}" if largest else "use a smaller model or a bigger device"
        reason = f"{model.name} needs {_gib(total(n_ctx))} at {n_ctx} tokens but {dev.name} allows {_gib(dev.budget_bytes)}; {advice}"
    return MemoryPlan(
        fits=fits,
        reason=reason,
        weights_bytes=weights,
        kv_bytes=model.kv_bytes(n_ctx),
        compute_bytes=model.compute_bytes(n_ctx),
        overhead_bytes=_ORT_BASELINE_BYTES,
        total_bytes=total(n_ctx),
        budget_bytes=dev.budget_bytes,
        max_context=largest,
        n_ctx=n_ctx,
        kv_cache_type="f32",
        flash_attn=False,
        gpu_layers=0,
        model=model.name,
        device=dev.name,
        cpu_threads=dev.cpu_threads,
        model_path=model.path,
    )
