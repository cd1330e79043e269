"""FP8 (E4M3) weights: the quantizer's error bound, the layer's two paths, the model handler, real models."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn

from edgecloud.engine import Tokenizer, Transformer, generate
from edgecloud.errors import InvalidRequestError
from edgecloud.quant import (
    FP8_MAX,
    SCALE_SEARCH_STEPS,
    FP8Linear,
    convert_to_fp8,
    quantize_fp8_per_channel,
    scaled_mm_supported,
)

#: E4M3 keeps 3 mantissa bits: round-to-nearest is off by at most 2**-4 of the value (normal range).
E4M3_REL = 2.0**-4
#: Below this magnitude (in units of a row's scale) values are subnormal: absolute error <= 2**-10.
E4M3_MIN_NORMAL = 2.0**-6
N_TEACHER = 32
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


@pytest.mark.parametrize("search_steps", [1, SCALE_SEARCH_STEPS])
def test_round_trip_error_within_e4m3_precision_per_channel(search_steps: int) -> None:
    torch.manual_seed(0)
    # Rows with very different ranges: a per-tensor scale would flush the small rows.
    weight = torch.randn(64, 256) * torch.logspace(-4, 2, 64)[:, None]
    w_fp8, scale = quantize_fp8_per_channel(weight, search_steps=search_steps)
    assert w_fp8.dtype == torch.float8_e4m3fn and scale.shape == (64, 1) and scale.dtype == torch.float32
    amax = w_fp8.float().abs().amax(dim=1)
    if search_steps == 1:
        assert torch.allclose(amax, torch.full((64,), FP8_MAX))
    else:  # the search moves each row's scale up by less than an octave, never clipping
        assert bool((amax <= FP8_MAX).all() and (amax >= FP8_MAX / 2).all())
    error = (w_fp8.float() * scale - weight).abs()
    bound = torch.maximum(weight.abs() * E4M3_REL, scale * E4M3_MIN_NORMAL * 2.0**-4) * (1 + 1e-5)
    assert bool((error <= bound).all())


def test_scale_search_never_loses_to_amax_scaling_and_wins_on_k_quant_rows() -> None:
    torch.manual_seed(3)
    # Rows like a GGUF Q4 tensor dequantized: blocks of 32 on 16 affine levels each.
    blocks = torch.randn(512 * 256 // 32, 32) * 0.02
    low = blocks.amin(1, keepdim=True)
    step = (blocks.amax(1, keepdim=True) - low) / 15
    weight = (torch.round((blocks - low) / step) * step + low).view(512, 256)
    row_error = {}
    for steps in (1, SCALE_SEARCH_STEPS):
        w_fp8, scale = quantize_fp8_per_channel(weight, search_steps=steps)
        row_error[steps] = (w_fp8.float() * scale - weight).square().sum(dim=1)
    assert bool((row_error[SCALE_SEARCH_STEPS] <= row_error[1] * (1 + 1e-4)).all())
    assert float(row_error[SCALE_SEARCH_STEPS].sum()) < 0.95 * float(row_error[1].sum())
    with pytest.raises(ValueError, match="search_steps"):
        quantize_fp8_per_channel(weight, search_steps=0)


def test_zero_rows_quantize_to_zeros() -> None:
    weight = torch.randn(4, 32)
    weight[2] = 0.0
    w_fp8, scale = quantize_fp8_per_channel(weight)
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    assert bool((w_fp8[2].float() == 0).all())
    layer = FP8Linear(w_fp8, scale)
    out = layer(torch.randn(3, 32))
    assert bool(torch.isfinite(out).all()) and bool((out[:, 2] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_equals_dequantized_weight_matmul(dtype: torch.dtype, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(1)
    linear = nn.Linear(96, 48, bias=True).to(dtype)
    layer = FP8Linear.from_linear(linear)
    x = torch.randn(5, 7, 96, dtype=dtype)
    with caplog.at_level(logging.WARNING, logger="edgecloud.quant"):
        out = layer(x)
    expected = nn.functional.linear(x.float(), layer.dequantized_weight(torch.float32), linear.bias.float())
    assert out.shape == (5, 7, 48) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def test_cpu_path_logs_quantize_dequantize_once(caplog: pytest.LogCaptureFixture) -> None:
    from edgecloud.engine import fp8

    fp8._announced.discard("qdq")
    layer = FP8Linear.from_linear(nn.Linear(16, 16))
    with caplog.at_level(logging.WARNING, logger="edgecloud.quant"):
        for _ in range(3):
            layer(torch.randn(2, 16))
    messages = [r.getMessage() for r in caplog.records if r.name == "edgecloud.quant"]
    assert len(messages) == 1 and "quantize-dequantize" in messages[0]


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token_embd = nn.Embedding(100, 64)
        self.blk = nn.ModuleList(nn.ModuleDict({"attn_q": nn.Linear(64, 64), "attn_output": nn.Linear(64, 64)}) for _ in range(2))
        self.output = nn.Linear(64, 100, bias=False)


def test_convert_to_fp8_skips_embeddings_and_lm_head_and_halves_bf16_bytes() -> None:
    model = _TinyLM().to(torch.bfloat16)
    report = convert_to_fp8(model)
    assert sorted(report.converted) == sorted(f"blk.{i}.{n}" for i in range(2) for n in ("attn_q", "attn_output"))
    assert report.skipped == ["output"]
    assert isinstance(model.output, nn.Linear) and isinstance(model.token_embd, nn.Embedding)
    assert all(isinstance(block[n], FP8Linear) for block in model.blk for n in ("attn_q", "attn_output"))
    # weight 64*64*2 + bias 64*2 before; 64*64 + scale 64*4 + bias 64*2 after
    assert report.bytes_before == 4 * (64 * 64 * 2 + 64 * 2)
    assert report.bytes_after == 4 * (64 * 64 + 64 * 4 + 64 * 2)
    assert report.ratio <= 0.55


def test_convert_to_fp8_keeps_named_layers_in_their_dtype() -> None:
    model = _TinyLM().to(torch.bfloat16)
    report = convert_to_fp8(model, keep=["blk.1.attn_q"])
    assert type(model.blk[1]["attn_q"]) is nn.Linear and model.blk[1]["attn_q"].weight.dtype == torch.bfloat16
    assert isinstance(model.blk[0]["attn_q"], FP8Linear) and isinstance(model.blk[1]["attn_output"], FP8Linear)
    assert sorted(report.skipped) == ["blk.1.attn_q", "output"] and len(report.converted) == 3


def test_unknown_precision_names_the_allowed_values(smollm2_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="fp32, bf16, fp8"):
        Transformer.from_gguf(smollm2_path, precision="int4")


def _agreement(path: Path, reference: Transformer, fp8_model: Transformer) -> tuple[float, int]:
    """Top-1 agreement over N_TEACHER teacher-forced positions, and the first free-running divergence."""
    tokenizer = Tokenizer(path)
    prompt = tokenizer.encode_chat(CHAT)
    greedy = list(generate(reference, tokenizer, prompt, N_TEACHER, stop_at_eog=False))
    cache = fp8_model.new_cache(len(prompt) + N_TEACHER)
    with torch.inference_mode():
        logits = fp8_model(torch.tensor(prompt + greedy), None, cache)
    top1 = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    agreement = sum(a == b for a, b in zip(top1, greedy)) / N_TEACHER
    free = list(generate(fp8_model, tokenizer, prompt, N_TEACHER, stop_at_eog=False))
    first_divergence = next((i for i, (a, b) in enumerate(zip(free, greedy)) if a != b), N_TEACHER)
    print(f"\n{path.name}: fp8 top-1 agreement {agreement:.3f}, free-running greedy diverges at {first_divergence}")
    tokenizer.close()
    return agreement, first_divergence


def _fp8_copy(model: Transformer) -> Transformer:
    fp8_model = copy.deepcopy(model)
    report = convert_to_fp8(fp8_model)
    assert report.converted and "output" in report.skipped
    return fp8_model


def test_fp8_greedy_tracks_fp32_smollm2(smollm2_path: Path) -> None:
    reference = Transformer.from_gguf(smollm2_path)
    agreement, first_divergence = _agreement(smollm2_path, reference, _fp8_copy(reference))
    assert agreement >= 0.90
    assert first_divergence >= 8


def test_from_gguf_fp8_converts_block_linears_only(smollm2_path: Path) -> None:
    model = Transformer.from_gguf(smollm2_path, precision="fp8")
    assert isinstance(model.blk[0].ffn_gate, FP8Linear) and isinstance(model.blk[0].attn_q, FP8Linear)
    assert isinstance(model.output, nn.Linear) and model.output.weight.dtype == torch.float32
    assert model.dtype == torch.float32


@pytest.mark.skipif(not scaled_mm_supported("cuda"), reason="native FP8 matmul needs CUDA with compute capability >= 8.9")
def test_scaled_mm_path_matches_dequantized_matmul() -> None:
    torch.manual_seed(2)
    linear = nn.Linear(512, 256, bias=True).to("cuda", torch.bfloat16)
    layer = FP8Linear.from_linear(linear)
    x = torch.randn(3, 5, 512, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    reference = layer._forward_dequantized(x.float())
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5, 256)
    # Activations are E4M3 too on this path: relative error of a few 2**-4 steps, averaged over K.
    rel = (out.float() - reference).norm() / reference.norm()
    assert rel < 0.05
