"""The Core ML package contract: what ``edgecloud export coreml`` writes and the Core ML runtime reads.

This module owns the package's interface (:data:`FORMAT`, its inputs, outputs and states),
:func:`causal_mask` (the mask input for ``n`` new tokens), :func:`import_coremltools`,
:func:`package_tokenizer` (the vocabulary-only GGUF stored in the package) and
:func:`inspect_mlpackage` (what a saved package declares, read from its spec; works on Linux).
The exporter (:mod:`edgecloud.quant.export_coreml`) and the runtime
(:mod:`edgecloud.edge.coreml`) both build on it, so neither imports the other.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError, InvalidRequestError, ModelIntegrityError

__all__ = [
    "FORMAT", "INPUTS", "OUTPUTS", "PACKAGE_AUTHOR", "STATES", "TOKENIZER_ITEM", "causal_mask", "import_coremltools",
    "inspect_mlpackage", "package_tokenizer", "quiet_coremltools", "dir_bytes",
]

#: ``edgecloud.format`` of the packages this version writes and runs.
FORMAT = "edgecloud-coreml/1"
INPUTS = ("input_ids", "causal_mask")
OUTPUTS = ("logits",)
STATES = ("k_cache", "v_cache")
#: The tokenizer package item (a vocabulary-only GGUF) and the author it is filed under.
TOKENIZER_ITEM = "tokenizer.gguf"
PACKAGE_AUTHOR = "ai.edgecloud"


def causal_mask(n: int, end: int) -> np.ndarray:
    """The ``causal_mask`` input for ``n`` new tokens at cache slots ``end - n .. end - 1``.

    ``[1, 1, n, end]`` float16: query ``i`` may see slots ``0 .. end - n + i`` (0), not later ones (-inf).
    """
    if not 1 <= n <= end:
        raise InvalidRequestError(f"a causal mask needs 1 <= n <= end, got n={n}, end={end}")
    begin = end - n
    allowed = np.arange(end)[None, :] <= (begin + np.arange(n))[:, None]
    return np.where(allowed, 0.0, -np.inf).astype(np.float16)[None, None]


def import_coremltools() -> Any:
    """coremltools, imported without its Linux-only chatter; BackendUnavailableError when it is not installed."""
    try:
        with quiet_coremltools():
            import coremltools
    except ImportError as exc:
        raise BackendUnavailableError(
            "Core ML export needs coremltools; install it with: pip install 'edgecloud[coreml]'"
        ) from exc
    return coremltools


@contextlib.contextmanager
def quiet_coremltools() -> Iterator[None]:
    """Silence coremltools' log lines (missing macOS-only modules, untested versions) and tqdm bars on stderr."""
    logger = logging.getLogger("coremltools")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def package_tokenizer(path: str | Path) -> Path:
    """The vocabulary-only GGUF stored in an exported package (load it with :class:`~edgecloud.engine.Tokenizer`)."""
    import_coremltools()
    from coremltools.libmodelpackage import ModelPackage

    item = ModelPackage(str(path)).findItemByNameAuthor(TOKENIZER_ITEM, PACKAGE_AUTHOR)
    if item is None:
        raise ModelIntegrityError(f"{path} holds no {TOKENIZER_ITEM}; export it again with `edgecloud export coreml`")
    return Path(item.path())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------- export


def _feature(desc: Any) -> dict[str, Any]:
    """Name, dtype and shape (``[lower, upper]`` per flexible dim) of one spec feature."""
    kind = desc.type.WhichOneof("Type")
    array = desc.type.stateType.arrayType if kind == "stateType" else desc.type.multiArrayType
    ranges = list(array.shapeRange.sizeRanges)
    shape: list[Any] = [int(d) for d in array.shape]
    if ranges:
        shape = [int(r.lowerBound) if r.lowerBound == r.upperBound else [int(r.lowerBound), int(r.upperBound)]
                 for r in ranges]
    dtype = type(array).ArrayDataType.Name(array.dataType).lower()
    return {"name": desc.name, "dtype": dtype, "shape": shape}


def inspect_mlpackage(path: str | Path) -> dict[str, Any]:
    """What a saved package declares, read from its spec (no prediction, so it works on Linux).

    ``inputs`` / ``outputs`` / ``states``: name, dtype, shape (a ``[lower, upper]`` pair per
    flexible dim); ``metadata``: the user-defined metadata; ``spec_version`` (9 = iOS 18 /
    macOS 15); ``int4_ops``: how many ``constexpr_blockwise_shift_scale`` weight ops have INT4
    data; ``op_counts``: MIL ops per type; ``weight_bytes``: the size of the weight payload.
    """
    path = Path(path)
    if not (path / "Manifest.json").is_file():
        raise InvalidRequestError(f"{path} is not a .mlpackage (no Manifest.json)", param="path")
    ct = import_coremltools()
    with quiet_coremltools():
        spec = ct.utils.load_spec(str(path))
    desc = spec.description
    ops = [
        op
        for function in spec.mlProgram.functions.values()
        for block in function.block_specializations.values()
        for op in block.operations
    ]
    int4_ops = sum(1 for op in ops if op.type == "constexpr_blockwise_shift_scale" and _int4_data(op))
    weights = path / "Data" / "com.apple.CoreML" / "weights"
    return {
        "inputs": [_feature(d) for d in desc.input],
        "outputs": [_feature(d) for d in desc.output],
        "states": [_feature(d) for d in desc.state],
        "metadata": dict(desc.metadata.userDefined),
        "spec_version": int(spec.specificationVersion),
        "int4_ops": int4_ops,
        "op_counts": dict(sorted(Counter(op.type for op in ops).items())),
        "weight_bytes": dir_bytes(weights) if weights.is_dir() else 0,
    }


def _int4_data(op: Any) -> bool:
    """Whether a ``constexpr_blockwise_shift_scale`` op's ``data`` is an INT4 tensor."""
    from coremltools.proto import MIL_pb2

    data = op.inputs["data"].arguments[0]
    return data.WhichOneof("binding") == "value" and data.value.type.tensorType.dataType == MIL_pb2.INT4
