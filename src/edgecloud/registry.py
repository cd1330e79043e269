"""Edge backends by name: the built-in runtimes and those installed packages register.

This module owns :func:`edge_backend_class` and :func:`make_edge_backend`. The built-in runtimes
(``llamacpp``, ``torch``, ``onnx``) are looked up in :data:`EDGE_BACKENDS` and imported only when
asked for (torch and onnxruntime are optional); a package adds its own through the entry point
group ``edgecloud.edge_runtimes`` (``myruntime = "mypackage.backend:MyBackend"``, a
:class:`~edgecloud.backend.Backend` subclass), as ``llm`` plugins register models. Each class
builds itself from the settings with :meth:`~edgecloud.backend.Backend.create`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from .backend import Backend
from .config import EDGE_RUNTIME_ENTRY_POINTS, EDGE_RUNTIMES, CacheSettings, edge_runtime_names
from .errors import ConfigError

__all__ = ["EDGE_BACKENDS", "edge_backend_class", "make_edge_backend"]

#: The built-in edge runtimes: name -> ``module:Class``.
EDGE_BACKENDS: dict[str, str] = {
    "llamacpp": "edgecloud.edge.llamacpp:LlamaCppBackend",
    "torch": "edgecloud.edge.torch:TorchBackend",
    "onnx": "edgecloud.edge.onnx:OnnxBackend",
}
assert tuple(EDGE_BACKENDS) == EDGE_RUNTIMES


def edge_backend_class(runtime: str) -> type[Backend]:
    """The backend class registered as ``runtime`` (imported now)."""
    target = EDGE_BACKENDS.get(runtime)
    if target is None:
        found = [ep for ep in entry_points(group=EDGE_RUNTIME_ENTRY_POINTS) if ep.name == runtime]
        if not found:
            raise ConfigError(f"unknown edge runtime {runtime!r}; use one of {', '.join(edge_runtime_names())}")
        loaded = found[0].load()
    else:
        module, _, name = target.partition(":")
        loaded = vars(importlib.import_module(module))[name]
    if not (isinstance(loaded, type) and issubclass(loaded, Backend)):
        raise ConfigError(f"the edge runtime {runtime!r} is registered as {loaded!r}, which is not a Backend class")
    return loaded


def make_edge_backend(runtime: str, model: str, *, n_ctx: int | None = None, device: str = "this",
                      cache: CacheSettings | None = None, kv_events: Callable[[str, str], None] | None = None,
                      speculate: str | None = None) -> Backend:
    """The edge backend for ``runtime``; nothing heavy is imported before it is asked for.

    ``model`` is a catalogue name or GGUF path, or for ``onnx`` an ``edgecloud export onnx`` folder
    (checked here, so a folder that is not an export fails before anything loads).
    """
    return edge_backend_class(runtime).create(model, n_ctx=n_ctx, device=device, cache=cache, kv_events=kv_events,
                                              speculate=speculate)
