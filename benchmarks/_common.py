"""Helpers shared by the benchmark scripts: the CPU lock, model lookup, fresh child processes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from edgecloud.store import resolve_model
from edgecloud.store.cache import exclusive_lock

#: Benchmarks that time things take this lock so two never share the cores.
LOCK_PATH = Path("/tmp/edgecloud-bench.lock")
DEFAULT_EDGE_MODEL = "qwen2.5-coder-0.5b-instruct-q4"


def bench_lock() -> contextlib.AbstractContextManager[None]:
    """Exclusive use of the CPU cores for timing (other benchmarks take the same lock)."""
    return exclusive_lock(LOCK_PATH)


def model_path(name_or_path: str | Path = DEFAULT_EDGE_MODEL) -> Path:
    """A verified local file for a catalogue name or path (pulled on first use)."""
    return resolve_model(name_or_path, pull=True)


def run_child(script: str, mode: str, model: Path) -> dict[str, Any]:
    """Run ``script --child MODE --model MODEL`` in a fresh process; its stdout is one JSON object."""
    out = subprocess.run(
        [sys.executable, script, "--child", mode, "--model", str(model)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)
