"""Reading a GGUF file's tensors as torch tensors.

This module owns :class:`GGUFFile` (the metadata, the tensor table and a read-only memory
map of the data) and :func:`load_state_dict`, which dequantizes every tensor to float32 with
:func:`.dequant.dequantize` (torch decoders for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K,
``gguf.quants`` for any other type) and hands torch tensors keyed by their llama.cpp names
(``token_embd.weight``, ``blk.N.attn_q.weight``, ``output_norm.weight``, ...). The model in
:mod:`.model` names its modules after those same names, so there is no name-mapping table
to keep in sync.

Why not ``gguf.GGUFReader``: it builds a numpy view for every metadata item, and the
tokenizer alone holds ~300k strings, so merely opening a file takes 5 s (SmolLM2) to 15-18 s
(Qwen2.5) on this machine. The header is parsed instead with the buffered reader of
:mod:`edgecloud.runtime.gguf` (tens of milliseconds).

Tensor layout: GGUF lists dims innermost first (``ne0`` = row length), so a ``[ne0, ne1]``
tensor is a numpy/torch ``[ne1, ne0]`` matrix, which for a linear layer is
``[out_features, in_features]``, the layout ``torch.nn.Linear`` wants.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..runtime.gguf import (  # the fast header reader, shared
    GGML_TYPE_SIZES,
    read_gguf_header,
)
from ..errors import ModelIntegrityError
from .dequant import dequantize

__all__ = ["GGUFFile", "TensorInfo", "load_state_dict"]

logger = logging.getLogger(__name__)

#: Tensors kept in float32 at any model dtype.
_FLOAT32_SUFFIXES = ("_norm.weight", "rope_freqs.weight")


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the GGUF tensor table; ``shape`` is torch order (outermost first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """The ggml type name, e.g. ``"Q4_K"``."""
        return GGML_TYPE_SIZES[self.ggml_type][0]

    @property
    def numel(self) -> int:
        """Number of elements once dequantized."""
        n = 1
        for d in self.shape:
            n *= d
        return n


class GGUFFile:
    """A GGUF file opened for reading tensors: metadata dict, tensor table, memory-mapped data."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        header = read_gguf_header(self.path)
        file_bytes = header.file_bytes
        self.metadata: dict[str, Any] = header.metadata
        raw = header.tensors
        self.data_start = header.data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, ggml_type, offset in raw:
            if ggml_type not in GGML_TYPE_SIZES:
                raise ModelIntegrityError(f"{self.path}: tensor {name!r} has unknown ggml type {ggml_type}")
            _, block, type_size = GGML_TYPE_SIZES[ggml_type]
            n = 1
            for d in dims:
                n *= d
            if dims and dims[0] % block:
                raise ModelIntegrityError(f"{self.path}: tensor {name!r} row of {dims[0]} is not a multiple of {block}")
            info = TensorInfo(name, tuple(reversed(dims)), ggml_type, self.data_start + offset, n // block * type_size)
            if info.offset + info.nbytes > file_bytes:
                raise ModelIntegrityError(
                    f"{self.path} is truncated: tensor {name!r} ends at byte {info.offset + info.nbytes:,} "
                    f"but the file has {file_bytes:,} bytes; download it again"
                )
            self.tensors[name] = info
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    @property
    def arch(self) -> str:
        """``general.architecture`` (e.g. ``"llama"``, ``"qwen2"``)."""
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view ``[rows, row_bytes]`` (no copy)."""
        info = self.tensors[name]
        data = self._map[info.offset : info.offset + info.nbytes]
        rows = info.numel // info.shape[-1] if info.shape else 1
        return data.reshape(rows, info.nbytes // rows)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as a float32 array in torch order (a fresh array, never the mapped file)."""
        info = self.tensors[name]
        try:
            values = dequantize(self.raw(name), info.ggml_type, info.shape)
        except (NotImplementedError, ValueError) as exc:
            raise ModelIntegrityError(
                f"{self.path}: cannot dequantize tensor {name!r} of type {info.type_name}: {exc}"
            ) from exc
        return values.numpy()

    def iter_tensors(self, names: list[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """``(name, float32 array)`` for each tensor (all, in file order, by default)."""
        for name in names if names is not None else list(self.tensors):
            yield name, self.dequantize(name)


def _progress_bar(total: int, description: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    """An ``advance(nbytes)`` / ``close()`` pair drawing a rich progress bar on stderr."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(), transient=True
    )
    task = bar.add_task(description, total=total)
    bar.start()
    return (lambda n: bar.advance(task, n)), bar.stop


def load_state_dict(
    gguf_file: GGUFFile,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``gguf_file`` dequantized to ``dtype`` on ``device``, keyed by its GGUF name.

    Norm weights and rope frequency factors stay float32 whatever ``dtype`` is: they are tiny
    and the norms and rotary angles are computed in float32. Timing is logged at
    INFO; ``progress`` also draws a bar (bytes of quantized data done).
    """
    start = time.perf_counter()
    total = sum(info.nbytes for info in gguf_file.tensors.values())
    advance, close = _progress_bar(total, f"dequantizing {gguf_file.path.name}") if progress else (None, None)
    state: dict[str, torch.Tensor] = {}
    try:
        for name, values in gguf_file.iter_tensors():
            tensor = torch.from_numpy(values)
            target = torch.float32 if name.endswith(_FLOAT32_SUFFIXES) else dtype
            state[name] = tensor.to(device=device, dtype=target)
            if advance is not None:
                advance(gguf_file.tensors[name].nbytes)
    finally:
        if close is not None:
            close()
    elapsed = time.perf_counter() - start
    n_params = sum(t.numel() for t in state.values())
    logger.info(
        "dequantized %d tensors (%.2fB params, %.0f MB quantized) from %s in %.1f s",
        len(state), n_params / 1e9, total / 1e6, gguf_file.path.name, elapsed,
    )
    return state
