"""``edgecloud bridge --stdio``: the bridge protocol over a child process's stdin and stdout.

:func:`serve_stdio` reads request lines from ``stdin`` on a reader thread and hands each to
:meth:`Bridge.handle <edgecloud.bridge.server.Bridge.handle>`; responses and notifications
are written to ``stdout`` one line each (UTF-8, ``\\n``-terminated, flushed at once).

- Lines are read with a bounded ``readline``: at most ``max_line_bytes`` (1 MiB by default)
  of a line are ever held. A longer line is discarded as it is read and answered with
  ``-32600`` (id null, ``data.limit``), so a 10 MB line costs no more memory than a short one.
- Blank lines are ignored; a trailing ``\\r`` is dropped.
- EOF on stdin (the host closed it or died): in-flight requests are cancelled, each answers
  (``-32800``) within the drain timeout, and :func:`serve_stdio` returns 0.
- After ``shutdown`` is answered it returns 0 without reading further.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

from .server import DEFAULT_MAX_LINE_BYTES, Bridge

__all__ = ["serve_stdio", "read_lines"]

_DISCARD_BLOCK = 64 * 1024


def read_lines(stream: BinaryIO, max_line_bytes: int) -> Iterator[bytes | None]:
    """Each line without its line end, or None for a line longer than ``max_line_bytes`` (skipped)."""
    while True:
        line = stream.readline(max_line_bytes + 1)
        if not line:
            return
        if line.endswith(b"\n"):
            yield line.rstrip(b"\r\n")
        elif len(line) <= max_line_bytes:
            yield line.rstrip(b"\r")  # the last line, without a newline before EOF
        else:
            while (rest := stream.readline(_DISCARD_BLOCK)) and not rest.endswith(b"\n"):
                pass
            yield None


def serve_stdio(
    stdin: BinaryIO,
    stdout: BinaryIO,
    *,
    bridge: Bridge | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    **client_kwargs: Any,
) -> int:
    """Serve ``bridge`` (or a new ``Bridge(**client_kwargs)``) until EOF or ``shutdown``; the exit code."""
    if bridge is None:
        bridge = Bridge(max_line_bytes=max_line_bytes, **client_kwargs)
    else:
        bridge.max_line_bytes = max_line_bytes
    failed: list[BaseException] = []

    def emit(line: str) -> None:
        stdout.write(line.encode("utf-8", "replace") + b"\n")
        stdout.flush()

    def read() -> None:
        try:
            for line in read_lines(stdin, max_line_bytes):
                if bridge.stopped.is_set():
                    break
                if line is None:
                    bridge.reject_overlong(emit)
                elif line.strip():
                    bridge.handle(line, emit)
        except Exception as exc:  # noqa: BLE001 - stdin itself failed: stop serving, report it
            failed.append(exc)
        finally:
            bridge.close()

    reader = threading.Thread(target=read, name="bridge-stdin", daemon=True)
    reader.start()
    bridge.stopped.wait()
    return 1 if failed else 0
