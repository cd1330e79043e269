"""A bounded, byte-counted LRU of saved KV states keyed by the token prefix they hold.

This module owns :class:`PrefixCache` and :class:`SavedPrefix`. A runtime saves the KV state
of a token sequence (a system prompt, a conversation it is about to overwrite) and later asks
for the entry sharing the longest common prefix with a new prompt: restoring that state and
truncating it to the common prefix replaces recomputing those tokens. The cache knows
nothing about llama.cpp; a state is an opaque object whose size the runtime reports.

Policy: the entry of least value goes first, value = tokens (the compute restoring it saves)
x recency (halved for every :data:`RECENCY_HALF_LIFE` uses of other entries since its last);
pinned entries (the warm system prompt) only when nothing else is left. An entry whose tokens
are a prefix of a newly saved one is dropped, since the new entry serves every prompt the old
one did. ``on_evict`` hears of the entries evicted for room (the next tier keeps them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["PrefixCache", "SavedPrefix", "common_prefix_len_np", "RECENCY_HALF_LIFE"]

#: An entry's value halves for every this many uses of other entries since its own last use.
RECENCY_HALF_LIFE = 4


def common_prefix_len_np(a: npt.NDArray[np.intc], b: npt.NDArray[np.intc]) -> int:
    """Longest common prefix of two int token arrays (vectorised)."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


@dataclass(eq=False)
class SavedPrefix:
    """The KV state of exactly ``tokens``, as saved by the runtime."""

    tokens: npt.NDArray[np.intc]
    state: Any
    nbytes: int
    pinned: bool = False
    hits: int = field(default=0)
    #: The cache's use counter when this entry was last saved or used.
    last_used: int = field(default=0)


class PrefixCache:
    """LRU of :class:`SavedPrefix` bounded by the sum of their ``nbytes``."""

    def __init__(self, capacity_bytes: int, on_evict: Callable[[SavedPrefix], None] | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError("prefix cache capacity must be >= 0 bytes")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[int, SavedPrefix] = OrderedDict()
        self.nbytes = 0
        self._on_evict = on_evict
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[SavedPrefix]:
        """Entries from least to most recently used."""
        return list(self._entries.values())

    def best_match(self, tokens: Sequence[int] | npt.NDArray[np.intc]) -> tuple[SavedPrefix | None, int]:
        """The entry sharing the longest common prefix with ``tokens``, and that length."""
        arr = np.asarray(tokens, dtype=np.intc)
        best: SavedPrefix | None = None
        best_len = 0
        for entry in self._entries.values():
            n = common_prefix_len_np(entry.tokens, arr)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    def holds(self, tokens: npt.NDArray[np.intc]) -> bool:
        """True when an entry holds exactly ``tokens`` (or a longer sequence starting with them)."""
        for entry in self._entries.values():
            if len(entry.tokens) >= len(tokens) and np.array_equal(entry.tokens[: len(tokens)], tokens):
                return True
        return False

    def touch(self, entry: SavedPrefix) -> None:
        """Mark ``entry`` as just used."""
        key = id(entry)
        if key in self._entries:
            self._entries.move_to_end(key)
            entry.hits += 1
            self._clock += 1
            entry.last_used = self._clock

    def _value(self, entry: SavedPrefix) -> float:
        return len(entry.tokens) * 0.5 ** ((self._clock - entry.last_used) / RECENCY_HALF_LIFE)

    def put(self, entry: SavedPrefix) -> bool:
        """Store ``entry``, evicting as needed; False when it alone exceeds the capacity."""
        if entry.nbytes > self.capacity_bytes:
            return False
        for old in list(self._entries.values()):
            covered = len(old.tokens) <= len(entry.tokens) and np.array_equal(
                old.tokens, entry.tokens[: len(old.tokens)]
            )
            if covered and not old.pinned:
                self._remove(old)
        while self.nbytes + entry.nbytes > self.capacity_bytes:
            unpinned = [e for e in self._entries.values() if not e.pinned]
            victim = min(unpinned, key=self._value) if unpinned else next(iter(self._entries.values()))
            self._remove(victim)
            if self._on_evict is not None:
                self._on_evict(victim)
        self._clock += 1
        entry.last_used = self._clock
        self._entries[id(entry)] = entry
        self.nbytes += entry.nbytes
        return True

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self.nbytes = 0

    def _remove(self, entry: SavedPrefix) -> None:
        del self._entries[id(entry)]
        self.nbytes -= entry.nbytes
