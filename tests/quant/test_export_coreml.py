"""Core ML export on the tiny real model: the traced decoder against the engine, the saved package's
structure (inputs, outputs, states, INT4 payload, tokenizer), bad options, and the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("coremltools")

import torch

from edgecloud.engine import GGUFFile, Tokenizer, Transformer
from edgecloud.errors import InvalidRequestError, ModelNotFoundError
from edgecloud.store import home_dir
from edgecloud.quant.export_coreml import (
    FORMAT,
    StatefulDecoder,
    causal_mask,
    export_coreml,
    inspect_mlpackage,
    package_tokenizer,
    trace_decoder,
)

#: tests/conftest.py cannot be imported by name (other conftest.py files share the name)
SMOLLM2 = "smollm2-135m-instruct-q4"

CONTEXT = 64
BLOCK = 32
MESSAGES = [{"role": "user", "content": "Name three prime numbers."}]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "edgecloud", "export", "coreml", *args], capture_output=True,
                          text=True, timeout=900, cwd=cwd, env=env)


def _export_key(model_path: Path) -> str:
    """What the exported package depends on: the model file, the options, the exporter's code and its tools."""
    import coremltools

    from edgecloud.cli import export_coreml as command
    from edgecloud.quant import export_coreml as exporter

    digest = hashlib.sha256()
    for part in (model_path.name, model_path.stat().st_size, CONTEXT, BLOCK, coremltools.__version__, torch.__version__):
        digest.update(f"{part}\n".encode())
    for module in (exporter, command):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def exported(smollm2_path: Path) -> dict[str, Any]:
    """The issue's command with a small context: its JSON report.

    Conversion takes a minute or two on two cores, so the package is kept under
    ``$EDGECLOUD_HOME/test-exports/coreml`` keyed by :func:`_export_key`: any change to the model,
    the options, the exporter or the CLI (or to coremltools / torch) exports again through the CLI.
    """
    cache = home_dir() / "test-exports" / "coreml"  # this folder only: other exporters cache beside it
    entry = cache / _export_key(smollm2_path)
    report = entry / "report.json"
    if not report.is_file():
        if cache.is_dir():
            shutil.rmtree(cache)  # older keys: packages of code that has changed since
        entry.mkdir(parents=True)
        out = entry / "smollm2.mlpackage"
        result = _cli("--model", SMOLLM2, "--out", str(out), "--context", str(CONTEXT), "--json", cwd=entry)
        assert result.returncode == 0, result.stderr
        report.write_text(result.stdout)
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Transformer:
    torch.set_num_threads(1)
    return Transformer.from_gguf(smollm2_path, dtype=torch.float32)


def test_causal_mask_lets_each_new_token_see_the_cache_and_itself() -> None:
    mask = causal_mask(2, 5)
    assert mask.shape == (1, 1, 2, 5) and mask.dtype == np.float16
    assert (mask[0, 0] == 0).tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert np.isneginf(mask[0, 0, 0, 4])
    with pytest.raises(InvalidRequestError):
        causal_mask(3, 2)


def test_traced_decoder_logits_equal_the_engine_for_prefill_then_decode(engine: Transformer, smollm2_path: Path) -> None:
    tokenizer = Tokenizer(smollm2_path)
    prompt = tokenizer.encode_chat(MESSAGES)
    tokenizer.close()
    traced = trace_decoder(StatefulDecoder(engine, CONTEXT))
    n = len(prompt)
    with torch.no_grad():
        expected = engine(torch.tensor(prompt), None, engine.new_cache(CONTEXT))[-1]
        got = traced(torch.tensor([prompt], dtype=torch.int32), torch.from_numpy(causal_mask(n, n)))
        assert got.shape == (1, 1, engine.args.vocab_size)
        # the cache is float16 in the package (engine: float32), hence the tolerance
        torch.testing.assert_close(got[0, 0], expected, atol=0.05, rtol=0.01)
        assert int(got.argmax()) == int(expected.argmax())

        nxt = int(expected.argmax())
        expected = engine(torch.tensor([*prompt, nxt]), None, engine.new_cache(CONTEXT))[-1]
        got = traced(torch.tensor([[nxt]], dtype=torch.int32), torch.from_numpy(causal_mask(1, n + 1)))
        torch.testing.assert_close(got[0, 0], expected, atol=0.05, rtol=0.01)


