"""The CPU matmul path for batched decoding: oneDNN-prepacked linear layers.

This module owns :class:`PackedLinear` and :func:`pack_linears`.

Why: a continuous-batching decode step multiplies every weight by a handful of rows (one
per running sequence). PyTorch's default CPU path hands ``F.linear`` to MKL's sgemm, which
is tuned for large M; measured here it spends several times longer per row at M = 2..8
than at M = 1, which wipes out what batching should win. oneDNN's ``_linear_pointwise``
over a weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
what ``torch.compile``'s freezing pass does for CPU inference) keeps small-M cost close to
the cost of reading the weight once: the batch shares one pass over memory.
``benchmarks/cloud_engine.py`` measures both paths.

Only float32 weights on the CPU are packed: oneDNN's bfloat16 reorder needs AVX-512 or
AVX-NE-CONVERT, and FP8 layers have their own path (:mod:`edgecloud.engine.fp8`).
The packed weight is an opaque oneDNN tensor; :meth:`PackedLinear.dense_weight` gives it
back as an ordinary tensor for anything that needs to read it.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

__all__ = ["PackedLinear", "pack_linears", "packing_supported"]

logger = logging.getLogger("edgecloud.engine")

#: Batch size the packed layout is tuned for (the scheduler's typical running batch).
PACK_BATCH_HINT = 8


def packing_supported() -> bool:
    """Whether this torch build can prepack float32 linear weights with oneDNN."""
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """``nn.Linear`` (float32, CPU) whose weight is stored in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = PACK_BATCH_HINT) -> None:
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear needs a float32 CPU weight, got {weight.dtype} on {weight.device}")
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
        """The weight ``[out, in]`` as an ordinary float32 tensor."""
        return self.packed_weight.to_dense()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn"


def pack_linears(model: nn.Module, *, batch_hint: int = PACK_BATCH_HINT) -> list[str]:
    """Replace every float32 CPU ``nn.Linear`` of ``model`` in place by a :class:`PackedLinear`.

    Returns the names of the layers packed (none when oneDNN packing is unavailable, or the
    model is not float32 on the CPU). A layer whose weight is shared with another module (a
    tied lm_head) gets its own packed copy; the sharer keeps the original.
    """
    if not packing_supported():
        logger.info("oneDNN weight packing is not available in this torch build; using the default matmul path")
        return []
    names = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"
    ]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(model.get_submodule(name), batch_hint))
    return names
