"""The fast GGUF header reader agrees with gguf-py's own ``GGUFReader`` on the catalogue models:
every metadata key and value, every tensor's name, shape, type and offset, and the data start."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from edgecloud import store
from edgecloud.runtime.gguf import GGML_TYPE_SIZES, read_gguf_header

MODELS = ["smollm2-135m-instruct-q4", "qwen2.5-coder-0.5b-instruct-q4", "qwen2.5-coder-1.5b-instruct-q4"]


def _reader_value(field: Any) -> Any:
    """A GGUFReader field as plain Python (strings decoded, arrays as lists)."""
    kind = field.types[0]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if kind == gguf.GGUFValueType.ARRAY:
        item = field.types[1]
        if item == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    return field.parts[field.data[0]].tolist()[0]


@pytest.mark.parametrize("name", MODELS)
def test_header_matches_gguf_reader(name: str) -> None:
    path = store.model_file(name)
    if not path.is_file():
        pytest.skip(f"{name} is not pulled (edgecloud models pull {name})")
    ours = read_gguf_header(path)
    theirs = gguf.GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(fields)
    for key, field in fields.items():
        want, got = _reader_value(field), ours.metadata[key]
        if isinstance(want, list) and not isinstance(got, list):
            assert got == len(want), key  # long string arrays are kept as their length
        elif isinstance(want, float):
            assert got == pytest.approx(want), key
        else:
            assert got == want, key
    assert [t[0] for t in ours.tensors] == [t.name for t in theirs.tensors]
    for (tname, dims, kind, offset), tensor in zip(ours.tensors, theirs.tensors):
        assert tuple(dims) == tuple(int(d) for d in tensor.shape), tname
        assert kind == int(tensor.tensor_type), tname
        assert ours.data_start + offset == tensor.data_offset, tname
        _, block, size = GGML_TYPE_SIZES[kind]
        assert int(np.prod(dims)) // block * size == tensor.n_bytes, tname
