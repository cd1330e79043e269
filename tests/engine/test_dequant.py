"""The torch dequantizers against gguf-py's numpy reference: bit-identical on real and synthetic blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf_quants = pytest.importorskip("gguf.quants")

from gguf import GGMLQuantizationType

from edgecloud.engine import dequant
from edgecloud.engine.dequant import DEQUANTIZERS, dequantize
from edgecloud.engine.weights import GGUFFile

ROWS = 48  # rows per real-tensor slice: enough for several chunks once CHUNK_ELEMENTS is shrunk

#: Byte offsets of the fp16 scale fields in each block (random bytes there could be NaN/inf).
_FP16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def _reference(raw: np.ndarray, ggml_type: int) -> torch.Tensor:
    values = gguf_quants.dequantize(raw, GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.array(values, dtype=np.float32))


def _random_blocks(type_name: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """``n_blocks`` valid random blocks: random bytes with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    if type_name == "F32":
        return rng.standard_normal(n_blocks, dtype=np.float32).view(np.uint8)
    if type_name == "F16":
        return rng.standard_normal(n_blocks).astype(np.float16).view(np.uint8)
    if type_name == "BF16":
        return (rng.standard_normal(n_blocks, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    type_size = {f.name: f.type_size for f in DEQUANTIZERS.values()}.get(type_name, 84)  # 84: Q2_K
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in _FP16_FIELDS[type_name]:
        scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


@pytest.fixture(params=[1 << 18, 512], ids=["default-chunks", "tiny-chunks"])
def chunk_elements(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Both the real chunk size and one small enough to split every slice over the worker threads."""
    monkeypatch.setattr(dequant, "CHUNK_ELEMENTS", request.param)
    return request.param


def _real_slices(path: Path) -> list[tuple[str, int, np.ndarray, tuple[int, int]]]:
    """One slice (first and middle rows) of a tensor of each ggml type in the file."""
    gguf_file = GGUFFile(path)
    slices = []
    seen: set[int] = set()
    for name, info in gguf_file.tensors.items():
        if info.ggml_type in seen:
            continue
        seen.add(info.ggml_type)
        raw = gguf_file.raw(name)
        middle = raw.shape[0] // 2
        rows = np.concatenate([raw[:ROWS], raw[middle : middle + ROWS]]) if raw.shape[0] > 2 * ROWS else raw
        shape = (rows.shape[0], info.shape[-1]) if len(info.shape) > 1 else (info.shape[0],)
        slices.append((f"{path.name}:{name}:{info.type_name}", info.ggml_type, rows, shape))
    return slices


def test_real_tensors_are_bit_identical(smollm2_path: Path, qwen05_path: Path, chunk_elements: int) -> None:
    slices = _real_slices(smollm2_path) + _real_slices(qwen05_path)
    covered = {DEQUANTIZERS[t].name for _, t, _, _ in slices if t in DEQUANTIZERS}
    # SmolLM2 is Q4_1 (+ Q8_0); the Qwen 0.5B Q5_0, Q8_0, Q4_K, Q6_K; both F32 norms.
    assert {"Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "F32"} <= covered
    for label, ggml_type, raw, shape in slices:
        ours = dequantize(raw, ggml_type, shape)
        reference = _reference(raw, ggml_type).reshape(shape)
        assert ours.dtype == torch.float32 and ours.shape == shape, label
        assert torch.equal(ours, reference), label


@pytest.mark.parametrize("type_name", [f.name for f in DEQUANTIZERS.values()])
def test_synthetic_blocks_are_bit_identical(type_name: str, chunk_elements: int) -> None:
    ggml_type = next(t for t, f in DEQUANTIZERS.items() if f.name == type_name)
    block_size = DEQUANTIZERS[ggml_type].block_size
    n_blocks = 40 * (256 // block_size)  # 40 rows of 256 elements
    raw = _random_blocks(type_name, n_blocks)
    ours = dequantize(raw, ggml_type, (40, 256))
    assert torch.equal(ours, _reference(raw.reshape(40, -1), ggml_type).reshape(40, 256))


def test_torch_input_gives_the_same_values() -> None:
    raw = _random_blocks("Q4_K", 8)
    assert torch.equal(dequantize(torch.from_numpy(raw), 12, (8, 256)), dequantize(raw, 12, (8, 256)))


def test_types_outside_the_registry_fall_back_to_gguf() -> None:
    assert 10 not in DEQUANTIZERS  # Q2_K
    raw = _random_blocks("Q2_K", 6)
    assert torch.equal(dequantize(raw, 10, (6, 256)), _reference(raw.reshape(6, -1), 10).reshape(6, 256))


def test_byte_count_must_match_the_shape() -> None:
    raw = _random_blocks("Q4_0", 4)
    with pytest.raises(ValueError, match="Q4_0 data of 72 bytes"):
        dequantize(raw, 2, (5, 32))


def test_gguf_file_dequantize_returns_a_writable_float32_array(smollm2_path: Path) -> None:
    gguf_file = GGUFFile(smollm2_path)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_down.weight"):
        values = gguf_file.dequantize(name)
        assert values.dtype == np.float32 and values.flags.writeable
        assert values.shape == gguf_file.tensors[name].shape
