"""``edgecloud export onnx``: GGUF -> Hugging Face checkpoint -> onnxruntime-genai INT4 folder.

The checkpoint stage is checked against the engine's own model (same logits), the bad inputs
(a non-empty folder, architectures nobody can build) against their error messages, and the
whole command once end to end on SmolLM2-135M.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")

from edgecloud.edge.onnx import EXPORT_FILE, GENAI_CONFIG, load_manifest
from edgecloud.errors import BackendUnavailableError, InvalidRequestError
from edgecloud.quant.export_onnx import (
    build_genai_model,
    end_of_generation_ids,
    export_onnx,
    hf_config,
    hf_tensor_name,
    unpermute_qk,
    write_hf_checkpoint,
)

torch.set_num_threads(1)
EDGECLOUD = [sys.executable, "-m", "edgecloud"]


def test_tensor_names_follow_hugging_face() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(BackendUnavailableError, match="blk.0.ssm_conv1d.weight"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")


def test_unpermute_undoes_the_llama_cpp_converter() -> None:
    n_head, head_dim, n_embd = 3, 8, 5
    hf = np.arange(n_head * head_dim * n_embd, dtype=np.float32).reshape(n_head * head_dim, n_embd)
    # convert_hf_to_gguf.LlamaModel.permute
    permuted = hf.reshape(n_head, 2, head_dim // 2, n_embd).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(permuted, hf)
    assert np.array_equal(unpermute_qk(permuted, n_head), hf)


def test_checkpoint_scores_like_the_engine(smollm2_path: Path, tmp_path: Path) -> None:
    """The Hugging Face checkpoint, run by transformers, gives the torch engine's logits for the same GGUF."""
    from transformers import AutoModelForCausalLM

    from edgecloud.engine import GGUFFile, Tokenizer, Transformer

    config = write_hf_checkpoint(smollm2_path, tmp_path)
    gguf = GGUFFile(smollm2_path)
    assert config == hf_config(gguf.metadata, {n: t.shape for n, t in gguf.tensors.items()})
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    engine = Transformer.from_gguf(smollm2_path)
    tokenizer = Tokenizer(smollm2_path)
    try:
        ids = tokenizer.encode_chat([{"role": "user", "content": "Write a Python function that reverses a string."}])
    finally:
        tokenizer.close()
    with torch.inference_mode():
        ours = engine(torch.tensor(ids), None, engine.new_cache(len(ids)))
        theirs = hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, theirs, atol=2e-3, rtol=0)


def test_end_of_generation_ids_without_llama_cpp_are_llama_cpp_ids(
    smollm2_path: Path, smollm2_onnx: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The metadata + token-text rule used when llama.cpp is not installed gives llama.cpp's own ids."""
    import edgecloud.engine as engine
    from edgecloud.runtime.gguf import read_gguf_header
    from tokenizers import Tokenizer

    metadata = read_gguf_header(smollm2_path).metadata
    vocab = Tokenizer.from_file(str(smollm2_onnx / "tokenizer.json")).get_vocab(with_added_tokens=True)
    with_llama_cpp = end_of_generation_ids(smollm2_path, metadata, vocab)

    def no_llama_cpp(path: object) -> None:
        raise BackendUnavailableError("llama.cpp is not installed")

    monkeypatch.setattr(engine, "Tokenizer", no_llama_cpp)
    assert end_of_generation_ids(smollm2_path, metadata, vocab) == with_llama_cpp == load_manifest(smollm2_onnx).eog_token_ids


def _fake_gguf(path: Path, arch: str) -> Path:
    """A tiny but valid GGUF file of architecture ``arch`` (metadata and one small tensor)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_gguf_architecture_is_named(tmp_path: Path) -> None:
    model = _fake_gguf(tmp_path / "tiny-mamba.gguf", "mamba")
    with pytest.raises(BackendUnavailableError, match="'mamba'.*supported: llama, qwen2"):
        export_onnx(model, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_an_architecture_the_builder_does_not_know_is_named(smollm2_onnx: Path, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    config = {
        "architectures": ["FooForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 49152,
        "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
    }
    (hf / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a real tokenizer: the builder reads it first
        (hf / name).write_bytes((smollm2_onnx / name).read_bytes())
    with pytest.raises(BackendUnavailableError, match="'FooForCausalLM'"):
        build_genai_model(hf, tmp_path / "out")


def test_a_non_empty_out_folder_is_refused_without_force(smollm2_path: Path, tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(InvalidRequestError, match="--force"):
        export_onnx(smollm2_path, tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"
    result = subprocess.run(
        [*EDGECLOUD, "export", "onnx", "--model", str(smollm2_path), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "--force" in result.stderr and "Traceback" not in result.stderr


def test_block_size_must_be_one_the_builder_takes(smollm2_path: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="block_size"):
        export_onnx(smollm2_path, tmp_path / "out", block_size=48)


def test_export_command_builds_a_folder_the_backend_loads(smollm2_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "smollm2-onnx"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier build")
    result = subprocess.run(
        [*EDGECLOUD, "export", "onnx", "--model", str(smollm2_path), "--out", str(out), "--force", "--json"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["precision"] == "int4" and summary["block_size"] == 32 and summary["architecture"] == "llama"
    assert set(summary["seconds"]) == {"dequantize", "tokenizer", "build", "verify"}
    assert summary["sample"].strip()
    assert not (out / "stale.txt").exists()
    assert (out / GENAI_CONFIG).is_file() and (out / "tokenizer.json").is_file()
    assert summary["onnx_bytes"] == sum(p.stat().st_size for p in out.glob("model.onnx*"))
    manifest = load_manifest(out)
    assert manifest.model == smollm2_path.stem and manifest.source_bytes == smollm2_path.stat().st_size
    genai = json.loads((out / GENAI_CONFIG).read_text())["model"]
    assert sorted(genai["eos_token_id"]) == manifest.eog_token_ids
    onnx_graph = (out / "model.onnx").read_bytes()
    assert b"MatMulNBits" in onnx_graph and b"GatherBlockQuantized" in onnx_graph
    assert not list(tmp_path.glob(".edgecloud-hf-*")), "the float32 checkpoint is removed"
    assert (out / EXPORT_FILE).is_file()
