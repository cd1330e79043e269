"""How far a lower-precision model drifts from fp32, which layers cause it, and which to keep.

This module owns :func:`compare_precision`: it teacher-forces real text (by default the sample
that ships with the package, :func:`~edgecloud.quant.load_sample`) through a model in fp32 and
with its block linears quantized, and reports top-1 agreement, the change in mean NLL of the
real next tokens and the mean KL(fp32 || quantized). It measures each linear's sensitivity
(the KL when only that layer is quantized) and, with ``protect="auto"``, keeps in high
precision the layers that buy the most accuracy per byte, within a byte budget. The choice is
made on the ``calibration`` split and judged on the ``eval`` split, never on the same text.

It also owns the file that records the choice: :class:`QuantConfig` (format
``edgecloud-quant/1``), written by :func:`save_quant_config` and read by
:func:`load_quant_config`; ``Transformer.from_gguf(path, precision="fp8",
fp8_skip=config.keep_high_precision)`` applies it.

The building blocks are public for benchmarks: :func:`chunk_texts`, :func:`log_probs` and
:func:`drift`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from torch import Tensor, nn

from ..engine import Tokenizer, Transformer
from ..errors import ConfigError, InvalidRequestError
from ..engine.fp8 import FP8Linear, convertible_layers
from .sample import load_sample

__all__ = [
    "PROTECT_MODES",
    "QUANTIZERS",
    "QUANT_CONFIG_FORMAT",
    "QuantConfig",
    "chunk_texts",
    "compare_precision",
    "drift",
    "load_quant_config",
    "log_probs",
    "save_quant_config",
]

logger = logging.getLogger("edgecloud.quant")

QUANT_CONFIG_FORMAT = "edgecloud-quant/1"
#: Per format: the drop-in replacement of one high-precision ``nn.Linear``.
QUANTIZERS: dict[str, Callable[[nn.Linear], nn.Module]] = {"fp8": FP8Linear.from_linear}
#: ``compare_precision(protect=...)``: choose layers to keep (``"auto"``) or quantize them all (``"none"``).
PROTECT_MODES = ("auto", "none")
#: Bytes per element of a high-precision tensor as deployed (bfloat16), whatever dtype it was measured in.
_HIGH_PRECISION_BYTES = 2

#: One teacher-forced passage: the text it came from and its token ids.
Chunk = tuple[str, list[int]]


class QuantConfig(BaseModel):
    """Which linears to keep in high precision when quantizing a model, and what that measured."""

    model_config = ConfigDict(extra="forbid")

    format: str = QUANT_CONFIG_FORMAT
    quant: str = "fp8"
    #: Qualified module names (``blk.3.ffn_down``) that stay in the activation dtype.
    keep_high_precision: list[str] = Field(default_factory=list)
    #: File name of the model the choice was measured on.
    model: str | None = None
    #: The figures :func:`compare_precision` measured with this choice (top1_agreement, ...).
    measured: dict[str, float] = Field(default_factory=dict)

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value != QUANT_CONFIG_FORMAT:
            raise ValueError(f"unsupported format {value!r}; this version reads {QUANT_CONFIG_FORMAT!r}")
        return value

    @field_validator("quant")
    @classmethod
    def _known_quant(cls, value: str) -> str:
        if value not in QUANTIZERS:
            raise ValueError(f"unknown quant {value!r}; allowed: {', '.join(QUANTIZERS)}")
        return value

    @classmethod
    def from_comparison(cls, result: Mapping[str, Any]) -> QuantConfig:
        """The config that records a :func:`compare_precision` result's choice."""
        measured = {k: float(result[k]) for k in ("top1_agreement", "nll_delta_pct", "kl_mean", "weight_bytes_ratio")}
        return cls(quant=result["quant"], keep_high_precision=list(result["protected"]), model=result["model"], measured=measured)


