"""Core ML export: a GGUF model as a stateful INT4 ``.mlpackage`` for iOS 18 / macOS 15.

This module owns the contract between the exported package and the host that runs it
(:class:`~edgecloud.edge.coreml.CoreMLBackend`), and the steps that build it:

- :class:`StatefulDecoder`: the torch engine's :class:`~edgecloud.engine.Transformer`
  rewritten for tracing. Its KV cache is two registered float16 buffers
  ``k_cache`` / ``v_cache`` of shape ``[n_layer, 1, n_head_kv, context, head_dim]``, written in
  place with slice assignment, which coremltools turns into Core ML *states*
  (``ct.StateType``). Inputs are ``input_ids [1, n]`` (int32) and ``causal_mask [1, 1, n, end]``
  (float16, 0 = attend, -inf = masked; :func:`causal_mask` builds it); both ``n`` and ``end``
  are flexible (``ct.RangeDim(1, context)``), so one model does prefill and decode. The new
  tokens occupy cache slots ``end - n .. end - 1``: their positions come from the shapes, no
  position input. The output ``logits [1, 1, vocab]`` is the last position's only: a chat
  never needs the others, and on a 150k vocabulary the lm_head over a whole prompt would cost
  a quarter of the prefill. Grouped-query attention folds the query heads that share a KV
  head into that head's query rows, so no step copies the cache once per query head.
- :func:`export_coreml`: load (dequantize the GGUF), trace, convert to an ``mlprogram``
  (float16 compute, ``minimum_deployment_target=iOS18``) whose last pass quantizes every
  linear and the embedding to INT4 per block (``constexpr_blockwise_shift_scale``), save, and add the
  tokenizer: a vocabulary-only copy of the GGUF (its metadata, no tensors; 2-6 MB) stored
  as a package item, which llama.cpp loads with ``vocab_only`` on the Mac exactly as it loads
  the full file here. The package metadata records the source model, context and block size.
- :func:`inspect_mlpackage`: what a saved package declares (inputs, outputs, states,
  metadata, INT4 weight ops, weight payload bytes), read from its spec; works on Linux.

Two numerical choices differ from the engine, and the parity tests hold them to the engine's
logits: llama-family Q/K rows are permuted per head so that one rotate-half (NEOX) rope
serves both families (attention scores are unchanged by a shared permutation of the head
dimension), and the RMS norms divide each row by its largest magnitude before squaring, so
float16 cannot overflow on the massive activations of the first tokens.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import struct
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..engine import GGUFFile, ModelArgs, Transformer
from ..runtime.gguf import read_gguf_header
from ..errors import BackendError, InvalidRequestError, ModelIntegrityError
from ..runtime.coreml_package import (
    FORMAT,
    INPUTS,
    OUTPUTS,
    PACKAGE_AUTHOR,
    STATES,
    TOKENIZER_ITEM,
    causal_mask,
    dir_bytes,
    import_coremltools,
    inspect_mlpackage,
    package_tokenizer,
    quiet_coremltools,
)

__all__ = [
    "FORMAT",
    "INPUTS",
    "INT4_BLOCKS",
    "MIN_CONTEXT",
    "OUTPUTS",
    "STAGES",
    "STATES",
    "CoreMLExport",
    "StatefulDecoder",
    "causal_mask",
    "export_coreml",
    "import_coremltools",
    "inspect_mlpackage",
    "package_tokenizer",
    "trace_decoder",
]

#: Smallest ``context`` an export accepts.
MIN_CONTEXT = 16
#: Block sizes (weights per INT4 scale, along the input dimension) an export accepts.
INT4_BLOCKS = (16, 32, 64, 128, 256, 512)
#: Export stages in order, with what the progress display says during each.
STAGES: dict[str, str] = {
    "load": "dequantizing the GGUF weights",
    "trace": "tracing the stateful decoder",
    "convert": "converting to a Core ML mlprogram (float16, INT4 weights per block)",
    "save": "saving the .mlpackage",
}
#: coremltools' graph pass behind ``ct.optimize.coreml.linear_quantize_weights``.
_QUANTIZE_PASS = "compression::linear_quantize_weights"
#: Rows whose largest magnitude is below this are not scaled up further by the stable RMS norm.
_PEAK_FLOOR = 1e-2

ProgressCallback = Callable[[str], None]


@dataclass(frozen=True)
class CoreMLExport:
    """What :func:`export_coreml` built: where, how big, how long, and the model's interface."""

    path: Path
    model: str
    size_bytes: int
    seconds: float
    context: int
    int4_block: int
    inputs: list[str] = field(default_factory=lambda: list(INPUTS))
    outputs: list[str] = field(default_factory=lambda: list(OUTPUTS))
    states: list[str] = field(default_factory=lambda: list(STATES))
    #: Seconds per stage of :data:`STAGES`.
    stage_seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the path as a string)."""
        return {**asdict(self), "path": str(self.path)}


# ---------------------------------------------------------------------------- the traced module


def _neox_order(args: ModelArgs) -> Tensor:
    """Row order that turns llama.cpp's interleaved rope pairs ``(2i, 2i+1)`` into NEOX pairs ``(i, i + n_rot/2)``."""
    n_rot = args.rope_dim
    return torch.cat((torch.arange(0, n_rot, 2), torch.arange(1, n_rot, 2), torch.arange(n_rot, args.head_dim)))


