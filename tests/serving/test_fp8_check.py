"""FP8 never by surprise: the start-up self-check measures FP8 against bf16 on real text and the
torch engine serves FP8 only when it passes; ``--quant auto`` on this CPU resolves to what the
CPU computes in, with the reason said."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from edgecloud.serving import engine_choice, fp8_check
from edgecloud.serving.engine_backend import TorchEngineBackend
from edgecloud.serving.fp8_check import fp8_self_check
from edgecloud.engine import Tokenizer, Transformer
from edgecloud.engine.fp8 import FP8Linear
from edgecloud.runtime.hardware import cpu_has_bf16
from edgecloud.types import ChatRequest


def test_the_self_check_measures_fp8_against_bf16_and_converts(smollm2_path: Path) -> None:
    model = Transformer.from_gguf(smollm2_path, precision="bf16")
    tokenizer = Tokenizer(smollm2_path)
    try:
        check = fp8_self_check(model, tokenizer, tokens=192)
    finally:
        tokenizer.close()
    assert 0.5 < check.top1_agreement <= 1.0 and check.positions > 100
    assert check.passed == (check.top1_agreement >= 0.97 and check.nll_delta_pct <= 1.0)
    assert any(isinstance(m, FP8Linear) for m in model.modules())
    assert "top-1 agreement" in check.describe()


def _forced_fp8_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: this CPU stands in for a GPU that multiplies in FP8 (the check itself runs for real)."""
    monkeypatch.setattr(engine_choice, "choose_precision", lambda requested: ("cpu", "fp8-checked", "FP8-capable (injected)"))


def test_auto_serves_bf16_when_fp8_misses_the_budget(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _forced_fp8_candidate(monkeypatch)
    monkeypatch.setattr(fp8_check, "MIN_TOP1", 1.01)  # no FP8 model reaches it
    backend = TorchEngineBackend(smollm2_path, precision="auto", n_ctx=256, max_batch=2)
    try:
        answer = backend.complete(ChatRequest(messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0))
        assert backend.precision == "bf16" and not backend.fp8_check.passed
        assert "serving bf16" in backend.precision_reason
        assert not any(isinstance(m, FP8Linear) for m in backend._transformer.modules())
        assert answer.usage.completion_tokens > 0
    finally:
        backend.close()


def test_auto_serves_fp8_when_it_passes(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _forced_fp8_candidate(monkeypatch)
    monkeypatch.setattr(fp8_check, "MIN_TOP1", 0.0)
    monkeypatch.setattr(fp8_check, "MAX_NLL_INCREASE_PCT", 100.0)
    backend = TorchEngineBackend(smollm2_path, precision="auto", n_ctx=256, max_batch=2)
    try:
        backend.load()
        assert backend.precision == "fp8" and backend.fp8_check.passed
        assert any(isinstance(m, FP8Linear) for m in backend._transformer.modules())
    finally:
        backend.close()


def test_auto_on_this_cpu_is_what_it_computes_in(smollm2_path: Path) -> None:
    device, precision, reason = engine_choice.choose_precision("auto")
    if device != "cpu":
        pytest.skip("a GPU is visible")
    assert precision == ("bf16" if cpu_has_bf16() else "fp32")
    assert reason
    assert engine_choice.choose_precision("fp32")[1] == "fp32"
