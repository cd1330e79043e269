"""Precision tools: lower-precision weight formats for the torch engine, and how much they cost.

:mod:`edgecloud.engine.fp8` owns FP8 (E4M3) weights with per-output-channel scales:
:func:`quantize_fp8_per_channel`, the drop-in :class:`FP8Linear` and the model handler
:func:`convert_to_fp8`. :mod:`edgecloud.quant.compare` measures a quantized model against
fp32 on real text (:func:`compare_precision`), finds the layers that drift most and records
which to keep in high precision (:class:`QuantConfig`). :mod:`edgecloud.quant.sample` ships
the text it measures on (:func:`load_sample`). Needs torch (``pip install 'edgecloud[cloud]'``).
"""

from __future__ import annotations

from .compare import (
    QUANT_CONFIG_FORMAT,
    QuantConfig,
    compare_precision,
    load_quant_config,
    save_quant_config,
)
from ..engine.fp8 import (
    ALWAYS_KEPT,
    FP8_MAX,
    SCALE_SEARCH_STEPS,
    FP8Linear,
    FP8Report,
    convert_to_fp8,
    convertible_layers,
    quantize_fp8_per_channel,
    scaled_mm_supported,
)
from .sample import SAMPLE_SPLITS, load_sample

__all__ = [
    "ALWAYS_KEPT",
    "FP8_MAX",
    "QUANT_CONFIG_FORMAT",
    "SAMPLE_SPLITS",
    "SCALE_SEARCH_STEPS",
    "FP8Linear",
    "FP8Report",
    "QuantConfig",
    "compare_precision",
    "convert_to_fp8",
    "convertible_layers",
    "load_quant_config",
    "load_sample",
    "quantize_fp8_per_channel",
    "save_quant_config",
    "scaled_mm_supported",
]
