"""Importing llama-cpp-python once, with its log levels read correctly.

This module owns :func:`import_llama_cpp`, the one place edgecloud imports ``llama_cpp``
(the llama.cpp backends and the torch engine's tokenizer), and the two small helpers every
llama.cpp user needs: :func:`token_piece` (a token's bytes) and :func:`physical_cores` (threads). Besides a clear
:class:`~edgecloud.errors.BackendUnavailableError` when the package is missing, it installs a
log callback that reads ggml's current level numbers (``NONE 0, DEBUG 1, INFO 2, WARN 3,
ERROR 4, CONT 5``). llama-cpp-python 0.3.x still maps them by an older enum in which 3 was
ERROR, so with ``verbose=False`` every llama.cpp *warning* reached stderr: a vocabulary-only
load (the torch engine's tokenizer) printed ``n_ctx_seq (512) > n_ctx_train (0) -- possible
training context overflow`` into the middle of ``edgecloud chat --backend torch``'s output.

The callback keeps llama-cpp-python's switch: it prints what its ``llama-cpp-python`` logger's
level lets through (``verbose=True`` sets DEBUG: everything, as before; ``verbose=False`` sets
ERROR: errors only).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from types import ModuleType
from typing import Any

from ..errors import BackendUnavailableError
from .hardware import cpu_budget

__all__ = ["GGML_LOG_LEVELS", "import_llama_cpp", "physical_cores", "token_piece"]

#: ggml's log level numbers (ggml.h, ``enum ggml_log_level``) as Python logging levels.
GGML_LOG_LEVELS: dict[int, int] = {
    0: logging.CRITICAL,  # NONE: printed whatever the level
    1: logging.DEBUG,
    2: logging.INFO,
    3: logging.WARNING,
    4: logging.ERROR,
}
_CONT = 5  # continues the previous line at its level

_lock = threading.Lock()
_last_level = logging.CRITICAL
_callback: object = None  # the installed ctypes callback (kept alive while llama.cpp may call it); None: not yet


def _install(llama_cpp: ModuleType) -> None:
    global _callback
    logger = logging.getLogger("llama-cpp-python")  # the logger llama-cpp-python's verbose= sets

    @llama_cpp.llama_log_callback
    def callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        global _last_level
        py_level = _last_level if level == _CONT else GGML_LOG_LEVELS.get(level, logging.INFO)
        _last_level = py_level
        if py_level >= logger.getEffectiveLevel():
            print(text.decode("utf-8", errors="replace"), end="", flush=True, file=sys.stderr)

    _callback = callback
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))


def import_llama_cpp(needed_by: str = "the llama.cpp edge backend") -> ModuleType:
    """The ``llama_cpp`` module, with the log callback above installed (once per process).

    Raises :class:`BackendUnavailableError` naming ``needed_by`` and the install command when
    llama-cpp-python is not installed.
    """
    try:
        import llama_cpp
    except ImportError as exc:
        raise BackendUnavailableError(
            f"{needed_by} needs llama.cpp, which is not installed; run: pip install 'edgecloud[edge]'"
        ) from exc
    with _lock:
        if _callback is None:
            _install(llama_cpp)
    return llama_cpp


def physical_cores() -> int:
    """llama.cpp's compute threads: the physical cores this process may use (its CPU affinity
    and cgroup quota count, see :func:`~edgecloud.runtime.hardware.cpu_budget`)."""
    return cpu_budget().threads


def token_piece(lib: Any, vocab: Any, token: int, *, special: bool = False) -> bytes:
    """The bytes llama.cpp renders for ``token`` (control tokens as their text when ``special``,
    else as nothing)."""
    buf = ctypes.create_string_buffer(64)
    n = lib.llama_token_to_piece(vocab, token, buf, 64, 0, special)
    if n < 0:  # llama_token_to_piece answers -(needed size) when the buffer is short
        buf = ctypes.create_string_buffer(-n)
        n = lib.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[:n]