def save_quant_config(config: QuantConfig | Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``config`` (or the config of a :func:`compare_precision` result) as JSON; returns the path."""
    if not isinstance(config, QuantConfig):
        config = QuantConfig.from_comparison(config)
    path = Path(path)
    path.write_text(json.dumps(config.model_dump(), indent=2) + "\n", encoding="utf-8")
    return path


def load_quant_config(path: str | os.PathLike[str]) -> QuantConfig:
    """Read a quantization config; a missing, malformed or unknown-format file is a :class:`ConfigError`."""
    try:
        return QuantConfig.model_validate_json(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValidationError) as exc:
        raise ConfigError(f"cannot read quantization config {path}: {exc}") from exc


def chunk_texts(tokenizer: Any, texts: Mapping[str, str], tokens: int, chunk_tokens: int = 512) -> list[Chunk]:
    """The first ``tokens // len(texts)`` tokens of each text, in passages of at most ``chunk_tokens``.

    ``tokenizer`` is an :class:`~edgecloud.engine.Tokenizer` (anything with
    ``encode(text) -> list[int]``). Each passage is scored with its own fresh context.
    """
    if not texts:
        raise InvalidRequestError("no texts to compare on", param="texts")
    per_text = tokens // len(texts)
    if per_text < 2:
        raise InvalidRequestError(f"{tokens} tokens over {len(texts)} texts leaves fewer than 2 each", param="tokens")
    chunks = []
    for name, text in texts.items():
        ids = tokenizer.encode(text)[:per_text]
        chunks += [(name, ids[i : i + chunk_tokens]) for i in range(0, len(ids), chunk_tokens)]
    return [(name, ids) for name, ids in chunks if len(ids) >= 2]


@torch.inference_mode()
def log_probs(model: nn.Module, chunks: Sequence[Chunk]) -> list[Tensor]:
    """Next-token log-probabilities ``[len - 1, vocab]`` (float32) of each chunk, teacher-forced."""
    out = []
    for _, ids in chunks:
        logits = model(torch.tensor(ids), None, model.new_cache(len(ids)))
        out.append(torch.log_softmax(logits[:-1].float(), dim=-1))
    return out


@torch.inference_mode()
def drift(reference: Sequence[Tensor], model: nn.Module, chunks: Sequence[Chunk]) -> dict[str, Any]:
    """``model`` against ``reference`` (:func:`log_probs` of the fp32 model) on the same chunks.

    ``top1_agreement``: share of positions where both pick the same next token;
    ``kl_mean``: mean KL(reference || model) in nats; ``nll_delta_pct``: change of the mean
    negative log-likelihood of the real next tokens, in percent of the reference's. The same
    figures per text are under ``per_text``.
    """
    sums: dict[str, dict[str, float]] = {}
    for ref, (name, ids) in zip(reference, chunks):
        other = log_probs(model, [(name, ids)])[0]
        _accumulate(sums.setdefault(name, {}), ref, other, torch.tensor(ids[1:], device=ref.device))
    total: dict[str, float] = {}
    for entry in sums.values():
        for key, value in entry.items():
            total[key] = total.get(key, 0.0) + value
    return {**_summary(total), "per_text": {name: _summary(entry) for name, entry in sums.items()}}


def _accumulate(sums: dict[str, float], reference: Tensor, other: Tensor, targets: Tensor) -> None:
    for key, value in (
        ("positions", targets.numel()),
        ("agree", (reference.argmax(-1) == other.argmax(-1)).sum()),
        ("kl", (reference.exp() * (reference - other)).sum()),
        ("nll_ref", -reference.gather(1, targets[:, None]).sum()),
        ("nll", -other.gather(1, targets[:, None]).sum()),
    ):
        sums[key] = sums.get(key, 0.0) + float(value)


def _summary(sums: Mapping[str, float]) -> dict[str, Any]:
    n = sums["positions"]
    return {
        "positions": int(n),
        "top1_agreement": sums["agree"] / n,
        "kl_mean": sums["kl"] / n,
        "nll_fp32": sums["nll_ref"] / n,
        "nll": sums["nll"] / n,
        "nll_delta_pct": (sums["nll"] / sums["nll_ref"] - 1) * 100,
    }


def compare_precision(
    model_path: str | os.PathLike[str],
    quant: str = "fp8",
    texts: Mapping[str, str] | None = None,
    *,
    tokens: int = 2000,
    protect: str | Sequence[str] = "auto",
    candidates: Sequence[str] | None = None,
    min_top1: float = 0.97,
    max_nll_increase: float = 0.01,
    max_bytes_ratio: float = 0.55,
    calibration_texts: Mapping[str, str] | None = None,
    calibration_tokens: int = 256,
    chunk_tokens: int = 512,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Teacher-forced drift of ``quant`` against fp32 for one GGUF model, and which layers to keep.

    ``texts`` (default: the packaged ``eval`` sample) are scored on ``tokens`` tokens in all.
    ``protect``: ``"none"`` quantizes every block linear; ``"auto"`` measures each linear's
    sensitivity (mean KL with only that layer quantized) on ``calibration_tokens`` tokens of
    ``calibration_texts`` (default: the packaged ``calibration`` sample) and keeps in high
    precision the layers with the most KL per extra byte, as many as fit in
    ``max_bytes_ratio`` (the block linears' bytes over their bf16 bytes); a list of names
    keeps exactly those. ``candidates`` limits the measurement and the choice to those
    linears (default: every block linear); each costs one forward over the calibration
    tokens. ``meets_targets`` says whether the result reaches ``min_top1`` and
    ``max_nll_increase`` (a fraction: 0.01 is 1%) within ``max_bytes_ratio``.

    Returns ``top1_agreement``, ``nll_delta_pct``, ``kl_mean`` and ``weight_bytes_ratio`` of
    the chosen model, the same for the all-quantized model under ``unprotected`` (and on the
    calibration texts under ``calibration``), the kept layers under ``protected``, each
    measured layer's sensitivity under ``layers`` (most sensitive first), and
    ``meets_targets``. Bytes count high-precision tensors as bfloat16, as deployed; the
    measurement itself runs in float32 on ``device``.
    """
    if quant not in QUANTIZERS:
        raise InvalidRequestError(f"unknown quant {quant!r}; allowed: {', '.join(QUANTIZERS)}", param="quant")
    if isinstance(protect, str) and protect not in PROTECT_MODES:
        raise InvalidRequestError(
            f"protect must be {' or '.join(map(repr, PROTECT_MODES))} or a list of layer names, got {protect!r}",
            param="protect",
        )
    started = time.perf_counter()
    path = Path(model_path)
    tokenizer = Tokenizer(path)
    try:
        chunks = chunk_texts(tokenizer, load_sample("eval") if texts is None else texts, tokens, chunk_tokens)
        calibration = None
        if protect == "auto":
            calibration_texts = load_sample("calibration") if calibration_texts is None else calibration_texts
            calibration = chunk_texts(tokenizer, calibration_texts, calibration_tokens, chunk_tokens)
    finally:
        tokenizer.close()

    model = Transformer.from_gguf(path, precision="fp32", device=device)
    names = convertible_layers(model)
    if not names:
        raise InvalidRequestError(f"{path.name} has no linear layers to quantize", param="model_path")
    for param, given in (("protect", protect), ("candidates", candidates)):
        unknown = [] if given is None or isinstance(given, str) else sorted(set(given) - set(names))
        if unknown:
            raise InvalidRequestError(f"not a quantizable layer of {path.name}: {', '.join(unknown)}", param=param)
    with torch.no_grad():
        quantized = {name: QUANTIZERS[quant](model.get_submodule(name)) for name in names}
    high_bytes = {name: _deployed_bytes(model.get_submodule(name)) for name in names}
    low_bytes = {name: _deployed_bytes(module) for name, module in quantized.items()}
    budget = max_bytes_ratio * sum(high_bytes.values()) - sum(low_bytes.values())
    logger.info("%s: %d linears quantized in %.0f s", path.name, len(names), time.perf_counter() - started)

    reference = log_probs(model, chunks)
    with _swapped(model, quantized):
        unprotected = drift(reference, model, chunks)
    logger.info("%s: all %s: top-1 %.4f, KL %.5f", path.name, quant, unprotected["top1_agreement"], unprotected["kl_mean"])

    layers: list[dict[str, Any]] = []
    calibration_drift: dict[str, Any] | None = None
    if calibration is not None:
        measured = names if candidates is None else [name for name in names if name in set(candidates)]
        sensitivity, calibration_drift = _measure_sensitivity(model, calibration, quantized, measured)
        kept = set(_most_kl_per_byte(sensitivity, high_bytes, low_bytes, budget))
        chosen = [name for name in names if name in kept]
        layers = [
            {
                "name": name,
                "kl": kl,
                "extra_bytes": high_bytes[name] - low_bytes[name],
                "protected": name in chosen,
            }
            for name, kl in sorted(sensitivity.items(), key=lambda item: -item[1])
        ]
    else:
        chosen = [] if protect == "none" else [name for name in names if name in set(protect)]

    final = unprotected
    if chosen:
        with _swapped(model, {name: module for name, module in quantized.items() if name not in chosen}):
            final = drift(reference, model, chunks)

    def ratio(keep: Sequence[str]) -> float:
        return sum(high_bytes[n] if n in keep else low_bytes[n] for n in names) / sum(high_bytes.values())

    result: dict[str, Any] = {
        "model": path.name,
        "quant": quant,
        "positions": final["positions"],
        "texts": {name: sum(len(ids) for n, ids in chunks if n == name) for name in dict(chunks)},
        "nll_fp32": final["nll_fp32"],
        "top1_agreement": final["top1_agreement"],
        "nll_delta_pct": final["nll_delta_pct"],
        "kl_mean": final["kl_mean"],
        "weight_bytes_ratio": ratio(chosen),
        "protected": chosen,
        "unprotected": {
            "top1_agreement": unprotected["top1_agreement"],
            "nll_delta_pct": unprotected["nll_delta_pct"],
            "kl_mean": unprotected["kl_mean"],
            "weight_bytes_ratio": ratio(()),
        },
        "layers": layers,
        "calibration": None if calibration_drift is None else {
            k: calibration_drift[k] for k in ("positions", "top1_agreement", "nll_delta_pct", "kl_mean")
        },
        "per_text": final["per_text"],
        "targets": {"min_top1": min_top1, "max_nll_increase": max_nll_increase, "max_bytes_ratio": max_bytes_ratio},
        "seconds": round(time.perf_counter() - started, 1),
    }
    result["meets_targets"] = _meets(final, min_top1, max_nll_increase) and result["weight_bytes_ratio"] <= max_bytes_ratio
    return result


def _meets(measured: Mapping[str, Any], min_top1: float, max_nll_increase: float) -> bool:
    return measured["top1_agreement"] >= min_top1 and measured["nll_delta_pct"] <= max_nll_increase * 100


def _deployed_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters as deployed: FP8 weights and their float32 scales as they are, the rest bf16."""
    if isinstance(module, FP8Linear):
        bias = 0 if module.bias is None else module.bias.numel() * _HIGH_PRECISION_BYTES
        return module.weight.numel() * module.weight.element_size() + module.scale.numel() * 4 + bias
    return sum(p.numel() for p in module.parameters()) * _HIGH_PRECISION_BYTES


def _most_kl_per_byte(
    sensitivity: Mapping[str, float], high_bytes: Mapping[str, int], low_bytes: Mapping[str, int], budget: float
) -> list[str]:
    """Greedy knapsack: layers in order of KL removed per extra byte, each taken if it still fits."""
    chosen = []
    for name in sorted(sensitivity, key=lambda n: -sensitivity[n] / max(1, high_bytes[n] - low_bytes[n])):
        extra = high_bytes[name] - low_bytes[name]
        if sensitivity[name] > 0 and extra <= budget:
            chosen.append(name)
            budget -= extra
    return chosen


@contextlib.contextmanager
def _swapped(model: nn.Module, replacements: Mapping[str, nn.Module]) -> Iterator[None]:
    """``model`` with the named submodules replaced, restored on exit."""
    originals = {name: model.get_submodule(name) for name in replacements}
    _assign(model, replacements)
    try:
        yield
    finally:
        _assign(model, originals)


def _assign(model: nn.Module, modules: Mapping[str, nn.Module]) -> None:
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)


class _Replay(nn.Module):
    """Stands in for a block before the one being measured: returns that block's recorded output.

    Quantizing a layer of block ``b`` cannot change what blocks ``0 .. b-1`` compute, so the
    sensitivity measurement replays their fp32 output instead of recomputing it. A stand-in
    with no recording passes its input through (its output is overwritten by a later one).
    """

    def __init__(self, output: Tensor | None) -> None:
        super().__init__()
        self.output = output

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return x if self.output is None else self.output


@torch.inference_mode()
def _measure_sensitivity(
    model: nn.Module, chunks: Sequence[Chunk], quantized: Mapping[str, nn.Module], measured: Sequence[str]
) -> tuple[dict[str, float], dict[str, Any]]:
    """Per ``measured`` layer, mean KL(fp32 || only that layer quantized) on ``chunks``; and the all-quantized drift there."""
    batch = [torch.tensor(ids) for _, ids in chunks]

    def run() -> list[Tensor]:
        logits = model.forward_batch([(t, None, model.new_cache(len(t))) for t in batch])
        return [torch.log_softmax(x[:-1].float(), dim=-1) for x in logits]

    blocks = list(model.blk)
    recorded: list[Tensor] = []
    hooks = [block.register_forward_hook(lambda _m, _i, out: recorded.append(out)) for block in blocks]
    try:
        reference = run()
    finally:
        for hook in hooks:
            hook.remove()

    def replaying(first_block: int) -> contextlib.AbstractContextManager[None]:
        stand_ins = {f"blk.{j}": _Replay(recorded[j] if j == first_block - 1 else None) for j in range(first_block)}
        return _swapped(model, stand_ins)

    # The replay relies on each block taking the hidden state first and returning the next one;
    # check it reproduces the reference before trusting it, else recompute every block.
    middle = len(blocks) // 2
    with replaying(middle):
        replay_ok = len(recorded) == len(blocks) and all(
            torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(run(), reference)
        )
    if not replay_ok:
        logger.warning("block replay does not reproduce the model's output; measuring sensitivity with full forwards")

    def kl(other: Sequence[Tensor]) -> float:
        total = sum(float((r.exp() * (r - o)).sum()) for r, o in zip(reference, other))
        return total / sum(r.shape[0] for r in reference)

    sensitivity = {}
    started = time.perf_counter()
    for i, name in enumerate(measured):
        parts = name.split(".")
        first_block = int(parts[1]) if replay_ok and parts[0] == "blk" and parts[1].isdigit() else 0
        with _swapped(model, {name: quantized[name]}), replaying(first_block):
            sensitivity[name] = kl(run())
        if i % 20 == 19:
            logger.info("sensitivity: %d/%d layers, %.0f s", i + 1, len(measured), time.perf_counter() - started)

    with _swapped(model, quantized):
        sums: dict[str, float] = {}
        for ref, other, (_, ids) in zip(reference, run(), chunks):
            _accumulate(sums, ref, other, torch.tensor(ids[1:], device=ref.device))
    return sensitivity, _summary(sums)
