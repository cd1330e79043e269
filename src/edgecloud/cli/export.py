"""``edgecloud export``: convert a catalogue model (or a GGUF file) into another runtime's format.

``export onnx`` builds an ONNX Runtime GenAI folder with INT4 MatMulNBits weights
(:mod:`edgecloud.cli.export_onnx`); ``export coreml`` builds a stateful INT4 ``.mlpackage``
(:mod:`edgecloud.cli.export_coreml`). Each target lives in its own module; this one only
groups them.
"""

from __future__ import annotations

import typer

from . import export_coreml as _coreml
from . import export_onnx as _onnx

__all__ = ["app"]

app = typer.Typer(help="Export a model to another runtime: ONNX Runtime GenAI or Core ML.", no_args_is_help=True)
app.command("onnx", help="Build an ONNX Runtime GenAI folder (INT4, CPU) from a GGUF model.")(_onnx.onnx_command)
app.command("coreml", help="Build a stateful INT4 Core ML .mlpackage (iOS 18 / macOS 15) from a GGUF model.")(
    _coreml.coreml_command
)
