"""The text sample that ships with edgecloud for calibrating and judging lower-precision weights.

Contiguous passages of real code (Python, C) and real prose, cut from PSF- and BSD-licensed
files (``data/README.md`` names each source, its line range and its licence). Two disjoint
splits: ``"calibration"``, what quantization decisions (which layers to keep in high
precision) are made on, and ``"eval"``, what the result is judged on, so a decision is never
scored on the text that made it.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["SAMPLE_SPLITS", "load_sample"]

#: The sample's splits: ``data/<split>/<kind>-<name>.txt``.
SAMPLE_SPLITS = ("calibration", "eval")


def load_sample(split: str = "eval") -> dict[str, str]:
    """Passages of one split as ``{"code:textwrap.py": text, "prose:...": text, ...}``, sorted by name."""
    if split not in SAMPLE_SPLITS:
        raise ValueError(f"unknown sample split {split!r}; allowed: {', '.join(SAMPLE_SPLITS)}")
    folder = resources.files(__package__).joinpath("data", split)
    passages = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".txt"):
            kind, _, name = entry.name.removesuffix(".txt").partition("-")
            passages[f"{kind}:{name}"] = entry.read_text(encoding="utf-8")
    return passages
