"""FP8 never by surprise: the start-up self-check the torch engine runs before serving FP8 weights.

This module owns :func:`fp8_self_check`. ``edgecloud serve --quant auto`` on a GPU that
multiplies in FP8 loads the model in bf16, teacher-forces a few passages of the packaged
``eval`` sample through it, converts the same model's block linears to FP8 in place and runs
the passages again. FP8 is kept only when it is within the budget of ``edgecloud quant
compare`` (top-1 agreement with bf16 at least 0.97, mean NLL of the real next tokens at most
1 % higher); otherwise the engine reloads bf16 and says why in its log. ``--quant fp8`` skips
the check: asking for FP8 by name is a decision, ``auto`` is not.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..engine.fp8 import convert_to_fp8
from ..quant.compare import chunk_texts, drift, log_probs
from ..quant.sample import load_sample

__all__ = ["FP8Check", "fp8_self_check"]

logger = logging.getLogger("edgecloud.server")

#: The budget of ``edgecloud quant compare`` (its defaults).
MIN_TOP1 = 0.97
MAX_NLL_INCREASE_PCT = 1.0


@dataclass(frozen=True)
class FP8Check:
    """What the self-check measured, and whether FP8 may serve."""

    passed: bool
    top1_agreement: float
    nll_delta_pct: float
    positions: int
    seconds: float

    def describe(self) -> str:
        """One log line."""
        verdict = "within" if self.passed else "outside"
        return (f"FP8 vs bf16 on {self.positions} teacher-forced tokens: top-1 agreement {self.top1_agreement:.3f}, "
                f"NLL {self.nll_delta_pct:+.2f} % ({verdict} the budget; {self.seconds:.1f} s)")


def fp8_self_check(
    model: Any,
    tokenizer: Any,
    *,
    keep: tuple[str, ...] = (),
    tokens: int = 384,
    min_top1: float | None = None,
    max_nll_increase_pct: float | None = None,
) -> FP8Check:
    """Measure ``model`` (a bf16 :class:`~edgecloud.engine.Transformer`) against itself converted
    to FP8 (``keep``: linears left in bf16) within the budget (default :data:`MIN_TOP1`,
    :data:`MAX_NLL_INCREASE_PCT`). The model is left converted to FP8 either way; the caller
    reloads bf16 when ``passed`` is False."""
    min_top1 = MIN_TOP1 if min_top1 is None else min_top1
    max_nll_increase_pct = MAX_NLL_INCREASE_PCT if max_nll_increase_pct is None else max_nll_increase_pct
    started = time.perf_counter()
    chunks = chunk_texts(tokenizer, load_sample("eval"), tokens, chunk_tokens=128)
    reference = log_probs(model, chunks)
    convert_to_fp8(model, keep=keep)
    measured = drift(reference, model, chunks)
    check = FP8Check(
        passed=measured["top1_agreement"] >= min_top1 and measured["nll_delta_pct"] <= max_nll_increase_pct,
        top1_agreement=float(measured["top1_agreement"]),
        nll_delta_pct=float(measured["nll_delta_pct"]),
        positions=int(measured["positions"]),
        seconds=time.perf_counter() - started,
    )
    logger.info(check.describe())
    return check
