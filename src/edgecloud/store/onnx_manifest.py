"""What ``edgecloud export onnx`` writes next to an onnxruntime-genai model folder, and reading it.

This module owns :class:`ExportManifest` (``edgecloud.json``: the source model, its chat template
and end-of-generation ids) and :func:`load_manifest`. It needs neither onnxruntime nor the
ONNX backend, so the memory planner and the exporter read a folder without importing them.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import ModelIntegrityError, ModelNotFoundError

__all__ = ["EXPORT_FILE", "GENAI_CONFIG", "ExportManifest", "is_onnx_export", "load_manifest"]

#: The file onnxruntime-genai reads a model folder from (written by its model builder).
GENAI_CONFIG = "genai_config.json"
#: The file ``edgecloud export onnx`` writes next to it.
EXPORT_FILE = "edgecloud.json"


class ExportManifest(BaseModel):
    """``edgecloud.json``: where an export came from and how to prompt it without the GGUF file."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    format: int = 1
    #: Catalogue name (or file stem) of the source model.
    model: str
    source_path: str
    source_bytes: int
    #: GGUF ``general.architecture`` (llama, qwen2).
    architecture: str
    precision: str = "int4"
    block_size: int = 32
    execution_provider: str = "cpu"
    chat_template: str
    bos_token: str = ""
    eos_token: str = ""
    #: Ids llama.cpp ends generation at for the source file.
    eog_token_ids: list[int]
    context_length: int


def is_onnx_export(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a folder onnxruntime-genai can load (it holds ``genai_config.json``)."""
    return (Path(path).expanduser() / GENAI_CONFIG).is_file()


def load_manifest(folder: str | os.PathLike[str]) -> ExportManifest:
    """The manifest of an export folder.

    ModelNotFoundError when ``folder`` is not an onnxruntime-genai folder or was not built by
    ``edgecloud export onnx``; ModelIntegrityError when ``edgecloud.json`` is unreadable.
    """
    folder = Path(folder).expanduser()
    rebuild = f"build one with `edgecloud export onnx --model NAME --out {folder}`"
    if not is_onnx_export(folder):
        raise ModelNotFoundError(f"{folder} is not an ONNX Runtime GenAI model folder (no {GENAI_CONFIG}); {rebuild}")
    path = folder / EXPORT_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{folder} was not built by edgecloud (no {EXPORT_FILE}); {rebuild}")
    try:
        return ExportManifest.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValidationError) as exc:
        raise ModelIntegrityError(f"{path} is unreadable ({exc}); rebuild the folder with `edgecloud export onnx`") from exc
