"""The CPU matmul path for batched decoding: fused projections and oneDNN-prepacked linear layers.

This module owns :class:`PackedLinear`, :func:`pack_linears` and :func:`fused_linear` (what
:func:`~edgecloud.engine.model.fuse_projections` builds each block's fused projections with).

Why: a continuous-batching decode step multiplies every weight by a handful of rows (one
per running sequence). PyTorch's default CPU path hands ``F.linear`` to MKL's sgemm, which
is tuned for large M; measured here it spends several times longer per row at M = 2..8
than at M = 1, which wipes out what batching should win. oneDNN's ``_linear_pointwise``
over a weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
what ``torch.compile``'s freezing pass does for CPU inference) keeps small-M cost close to
the cost of reading the weight once: the batch shares one pass over memory.
``benchmarks/cloud_engine.py`` measures both paths.

float32 weights are packed everywhere oneDNN runs; bfloat16 weights where the CPU computes in
bfloat16 (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512 BF16, AMX, or AVX-NE-CONVERT),
where the packed bf16 matmul reads half the bytes of fp32 and runs on the CPU's bf16 dot
products (measured on this project's AVX-512 BF16 CPU: all the 0.5B model's linears at 8 rows
in 54 ms packed, 87 ms with ``F.linear``, 127 ms in packed fp32). FP8 layers have their own
path (:mod:`edgecloud.engine.fp8`). The packed weight is an opaque oneDNN tensor;
:meth:`PackedLinear.dense_weight` gives it back as an ordinary tensor for anything that needs
to read it.

:func:`fuse_projections` concatenates each block's q/k/v and gate/up weights so a decode step
runs three matmuls per block instead of six: fewer passes over the activations and fewer
small-op dispatches, which on a CPU step of a few milliseconds per layer is measurable.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

__all__ = ["PackedLinear", "pack_linears", "packing_supported"]

logger = logging.getLogger("edgecloud.engine")

#: Batch size the packed layout is tuned for (the scheduler's typical running batch).
PACK_BATCH_HINT = 8


def packing_supported(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build (and, for bfloat16, this CPU) can prepack ``dtype`` linear weights with oneDNN."""
    if not (torch.backends.mkldnn.is_available() and torch._C._dispatch_has_kernel("mkldnn::_reorder_linear_weight")
            and torch._C._dispatch_has_kernel("mkldnn::_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


#: Weight dtypes :class:`PackedLinear` takes.
PACKABLE = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """``nn.Linear`` (float32 or bfloat16, CPU) whose weight is stored in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = PACK_BATCH_HINT) -> None:
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype not in PACKABLE or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear needs a float32 or bfloat16 CPU weight, got {weight.dtype} on {weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.inference_mode(False), torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)
        # A buffer, not a Parameter: the opaque tensor has no strides for autograd or state dicts.
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self._nbytes = weight.numel() * weight.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the weight (the packed layout holds the same values)."""
        return self._nbytes

    def dense_weight(self) -> Tensor:
        """The weight ``[out, in]`` as an ordinary tensor (its own dtype)."""
        return self.packed_weight.to_dense()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn"


def pack_linears(model: nn.Module, *, batch_hint: int = PACK_BATCH_HINT) -> list[str]:
    """Replace every packable CPU ``nn.Linear`` of ``model`` in place by a :class:`PackedLinear`.

    Returns the names of the layers packed (none when oneDNN packing is unavailable for the
    model's dtype, or the model is not on the CPU). A layer whose weight is shared with another
    module (a tied lm_head) gets its own packed copy; the sharer keeps the original.
    """
    names = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module.weight.dtype in PACKABLE and module.weight.device.type == "cpu"
        and packing_supported(module.weight.dtype)
    ]
    if not names:
        logger.info("oneDNN weight packing is not available for this model here; using the default matmul path")
        return []
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(model.get_submodule(name), batch_hint))
    return names


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the concatenation of ``parts``' outputs (same input)."""
    weight = torch.cat([p.weight.detach() for p in parts])
    with_bias = any(p.bias is not None for p in parts)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=with_bias, device="meta", dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if with_bias:
        bias = torch.cat([p.bias.detach() if p.bias is not None else torch.zeros(p.out_features, dtype=weight.dtype)
                          for p in parts])
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused
