"""FP8 (E4M3) weights with one scale per output channel, as a drop-in for ``nn.Linear``.

This module owns the weight format (:func:`quantize_fp8_per_channel`, which picks each output
channel's scale by a small search for the least round-trip error), the layer
(:class:`FP8Linear`) and the handler that converts a model in place (:func:`convert_to_fp8`,
which leaves embeddings and the lm_head in high precision, and any layer named in ``keep``).

Two execution paths, chosen per call by the device the layer lives on:

* CUDA with compute capability >= 8.9 (Ada, Hopper and later): the matmul runs in FP8 with
  ``torch._scaled_mm``. Activations are quantized on the fly to E4M3 with one scale per token
  (row), the weight scale is per output channel ("row-wise" scaling: ``scale_a [M, 1]``,
  ``scale_b [1, N]``, both float32), and the output is bfloat16, which is what cuBLASLt's
  row-wise kernels produce. ``_scaled_mm`` wants K and N multiples of 16; other shapes fall
  back to the path below.
* Everywhere else, quantize-dequantize: the E4M3 weight is upcast (exactly) to the activation
  dtype, multiplied, and the output columns scaled. The weight numerics are exactly FP8's,
  so this path validates accuracy; it is not faster than the high-precision model, and it
  says so once through the ``edgecloud.quant`` logger.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InvalidRequestError

__all__ = [
    "ALWAYS_KEPT",
    "FP8_MAX",
    "SCALE_SEARCH_STEPS",
    "FP8Linear",
    "FP8Report",
    "convert_to_fp8",
    "convertible_layers",
    "quantize_fp8_per_channel",
    "scaled_mm_supported",
]

logger = logging.getLogger("edgecloud.quant")

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite E4M3 value (448); with plain amax scaling a row's largest magnitude maps onto it.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: Scales never go below this, so an all-zero row (or token) quantizes to zeros, not NaN.
_MIN_SCALE = 1e-12
#: Scales :func:`quantize_fp8_per_channel` tries per output channel, spaced evenly in log2 over one octave.
SCALE_SEARCH_STEPS = 8
#: Elements per slice of rows in the scale search: large enough that a CPU's threads are not
#: mostly waiting on each other at every op, small enough to bound the temporaries (16 MB).
_SEARCH_SLICE = 1 << 22
#: Modules :func:`convert_to_fp8` never converts: the token embeddings and the lm_head.
ALWAYS_KEPT: tuple[str, ...] = ("token_embd", "output")

#: Reasons already logged (each path is announced once per process, not once per layer call).
_announced: set[str] = set()


def _announce(reason: str, message: str) -> None:
    if reason not in _announced:
        _announced.add(reason)
        logger.warning(message)


def quantize_fp8_per_channel(weight: Tensor, *, search_steps: int = SCALE_SEARCH_STEPS) -> tuple[Tensor, Tensor]:
    """E4M3 weight ``[out, in]`` and float32 scales ``[out, 1]`` with ``weight ~= w_fp8 * scale``.

    Each row's scale is, of ``amax / 448 * 2**(k / search_steps)`` for ``k = 0 .. search_steps - 1``,
    the one whose round trip has the least squared error; ``search_steps=1`` is plain amax
    scaling (the row's largest magnitude lands on :data:`FP8_MAX`, 448). Why search: E4M3's
    grid is relative (3 mantissa bits per octave), so sliding the scale within one octave
    slides the grid along the row's values, and some positions fit them better. Weights
    dequantized from a GGUF k-quant take few distinct values per row; on
    Qwen2.5-Coder-0.5B Q4_K_M, 8 steps remove 10-20% of each layer's squared error and about
    30% of the model's teacher-forced KL against fp32 (more steps measured no better).
    Smaller scales than amax / 448 would clip the largest weight (never better in
    measurements) and scales an octave up repeat the same grid, so one octave covers every
    choice. A row of zeros gets a tiny positive scale and stays zeros.
    """
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    if search_steps < 1:
        raise ValueError(f"search_steps must be >= 1, got {search_steps}")
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    if search_steps > 1:
        scale = _search_scales(w, scale, search_steps)
    w_fp8 = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_fp8, scale


def _search_scales(w: Tensor, amax_scale: Tensor, steps: int) -> Tensor:
    """Per row, ``amax_scale * 2**(k / steps)`` with the least round-trip squared error (ties: smallest k)."""
    best_scale = amax_scale.clone()
    rows_per_slice = max(1, _SEARCH_SLICE // w.shape[1])
    for start in range(0, w.shape[0], rows_per_slice):
        rows = slice(start, start + rows_per_slice)
        unit = w[rows] / amax_scale[rows]  # each row's amax at 448
        best_error = torch.full_like(amax_scale[rows], float("inf"))
        best_factor = torch.ones_like(best_error)
        for k in range(steps):
            factor = 2.0 ** (k / steps)
            x = unit * (1.0 / factor)
            # Error in units of amax_scale**2, comparable across k within a row.
            error = _e4m3_round(x).sub_(x).square_().sum(dim=1, keepdim=True).mul_(factor * factor)
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_factor = torch.where(better, factor, best_factor)
        best_scale[rows] = amax_scale[rows] * best_factor
    return best_scale


def _e4m3_round(x: Tensor) -> Tensor:
    """``x`` (float32, ``|x| <= 448``) rounded to 3 mantissa bits: E4M3's grid for normal values.

    Integer ops on the float32 bits, several times faster on a CPU than a cast to float8 and
    back. Ties round away from zero instead of to even: the same distance, so the same error.
    Below E4M3's smallest normal (2**-6) the true grid is coarser; those values are below
    1/28672 of the row's largest and their error does not move the search.
    """
    # float32 keeps 23 mantissa bits, E4M3 the top 3: add half of the 20 dropped bits, drop them.
    return (x.view(torch.int32) + 0x80000).bitwise_and_(~0xFFFFF).view(torch.float32)


def _quantize_fp8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Activations ``[M, K]`` as E4M3 with one float32 scale per row ``[M, 1]`` (dynamic, per call)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def scaled_mm_supported(device: torch.device | str) -> bool:
    """Whether FP8 matmuls run natively on ``device`` (CUDA, compute capability >= 8.9)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class FP8Linear(nn.Module):
    """``nn.Linear`` with an E4M3 weight ``[out, in]`` and a float32 scale per output channel.

    The weight and scale are frozen parameters (so ``param_bytes`` and ``.to(device)`` see
    them); the optional bias stays in its original dtype.
    """

    def __init__(self, weight_fp8: Tensor, scale: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        if weight_fp8.dtype != FP8_DTYPE:
            raise ValueError(f"weight must be {FP8_DTYPE}, got {weight_fp8.dtype}")
        if scale.shape != (weight_fp8.shape[0], 1):
            raise ValueError(f"scale must be [{weight_fp8.shape[0]}, 1], got {tuple(scale.shape)}")
        self.out_features, self.in_features = weight_fp8.shape
        self.weight = nn.Parameter(weight_fp8, requires_grad=False)
        self.scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, search_steps: int = SCALE_SEARCH_STEPS) -> FP8Linear:
        """Quantize ``linear``'s weight per output channel (:func:`quantize_fp8_per_channel`); its bias is kept as is."""
        w_fp8, scale = quantize_fp8_per_channel(linear.weight, search_steps=search_steps)
        return cls(w_fp8, scale, linear.bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``weight * scale`` in ``dtype``: the high-precision weight this layer stands for."""
        return (self.weight.float() * self.scale).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda and scaled_mm_supported(x.device):
            if self.in_features % 16 == 0 and self.out_features % 16 == 0:
                return self._forward_scaled_mm(x)
            _announce(
                "shape",
                f"FP8 layer {self.out_features}x{self.in_features} is not a multiple of 16; "
                "it runs as quantize-dequantize",
            )
        else:
            _announce(
                "qdq",
                f"FP8 runs as quantize-dequantize on {x.device.type} (exact FP8 weight numerics, "
                "no FP8 speed-up); native FP8 matmuls need CUDA with compute capability >= 8.9",
            )
        return self._forward_dequantized(x)

    def _forward_dequantized(self, x: Tensor) -> Tensor:
        # E4M3 -> float32/bfloat16 is exact; scaling the output columns instead of the weight
        # saves a pass over the weight and keeps its values exactly FP8's.
        y = F.linear(x, self.weight.to(x.dtype)) * self.scale.view(-1).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _forward_scaled_mm(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        x_fp8, scale_a = _quantize_fp8_per_token(rows)
        y = torch._scaled_mm(
            x_fp8,
            self.weight.t(),  # [in, out] column-major view of the row-major weight, as cuBLASLt wants
            scale_a=scale_a,
            scale_b=self.scale.view(1, -1),
            out_dtype=torch.bfloat16,
        )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8=e4m3"


@dataclass
class FP8Report:
    """What :func:`convert_to_fp8` did: which layers, and their weight bytes before and after."""

    converted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    @property
    def ratio(self) -> float:
        """``bytes_after / bytes_before`` of the converted layers (0 when none were converted)."""
        return self.bytes_after / self.bytes_before if self.bytes_before else 0.0


def _tensor_bytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _is_skipped(name: str, skip: Sequence[str]) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)


def convertible_layers(model: nn.Module, skip: Sequence[str] = ALWAYS_KEPT) -> list[str]:
    """Qualified names of the ``nn.Linear`` modules :func:`convert_to_fp8` would convert, in model order."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and not _is_skipped(name, skip)]


@torch.no_grad()
def convert_to_fp8(
    model: nn.Module,
    skip: Sequence[str] = ALWAYS_KEPT,
    *,
    keep: Sequence[str] = (),
    search_steps: int = SCALE_SEARCH_STEPS,
) -> FP8Report:
    """Replace every ``nn.Linear`` of ``model`` in place by an :class:`FP8Linear`, except ``skip`` and ``keep``.

    ``skip`` names modules by their qualified name or its last part (``"output"`` is the
    lm_head, not ``blk.N.attn_output``). Embeddings are not ``nn.Linear`` and always stay.
    ``keep`` names further linears to leave in high precision, such as a quantization
    config's ``keep_high_precision`` (:mod:`edgecloud.quant.compare`); each entry must match
    a linear of ``model``, so a config written for another model fails here instead of
    silently quantizing everything.
    """
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    unknown = [k for k in keep if not any(_is_skipped(name, (k,)) for name in linears)]
    if unknown:
        example = f" (names look like {linears[-2]!r})" if len(linears) > 1 else ""
        raise InvalidRequestError(
            f"no linear layer named {', '.join(map(repr, unknown))} to keep in high precision{example}", param="keep"
        )
    report = FP8Report()
    # Names, not modules: each high-precision weight is freed as soon as its layer is replaced.
    for name in linears:
        if _is_skipped(name, skip) or _is_skipped(name, keep):
            report.skipped.append(name)
            continue
        linear = model.get_submodule(name)
        fp8 = FP8Linear.from_linear(linear, search_steps=search_steps)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, fp8)
        report.converted.append(name)
        report.bytes_before += _tensor_bytes(linear.weight, linear.bias)
        report.bytes_after += _tensor_bytes(fp8.weight, fp8.scale, fp8.bias)
    return report
