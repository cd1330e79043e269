"""Precision comparison: the packaged sample, per-layer sensitivity, protection, the config file, fp8_skip."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn

from edgecloud.engine import Tokenizer, Transformer
from edgecloud.errors import ConfigError, InvalidRequestError
from edgecloud.quant import (
    QUANT_CONFIG_FORMAT,
    FP8Linear,
    QuantConfig,
    compare,
    compare_precision,
    convert_to_fp8,
    convertible_layers,
    load_quant_config,
    load_sample,
    save_quant_config,
)


def test_sample_has_2000_tokens_of_code_and_prose_and_disjoint_splits(smollm2_path: Path) -> None:
    evaluation, calibration = load_sample("eval"), load_sample("calibration")
    kinds = [name.partition(":")[0] for name in evaluation]
    assert kinds.count("code") >= 3 and kinds.count("prose") >= 3
    assert {name.partition(":")[0] for name in calibration} == {"code", "prose"}
    assert not set(evaluation.values()) & set(calibration.values())
    tokenizer = Tokenizer(smollm2_path)
    try:
        counts = {name: len(tokenizer.encode(text)) for name, text in evaluation.items()}
    finally:
        tokenizer.close()
    assert sum(counts.values()) >= 2000
    # An even split of 2,000 tokens over the passages fits in every one of them.
    assert min(counts.values()) >= 2000 // len(counts)
    with pytest.raises(ValueError, match="calibration, eval"):
        load_sample("train")


class _CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_chunk_texts_splits_each_text_budget_into_fresh_passages() -> None:
    chunks = compare.chunk_texts(_CharTokenizer(), {"a": "x" * 50, "b": "y" * 7}, tokens=40, chunk_tokens=8)
    assert [name for name, _ in chunks] == ["a", "a", "a"] + ["b"]
    assert [len(ids) for _, ids in chunks] == [8, 8, 4, 7]  # 20 tokens of a; b has only 7
    with pytest.raises(InvalidRequestError):
        compare.chunk_texts(_CharTokenizer(), {"a": "x"}, tokens=1)


def test_greedy_protection_takes_most_kl_per_byte_within_budget() -> None:
    sensitivity = {"big": 10.0, "small": 3.0, "tiny": 0.5, "harmless": 0.0}
    high = {"big": 200, "small": 20, "tiny": 10, "harmless": 10}
    low = {"big": 100, "small": 10, "tiny": 5, "harmless": 5}
    # per extra byte: small 0.3, big 0.1, tiny 0.1; big (100) no longer fits after small (10)
    assert compare._most_kl_per_byte(sensitivity, high, low, budget=105) == ["small", "tiny"]
    assert compare._most_kl_per_byte(sensitivity, high, low, budget=200) == ["small", "big", "tiny"]
    assert compare._most_kl_per_byte(sensitivity, high, low, budget=0) == []


@pytest.fixture()
def fast_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain amax scaling: these tests are about choosing layers, not about the scale search."""
    monkeypatch.setitem(compare.QUANTIZERS, "fp8", functools.partial(FP8Linear.from_linear, search_steps=1))


def test_replayed_sensitivity_equals_a_full_forward(smollm2_path: Path, fast_fp8: None) -> None:
    model = Transformer.from_gguf(smollm2_path)
    tokenizer = Tokenizer(smollm2_path)
    chunks = compare.chunk_texts(tokenizer, load_sample("calibration"), tokens=48)
    tokenizer.close()
    names = ["blk.0.attn_q", "blk.17.ffn_down"]
    quantized = {n: compare.QUANTIZERS["fp8"](model.get_submodule(n)) for n in names}
    sensitivity, _ = compare._measure_sensitivity(model, chunks, quantized, names)
    reference = compare.log_probs(model, chunks)
    for name in names:
        with compare._swapped(model, {name: quantized[name]}):
            full = compare.drift(reference, model, chunks)
        assert sensitivity[name] == pytest.approx(full["kl_mean"], rel=1e-3, abs=1e-7)
        assert sensitivity[name] > 0
    assert not any(isinstance(block, compare._Replay) for block in model.blk)


#: The linears of SmolLM2's first and last blocks: enough to choose among, one forward each.
CANDIDATES = [f"blk.{b}.{n}" for b in (0, 29) for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]


def _one_code_one_prose() -> dict[str, str]:
    sample = load_sample("eval")
    return {kind: next(text for name, text in sample.items() if name.startswith(kind)) for kind in ("code", "prose")}


