"""The benchmark scripts (``benchmarks/*.py``) as modules, for the tests that run a slice of them
as CI does (the scripts import their siblings by name, so their folder is on the path while one loads)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
