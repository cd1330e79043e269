"""Precision tools: lower-precision weight formats for the torch engine.

:mod:`edgecloud.quant.fp8` owns FP8 (E4M3) weights with per-output-channel scales:
:func:`quantize_fp8_per_channel`, the drop-in :class:`FP8Linear` and the model handler
:func:`convert_to_fp8`. Needs torch (``pip install 'edgecloud[cloud]'``).
"""

from __future__ import annotations

from .fp8 import (
    FP8_MAX,
    FP8Linear,
    FP8Report,
    convert_to_fp8,
    quantize_fp8_per_channel,
    scaled_mm_supported,
)

__all__ = ["FP8_MAX", "FP8Linear", "FP8Report", "convert_to_fp8", "quantize_fp8_per_channel", "scaled_mm_supported"]