def _rope_ready(linear: nn.Linear, n_heads: int, args: ModelArgs) -> nn.Linear:
    """``linear`` (a Q or K projection) with its output rows in the order NEOX rope expects (a copy when permuted)."""
    if args.rope_style == "neox":
        return linear
    order = _neox_order(args)
    rows = (torch.arange(n_heads)[:, None] * args.head_dim + order[None, :]).flatten()
    permuted = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    with torch.no_grad():
        permuted.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
        if linear.bias is not None:
            permuted.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    return permuted


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rope on ``x[1, H, n, D]`` with ``cos``/``sin`` ``[n, n_rot/2]`` (dims past ``n_rot`` pass through)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if x.shape[-1] == 2 * half:
        return rotated
    return torch.cat((rotated, x[..., 2 * half :]), dim=-1)


class _StableRMSNorm(nn.Module):
    """The engine's RMS norm, computed on the row divided by its largest magnitude.

    ``x * rsqrt(mean(x^2) + eps)`` equals ``y * rsqrt(mean(y^2) + eps / p^2)`` for ``y = x / p``;
    with ``p`` the row's peak, ``y^2 <= 1`` cannot overflow float16 where ``x^2`` would.
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.root_eps = math.sqrt(norm.eps)

    def forward(self, x: Tensor) -> Tensor:
        peak = x.abs().amax(-1, keepdim=True).clamp(min=_PEAK_FLOOR)
        y = x / peak
        scale = torch.rsqrt(y.square().mean(-1, keepdim=True) + (self.root_eps / peak).square())
        return y * scale * self.weight.to(x.dtype)


class _Layer(nn.Module):
    """One engine :class:`~edgecloud.engine.model.Block`, attending over the state buffers."""

    def __init__(self, block: nn.Module, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.attn_norm = _StableRMSNorm(block.attn_norm)
        self.attn_q = _rope_ready(block.attn_q, args.n_head, args)
        self.attn_k = _rope_ready(block.attn_k, args.n_head_kv, args)
        self.attn_v = block.attn_v
        self.attn_output = block.attn_output
        self.ffn_norm = _StableRMSNorm(block.ffn_norm)
        self.ffn_gate, self.ffn_up, self.ffn_down = block.ffn_gate, block.ffn_up, block.ffn_down

    def _heads(self, x: Tensor, n_heads: int) -> Tensor:
        return x.view(1, -1, n_heads, self.args.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, cache: tuple[Tensor, Tensor, int],
                span: tuple[int, int]) -> Tensor:
        a = self.args
        k_cache, v_cache, layer = cache
        begin, end = span
        h = self.attn_norm(x)
        q = _rope(self._heads(self.attn_q(h), a.n_head), *rope)
        k = _rope(self._heads(self.attn_k(h), a.n_head_kv), *rope)
        v = self._heads(self.attn_v(h), a.n_head_kv)
        # In-place slice writes into the buffers: what coremltools converts to state updates.
        k_cache[layer, :, :, begin:end, :] = k.to(k_cache.dtype)
        v_cache[layer, :, :, begin:end, :] = v.to(v_cache.dtype)
        keys = k_cache[layer, :, :, :end, :].to(x.dtype)
        values = v_cache[layer, :, :, :end, :].to(x.dtype)
        # Grouped-query attention without copying the cache per query head: the query heads
        # that share a KV head are contiguous, so they fold into that head's query rows.
        groups = a.n_head // a.n_head_kv
        n = q.shape[2]
        q = q.reshape(1, a.n_head_kv, groups * n, a.head_dim)
        if groups > 1:
            mask = mask.repeat(1, 1, groups, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.to(x.dtype))
        out = out.reshape(1, a.n_head, n, a.head_dim).transpose(1, 2)
        x = x + self.attn_output(out.reshape(1, n, a.n_head * a.head_dim))
        h = self.ffn_norm(x)
        return x + self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h))


class StatefulDecoder(nn.Module):
    """The engine's model with its KV cache as float16 buffers: ``forward(input_ids, causal_mask) -> logits``.

    Shares the weights of ``model`` (only llama-family Q/K projections are permuted copies) and
    leaves ``model`` untouched. ``forward`` writes the new tokens' keys and values into slots
    ``end - n .. end - 1`` of ``k_cache`` / ``v_cache`` and returns the last position's logits
    ``[1, 1, vocab]`` in the model's dtype.
    """

    def __init__(self, model: Transformer, context: int) -> None:
        super().__init__()
        a = model.args
        self.args = a
        self.context = context
        self.token_embd = model.token_embd
        self.layers = nn.ModuleList(_Layer(block, a) for block in model.blk)
        self.output_norm = _StableRMSNorm(model.output_norm)
        self.output = model.output
        shape = (a.n_layer, 1, a.n_head_kv, context, a.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=torch.float16))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=torch.float16))
        # Angles in float64 as the engine computes them; a table instead of in-graph math keeps
        # float16 from rounding position * frequency.
        angles = torch.arange(context, dtype=torch.float64)[:, None] * model.inv_freq.cpu().double()[None, :]
        self.register_buffer("rope_cos", angles.cos().to(model.dtype))
        self.register_buffer("rope_sin", angles.sin().to(model.dtype))

    def reset(self) -> None:
        """Zero the cache. Not needed between sequences (a forward reads only slots it or an earlier
        call of the same sequence wrote); it keeps traced buffers free of example values."""
        self.k_cache.zero_()
        self.v_cache.zero_()

    def forward(self, input_ids: Tensor, causal_mask: Tensor) -> Tensor:
        end = causal_mask.shape[-1]
        begin = end - input_ids.shape[-1]
        rope = (self.rope_cos[begin:end], self.rope_sin[begin:end])
        x = self.token_embd(input_ids)
        for layer, block in enumerate(self.layers):
            x = block(x, rope, causal_mask, (self.k_cache, self.v_cache, layer), (begin, end))
        return self.output(self.output_norm(x[:, -1:, :]))


# ---------------------------------------------------------------------------- checks and helpers


def _check_request(out: Path, force: bool, context: int, int4_block: int) -> None:
    """InvalidRequestError naming the option, for what can be checked without the model."""
    if out.suffix != ".mlpackage":
        raise InvalidRequestError(f"--out must end in .mlpackage (Core ML's package format), got {out}", param="out")
    if out.exists() and not force and not (out.is_dir() and not any(out.iterdir())):
        raise InvalidRequestError(
            f"{out} already exists and is not empty; pass --force to overwrite it, or choose another --out",
            param="out",
        )
    if int4_block not in INT4_BLOCKS:
        raise InvalidRequestError(
            f"--int4-block must be one of {', '.join(map(str, INT4_BLOCKS))}, got {int4_block}", param="int4_block"
        )
    if context < MIN_CONTEXT:
        raise InvalidRequestError(f"--context must be at least {MIN_CONTEXT} tokens, got {context}", param="context")


def _check_fits_model(path: Path, context: int, int4_block: int) -> None:
    """InvalidRequestError naming the option when ``context`` or ``int4_block`` does not fit the model at ``path``."""
    gguf = GGUFFile(path)
    args = ModelArgs.from_gguf(gguf.metadata, {name: t.shape for name, t in gguf.tensors.items()})
    if context > args.context_length:
        raise InvalidRequestError(
            f"--context must be between {MIN_CONTEXT} and this model's context length {args.context_length}, "
            f"got {context}",
            param="context",
        )
    widths = {"n_embd": args.n_embd, "n_ff": args.n_ff, "n_head * head_dim": args.n_head * args.head_dim}
    fitting = [b for b in INT4_BLOCKS if all(w % b == 0 for w in widths.values())]
    if int4_block not in fitting:
        dims = ", ".join(f"{name} {w}" for name, w in widths.items())
        raise InvalidRequestError(
            f"--int4-block {int4_block} does not work for this model: the block must divide every linear's "
            f"input width ({dims}); use one of {', '.join(map(str, fitting))}",
            param="int4_block",
        )


def _write_vocab_gguf(gguf: Path, out: Path) -> None:
    """A copy of ``gguf`` with its metadata (tokenizer, chat template, hyper-parameters) and no tensors.

    The metadata section is copied byte for byte: it runs from byte 24 (after magic, version and
    the two counts) to where the tensor table starts, which is the header's end less the
    table's size (name, dim count, dims, type and offset per tensor).
    """
    header = read_gguf_header(gguf)
    table = sum(8 + len(name.encode("utf-8")) + 4 + 8 * len(dims) + 4 + 8 for name, dims, _, _ in header.tensors)
    with gguf.open("rb") as fh:
        raw = fh.read(header.header_end - table)
    magic, version, _, n_kv = struct.unpack_from("<4sIQQ", raw)
    if magic != b"GGUF":
        raise ModelIntegrityError(f"{gguf} is not a GGUF file")
    body = struct.pack("<4sIQQ", magic, version, 0, n_kv) + raw[24:]
    out.write_bytes(body + b"\0" * (-len(body) % 32))


def export_coreml(
    model: str | Path,
    out: str | Path,
    *,
    context: int = 512,
    int4_block: int = 32,
    force: bool = False,
    on_progress: ProgressCallback | None = None,
) -> CoreMLExport:
    """Build a stateful INT4 ``.mlpackage`` of ``model`` (a catalogue name or ``.gguf`` path) at ``out``.

    ``context`` is the KV cache length (prompt + answer); ``int4_block`` the weights per INT4
    scale. ``out`` must end in ``.mlpackage``; an existing non-empty one is replaced only with
    ``force``. ``on_progress(stage)`` is called as each of :data:`STAGES` starts. Bad options
    raise :class:`~edgecloud.errors.InvalidRequestError` naming them before any weight is
    read; an unknown model :class:`~edgecloud.errors.ModelNotFoundError`.
    """
    from ..store import resolve_model

    out = Path(out).expanduser()
    _check_request(out, force, context, int4_block)
    ct = import_coremltools()
    path = resolve_model(model, pull=True, progress=False)
    _check_fits_model(path, context, int4_block)

    timings: dict[str, float] = {}
    start = time.perf_counter()

    @contextlib.contextmanager
    def stage(name: str) -> Iterator[None]:
        if on_progress is not None:
            on_progress(name)
        began = time.perf_counter()
        yield
        timings[name] = round(time.perf_counter() - began, 2)

    with stage("load"):
        transformer = Transformer.from_gguf(path, dtype=torch.float32)
    with stage("trace"):
        traced = trace_decoder(StatefulDecoder(transformer, context))
    with stage("convert"):
        mlmodel = _convert(ct, traced, transformer.args, context, int4_block)
    del traced, transformer
    with stage("save"):
        _describe(mlmodel, str(model), path, context, int4_block)
        _save(mlmodel, out, path)
    return CoreMLExport(
        path=out, model=str(model), size_bytes=dir_bytes(out), seconds=round(time.perf_counter() - start, 2),
        context=context, int4_block=int4_block, stage_seconds=timings,
    )


def trace_decoder(decoder: StatefulDecoder) -> torch.jit.ScriptModule:
    """The TorchScript graph coremltools converts; it shares ``decoder``'s weights and cache buffers.

    Traced on two new tokens after one cached one, so that no size in the graph is a constant 1;
    the cache is zeroed afterwards. TorchScript rather than ``torch.export``: it is the path
    coremltools documents for stateful models, and ``torch.export`` cannot yet express the
    cache writes at ``end - n`` over the whole range of ``n`` and ``end`` (it guards on
    ``n != context``), so torch's deprecation notice for ``jit.trace`` is silenced here.
    """
    ids = torch.zeros((1, 2), dtype=torch.int32)
    with torch.no_grad(), warnings.catch_warnings():
        # shape arithmetic (begin = end - n) is recorded as size ops; the tracer warns about ints anyway
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", r"`torch\.jit\.trace(_method)?` is deprecated", DeprecationWarning)
        traced = torch.jit.trace(decoder.eval(), (ids, torch.from_numpy(causal_mask(2, 3))), check_trace=False)
    decoder.reset()
    return traced


def _convert(ct: Any, traced: torch.jit.ScriptModule, args: ModelArgs, context: int, int4_block: int) -> Any:
    """Convert to a float16 mlprogram whose linears and embedding are INT4 per block.

    The quantization runs as the last pass of the conversion pipeline instead of through
    ``linear_quantize_weights(mlmodel)``, which would run the whole default pipeline a second
    time on the converted model (most of an export's time on a graph this size) for the same
    result; the rope tables and norms stay float16 because only ``linear`` and ``gather``
    weights are selected.
    """
    query = ct.RangeDim(lower_bound=1, upper_bound=context, default=1)
    end = ct.RangeDim(lower_bound=1, upper_bound=context, default=1)
    cache = (args.n_layer, 1, args.n_head_kv, context, args.head_dim)
    int4 = ct.optimize.coreml.OpLinearQuantizerConfig(
        mode="linear_symmetric", dtype="int4", granularity="per_block", block_size=int4_block
    )
    pipeline = ct.PassPipeline.DEFAULT
    pipeline.append_pass(_QUANTIZE_PASS)
    pipeline.set_options(
        _QUANTIZE_PASS, {"config": ct.optimize.coreml.OptimizationConfig(op_type_configs={"linear": int4, "gather": int4})}
    )
    try:
        with quiet_coremltools(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # coremltools' own deprecation and version notices
            return ct.convert(
                traced,
                inputs=[
                    ct.TensorType(INPUTS[0], shape=(1, query), dtype=np.int32),
                    ct.TensorType(INPUTS[1], shape=(1, 1, query, end), dtype=np.float16),
                ],
                outputs=[ct.TensorType(OUTPUTS[0], dtype=np.float16)],
                states=[ct.StateType(wrapped_type=ct.TensorType(shape=cache, dtype=np.float16), name=s) for s in STATES],
                minimum_deployment_target=ct.target.iOS18,
                compute_precision=ct.precision.FLOAT16,
                convert_to="mlprogram",
                pass_pipeline=pipeline,
                skip_model_load=True,
            )
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
        raise BackendError(f"coremltools could not convert the {args.arch} decoder: {exc}") from exc


def _describe(mlmodel: Any, model: str, gguf: Path, context: int, int4_block: int) -> None:
    mlmodel.author = "edgecloud"
    mlmodel.short_description = (
        f"{model}: stateful decoder, INT4 weights (block {int4_block}), {context}-token KV cache. "
        "Inputs input_ids [1, n] and causal_mask [1, 1, n, end]; output logits of the last position."
    )
    mlmodel.user_defined_metadata.update({
        "edgecloud.format": FORMAT,
        "edgecloud.model": model,
        "edgecloud.gguf": gguf.name,
        "edgecloud.context": str(context),
        "edgecloud.int4_block": str(int4_block),
        "edgecloud.tokenizer": TOKENIZER_ITEM,
    })


def _save(mlmodel: Any, out: Path, gguf: Path) -> None:
    """Write the package next to ``out`` and move it into place, so a failure leaves no half package."""
    from coremltools.libmodelpackage import ModelPackage

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".coreml-", dir=out.parent) as tmp:
            staged, vocab = Path(tmp) / out.name, Path(tmp) / TOKENIZER_ITEM
            with quiet_coremltools():
                mlmodel.save(str(staged))
            _write_vocab_gguf(gguf, vocab)
            ModelPackage(str(staged)).addItem(
                str(vocab), TOKENIZER_ITEM, PACKAGE_AUTHOR, f"vocabulary-only copy of {gguf.name} (llama.cpp tokenizer)"
            )
            if out.is_dir():
                shutil.rmtree(out)
            elif out.exists():
                out.unlink()
            staged.rename(out)
    except OSError as exc:
        raise InvalidRequestError(f"cannot write {out}: {exc.strerror or exc}; choose another --out", param="out") from exc


# ---------------------------------------------------------------------------- inspection