def test_auto_protection_lowers_drift_within_the_byte_budget(smollm2_path: Path, fast_fp8: None) -> None:
    texts = _one_code_one_prose()
    result = compare_precision(
        smollm2_path, "fp8", texts, tokens=96, calibration_tokens=32, candidates=CANDIDATES, min_top1=1.01, max_bytes_ratio=0.52
    )
    assert sorted(layer["name"] for layer in result["layers"]) == sorted(CANDIDATES)
    kls = [layer["kl"] for layer in result["layers"]]
    assert kls == sorted(kls, reverse=True) and kls[0] > 0
    protected = result["protected"]
    assert protected and set(protected) == {layer["name"] for layer in result["layers"] if layer["protected"]}
    assert len(protected) < len(CANDIDATES)  # the budget binds
    unprotected = result["unprotected"]
    assert unprotected["weight_bytes_ratio"] < result["weight_bytes_ratio"] <= 0.52
    assert result["kl_mean"] < unprotected["kl_mean"]
    assert result["positions"] == sum(t["positions"] for t in result["per_text"].values()) == 2 * (48 - 1)
    assert result["calibration"]["positions"] == 30  # 2 calibration texts x (16 tokens - 1)
    assert result["meets_targets"] is False  # top-1 cannot reach 1.01

    # A list keeps exactly those layers: same texts, same figures, nothing measured.
    listed = compare_precision(smollm2_path, "fp8", texts, tokens=96, protect=protected)
    assert listed["protected"] == protected and listed["layers"] == [] and listed["calibration"] is None
    assert listed["kl_mean"] == pytest.approx(result["kl_mean"], rel=1e-5)
    assert listed["unprotected"]["kl_mean"] == pytest.approx(unprotected["kl_mean"], rel=1e-5)


def test_compare_rejects_unknown_quant_protect_and_layers(smollm2_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="quant"):
        compare_precision(smollm2_path, quant="int3")
    with pytest.raises(InvalidRequestError, match="protect"):
        compare_precision(smollm2_path, protect="all")
    with pytest.raises(InvalidRequestError, match="blk.99.ffn_down"):
        compare_precision(smollm2_path, tokens=16, protect=["blk.99.ffn_down"])
    with pytest.raises(InvalidRequestError, match="output"):
        compare_precision(smollm2_path, tokens=16, candidates=["output"])


def test_quant_config_round_trips(tmp_path: Path) -> None:
    result = {
        "model": "m.gguf",
        "quant": "fp8",
        "protected": ["blk.0.ffn_down", "blk.1.attn_k"],
        "top1_agreement": 0.98,
        "nll_delta_pct": 0.2,
        "kl_mean": 0.003,
        "weight_bytes_ratio": 0.54,
    }
    path = save_quant_config(result, tmp_path / "quant.json")
    on_disk = json.loads(path.read_text())
    assert on_disk["format"] == QUANT_CONFIG_FORMAT == "edgecloud-quant/1"
    assert on_disk["keep_high_precision"] == ["blk.0.ffn_down", "blk.1.attn_k"]
    config = load_quant_config(path)
    assert config == QuantConfig.from_comparison(result)
    assert config.measured["top1_agreement"] == 0.98
    assert load_quant_config(save_quant_config(config, tmp_path / "again.json")) == config

    for bad in ({**on_disk, "format": "edgecloud-quant/2"}, {**on_disk, "quant": "int3"}, {**on_disk, "keep": []}):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError):
            load_quant_config(tmp_path / "bad.json")
    with pytest.raises(ConfigError):
        load_quant_config(tmp_path / "missing.json")


def test_from_gguf_keeps_fp8_skip_layers_as_linear_in_the_load_dtype(smollm2_path: Path) -> None:
    keep = ["blk.0.ffn_down", "blk.3.attn_k"]
    model = Transformer.from_gguf(smollm2_path, precision="fp8", dtype=torch.bfloat16, fp8_skip=keep)
    for name in keep:
        layer = model.get_submodule(name)
        assert type(layer) is nn.Linear and layer.weight.dtype == torch.bfloat16
    assert isinstance(model.blk[0].ffn_up, FP8Linear) and isinstance(model.blk[3].attn_q, FP8Linear)
    assert convertible_layers(model) == keep  # the only high-precision linears left besides the lm_head
    with torch.inference_mode():
        logits = model(torch.tensor([1, 2, 3]), None, model.new_cache(3))
    assert bool(torch.isfinite(logits).all())


def test_fp8_skip_needs_fp8_and_known_layer_names(smollm2_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="fp8_skip"):
        Transformer.from_gguf(smollm2_path, precision="bf16", fp8_skip=["blk.0.ffn_down"])
    model = nn.ModuleDict({"blk": nn.ModuleList([nn.ModuleDict({"attn_q": nn.Linear(16, 16)})])})
    with pytest.raises(InvalidRequestError, match="blk.0.attn_z"):
        convert_to_fp8(model, keep=["blk.0.attn_z"])
