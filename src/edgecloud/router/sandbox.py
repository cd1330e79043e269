"""Run untrusted Python (model-written code and its tests) in a separate, limited process.

Used to grade answers when labelling outcomes and by the cascade's post-hoc checks. The
child runs ``python -I`` (no user site, no environment variables honoured) in an empty
temporary directory, with CPU-time, address-space, file-size and process limits, and is
killed when the wall-clock timeout passes. This is a guard against accidents (infinite
loops, memory blow-ups, stray files), not a security boundary against hostile code: run
labelling on a machine you do not mind a model's code touching.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["SandboxResult", "run_python"]

_MEMORY_BYTES = 1 << 30
_OUTPUT_LIMIT = 4000


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed program ended: ``passed`` is exit status 0 within the time limit."""

    passed: bool
    returncode: int | None
    timed_out: bool
    output: str


def _limits(cpu_seconds: int) -> None:  # pragma: no cover - runs in the child
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_BYTES, _MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    os.setsid()


def run_python(source: str, *, timeout: float = 10.0) -> SandboxResult:
    """Run ``source`` as a script in a fresh interpreter; never raises for what the code does."""
    with tempfile.TemporaryDirectory(prefix="edgecloud-sandbox-") as cwd:
        path = os.path.join(cwd, "program.py")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(source)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "HOME": cwd}
        preexec = (lambda: _limits(max(1, int(timeout) + 1))) if os.name == "posix" else None
        try:
            proc = subprocess.run(
                [sys.executable, "-I", path], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                capture_output=True, timeout=timeout, preexec_fn=preexec, check=False,
            )
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"") + (exc.stderr or b"")
            return SandboxResult(False, None, True, out.decode("utf-8", "replace")[-_OUTPUT_LIMIT:])
        out = (proc.stdout + proc.stderr).decode("utf-8", "replace")[-_OUTPUT_LIMIT:]
        return SandboxResult(proc.returncode == 0, proc.returncode, False, out)
