"""Counters every on-device runtime keeps: requests, prompt tokens (and how many were reused), answer tokens.

This module owns :class:`RuntimeStats`; each runtime extends it with what only it knows
(llama.cpp: prefix-cache saves and restores; torch: ops that fell back to the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RuntimeStats"]


@dataclass
class RuntimeStats:
    """Counters since the runtime loaded."""

    requests: int = 0
    prompt_tokens: int = 0
    #: Prompt tokens whose KV was reused instead of evaluated.
    cached_tokens: int = 0
    completion_tokens: int = 0
    #: Prompt tokens evaluated (``prompt_tokens - cached_tokens``).
    prefill_tokens: int = 0

    def started(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one request whose prompt of ``prompt_tokens`` reused ``cached_tokens`` of KV."""
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.prefill_tokens += prompt_tokens - cached_tokens
