"""What an answer's own text and token logprobs say, read on the request path.

This module owns :func:`extract_code` (the Python code in a model answer), :func:`normalise`
(text for comparing short answers) and :func:`logprob_summary` (an answer's token logprobs in
four numbers): what the cascade's confidence check (:mod:`edgecloud.router.cascade`) reads from
an edge answer, and what grading and labelling (:mod:`edgecloud.router.training`) reuse.
"""

from __future__ import annotations

import math
import re

__all__ = ["extract_code", "logprob_summary", "normalise"]


def extract_code(answer: str) -> str:
    """The Python code in a model answer: its fenced blocks, else the answer itself."""
    blocks = re.findall(r"```(?:python|py|Python)?[^\n]*\n(.*?)(?:```|\Z)", answer, re.DOTALL)
    if blocks:
        # Several blocks: keep the ones with definitions (examples of use often come after).
        defs = [b for b in blocks if re.search(r"^\s*(def|class|import|from)\s", b, re.MULTILINE)]
        return "\n\n".join(defs or blocks)
    return answer


def normalise(text: str) -> str:
    """Case-folded, whitespace-collapsed text (for comparing short answers)."""
    return " ".join(text.casefold().split())


def logprob_summary(logprobs: list[float]) -> dict[str, float]:
    """Mean, minimum, 10th percentile and mean of the worst 10% of an answer's token logprobs."""
    if not logprobs:
        return {"mean": 0.0, "min": 0.0, "p10": 0.0, "tail_mean": 0.0}
    ordered = sorted(logprobs)
    tail = ordered[: max(1, math.ceil(len(ordered) / 10))]
    return {
        "mean": round(sum(ordered) / len(ordered), 5),
        "min": round(ordered[0], 5),
        "p10": round(ordered[int(0.1 * (len(ordered) - 1))], 5),
        "tail_mean": round(sum(tail) / len(tail), 5),
    }