def test_package_declares_the_documented_inputs_outputs_and_states(exported: dict[str, Any], engine: Transformer) -> None:
    a = engine.args
    spec = inspect_mlpackage(exported["path"])
    assert spec["inputs"] == [
        {"name": "input_ids", "dtype": "int32", "shape": [1, [1, CONTEXT]]},
        {"name": "causal_mask", "dtype": "float16", "shape": [1, 1, [1, CONTEXT], [1, CONTEXT]]},
    ]
    assert spec["outputs"] == [{"name": "logits", "dtype": "float16", "shape": [1, 1, a.vocab_size]}]
    cache = [a.n_layer, 1, a.n_head_kv, CONTEXT, a.head_dim]
    assert spec["states"] == [
        {"name": "k_cache", "dtype": "float16", "shape": cache},
        {"name": "v_cache", "dtype": "float16", "shape": cache},
    ]
    assert spec["spec_version"] >= 9  # iOS 18 / macOS 15: the first with states
    assert spec["op_counts"]["write_state"] == 2 * a.n_layer
    meta = spec["metadata"]
    assert meta["edgecloud.format"] == FORMAT and meta["edgecloud.model"] == SMOLLM2
    assert (meta["edgecloud.context"], meta["edgecloud.int4_block"]) == (str(CONTEXT), str(BLOCK))
    assert exported["inputs"] == spec["inputs"] and exported["states"] == spec["states"]
    assert exported["size_bytes"] > exported["weight_bytes"] and exported["seconds"] > 0


def test_weight_payload_is_int4_sized(exported: dict[str, Any], engine: Transformer, smollm2_path: Path) -> None:
    a = engine.args
    # seven linears per layer, and the embedding that the tied lm_head shares
    assert exported["int4_ops"] == 7 * a.n_layer + 1
    quantized = sum(t.numel for t in GGUFFile(smollm2_path).tensors.values() if len(t.shape) == 2)
    int4_bytes = quantized // 2 + quantized // BLOCK * 2  # 4-bit values + one float16 scale per block
    # the rest: norms, rope tables and the blob headers, well under 1 %
    assert int4_bytes <= exported["weight_bytes"] <= int4_bytes * 1.01
    assert exported["weight_bytes"] < quantized * 2 * 0.3  # well under float16's size


def test_package_carries_the_models_tokenizer(exported: dict[str, Any], smollm2_path: Path) -> None:
    inside, original = Tokenizer(package_tokenizer(exported["path"])), Tokenizer(smollm2_path)
    try:
        assert inside.encode_chat(MESSAGES) == original.encode_chat(MESSAGES)
        assert inside.eog_ids == original.eog_ids and inside.vocab_size == original.vocab_size
    finally:
        inside.close()
        original.close()
    assert package_tokenizer(exported["path"]).stat().st_size < 4_000_000


def test_existing_package_is_kept_without_force(tmp_path: Path) -> None:
    out = tmp_path / "m.mlpackage"
    out.mkdir()
    (out / "Manifest.json").write_text("{}")
    with pytest.raises(InvalidRequestError, match="pass --force") as info:
        export_coreml(SMOLLM2, out)
    assert info.value.param == "out"
    assert (out / "Manifest.json").read_text() == "{}"


@pytest.mark.parametrize(
    ("options", "param", "hint"),
    [
        ({"int4_block": 48}, "int4_block", "must be one of 16, 32, 64"),
        ({"int4_block": 128}, "int4_block", "use one of 16, 32, 64"),  # 576-wide rows
        ({"context": 8}, "context", "at least 16"),
        ({"context": 100_000}, "context", "context length 8192"),
    ],
)
def test_bad_options_name_what_to_change(tmp_path: Path, options: dict[str, int], param: str, hint: str) -> None:
    with pytest.raises(InvalidRequestError, match=hint) as info:
        export_coreml(SMOLLM2, tmp_path / "m.mlpackage", **options)
    assert info.value.param == param
    assert not (tmp_path / "m.mlpackage").exists()


def test_out_must_be_an_mlpackage_and_the_model_must_exist(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match=r"\.mlpackage"):
        export_coreml(SMOLLM2, tmp_path / "m.mlmodel")
    with pytest.raises(ModelNotFoundError):
        export_coreml("no-such-model", tmp_path / "m.mlpackage")


def test_cli_refuses_bad_options_with_exit_status_2(tmp_path: Path) -> None:
    result = _cli("--model", SMOLLM2, "--out", str(tmp_path / "m.mlpackage"), "--int4-block", "128", cwd=tmp_path)
    assert result.returncode == 2
    assert "--int4-block 128 does not work for this model" in result.stderr
    assert not result.stdout
