"""KV tiers for one llama.cpp context: the live context, a RAM LRU, and files on disk.

This module owns :class:`LlamaKVTiers`, :class:`SlotKVStore` (the serving engine's slots) and
:class:`DiskWriter`. The llama.cpp runtimes (the
edge backend and the serving engine's slots) hand it their context; it saves and restores the
KV of sequence 0 through llama.cpp's per-sequence state API:

- **RAM** (:class:`~edgecloud.runtime.prefix_cache.PrefixCache`): a context about to be
  overwritten is copied here; a later prompt sharing its prefix restores it (a memcpy).
- **Disk** (:class:`~edgecloud.runtime.kv_disk.DiskTier`): states evicted from RAM spill here,
  and after an answer the context is written here in the background (when it belongs to a
  session or is long enough to be worth it), so the next turn finds it after a restart. A
  prompt whose longest saved prefix is on disk loads it instead of recomputing.

Writes happen on one background thread (:class:`DiskWriter`): the request that caused them
never waits for the disk; :meth:`LlamaKVTiers.flush` waits (the backend's ``close`` does).
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .kv_disk import DiskTier, KVEvents, StateKey
from .prefix_cache import PrefixCache, SavedPrefix, common_prefix_len_np

__all__ = ["DiskWriter", "KVTierCounts", "LlamaKVTiers", "PERSIST_MIN_TOKENS", "STASH_MIN_TOKENS", "SlotKVStore"]

logger = logging.getLogger("edgecloud.kv_cache")

#: Only save the context before overwriting it when at least this many tokens would be lost;
#: a chat's next turn drops a token or two of the last answer, which is not worth a copy.
STASH_MIN_TOKENS = 16
#: After an answer, a context without a session is written to disk only from this many tokens
#: (shorter ones recompute in well under a second); a session's context always is.
PERSIST_MIN_TOKENS = 256
#: A saved state on disk is loaded only when it saves at least this many tokens over what the
#: RAM tiers offer (reading a file has a fixed cost).
DISK_MIN_GAIN = 32


@dataclass
class KVTierCounts:
    """What the tiers did since load."""

    #: States restored from the RAM LRU / from disk.
    restores: int = 0
    disk_restores: int = 0
    #: States copied into the RAM LRU / written to disk.
    saves: int = 0
    disk_saves: int = 0


class DiskWriter:
    """One background thread writing states to a :class:`DiskTier` (newest job per file wins)."""

    def __init__(self, disk: DiskTier, on_saved: Callable[[], None] | None = None) -> None:
        self.disk = disk
        self._on_saved = on_saved
        self._jobs: queue.Queue[tuple[npt.NDArray[np.intc], Any, int, str | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, tokens: npt.NDArray[np.intc], payload: Any, nbytes: int, session: str | None) -> None:
        """Queue a write; ``payload`` must not change afterwards (pass a copy)."""
        self._jobs.put((tokens, payload, nbytes, session))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                tokens, payload, nbytes, session = job
                if self.disk.save(tokens, payload, nbytes, session) and self._on_saved is not None:
                    self._on_saved()
            except Exception:  # noqa: BLE001 - a failed write never fails a request
                logger.exception("writing a KV state failed")
            finally:
                self._jobs.task_done()

    def flush(self) -> None:
        """Wait until every queued write is done."""
        self._jobs.join()

    def close(self) -> None:
        """Finish the queued writes and stop the thread."""
        self._jobs.put(None)
        self._thread.join()


class LlamaKVTiers:
    """The RAM and disk tiers of one llama.cpp context (``llm``: a ``llama_cpp.Llama``)."""

    def __init__(self, ram_bytes: int, disk_bytes: int = 0, disk_dir: str | Path | None = None,
                 events: KVEvents | None = None) -> None:
        if ram_bytes < 0 or disk_bytes < 0:
            raise ValueError("KV tier budgets must be >= 0 bytes")
        self.ram = PrefixCache(ram_bytes, on_evict=self._spill) if ram_bytes > 0 else None
        self._disk_bytes = disk_bytes
        self._disk_dir = Path(disk_dir).expanduser() if disk_dir is not None else None
        self._events = events
        self.disk: DiskTier | None = None
        self._writer: DiskWriter | None = None
        self._lib: Any = None
        self._llm: Any = None
        self.counts = KVTierCounts()

    def attach(self, lib: Any, llm: Any, key: Callable[[], StateKey]) -> None:
        """Serve ``llm``'s context (after the model loaded); ``key()`` says what its states fit
        (asked only when there is a disk tier: it may hash the model file)."""
        self._lib, self._llm = lib, llm
        if self._disk_bytes > 0 and self._disk_dir is not None:
            self.disk = DiskTier(self._disk_dir, key(), self._disk_bytes, events=self._events)
            self._writer = DiskWriter(self.disk, on_saved=self._count_disk_save)

    def _count_disk_save(self) -> None:
        self.counts.disk_saves += 1

    def _event(self, tier: str, event: str) -> None:
        if self._events is not None:
            self._events(tier, event)

    # ------------------------------------------------------------------ state bytes

    def _copy_state(self) -> tuple[npt.NDArray[np.intc], Any, int] | None:
        """The live context's tokens and a copy of its KV (None when empty or refused)."""
        llm, lib = self._llm, self._lib
        n = llm.n_tokens
        if n == 0:
            return None
        llm._ctx.kv_cache_seq_rm(0, n, -1)  # nothing past the tokens we name
        size = lib.llama_state_seq_get_size(llm.ctx, 0)
        if size == 0:
            return None
        buf = (ctypes.c_uint8 * size)()
        written = int(lib.llama_state_seq_get_data(llm.ctx, buf, size, 0))
        if written == 0:
            return None
        return llm.input_ids[:n].copy(), buf, written

    def _load_state(self, tokens: npt.NDArray[np.intc], state: Any, nbytes: int) -> bool:
        llm = self._llm
        self.forget()
        if self._lib.llama_state_seq_set_data(llm.ctx, state, nbytes, 0) == 0:
            self.forget()
            return False
        n = len(tokens)
        llm.input_ids[:n] = tokens
        llm.n_tokens = n
        return True

    def forget(self) -> None:
        """Empty the live context. data=False marks every cell free without zeroing the buffers
        (a memset of the whole n_ctx cache would cost tens of ms per cold request)."""
        self._llm.n_tokens = 0
        memory = self._lib.llama_get_memory(self._llm.ctx)
        if memory is not None:
            self._lib.llama_memory_clear(memory, False)

    # ------------------------------------------------------------------ RAM

    def save(self, *, pinned: bool = False) -> None:
        """Copy the live context's KV (exactly its tokens) into the RAM LRU."""
        if self.ram is None or self._llm.n_tokens == 0:
            return
        if self.ram.holds(self._llm.input_ids[: self._llm.n_tokens]):
            return
        copied = self._copy_state()
        if copied is None:
            return
        tokens, buf, nbytes = copied
        if self.ram.put(SavedPrefix(tokens=tokens, state=buf, nbytes=nbytes, pinned=pinned)):
            self.counts.saves += 1

    def _spill(self, entry: SavedPrefix) -> None:
        """RAM -> disk: an evicted state goes to disk unless the disk holds it already."""
        self._event("ram", "evict")
        if self._writer is None or self.disk is None:
            return
        if any(len(e.tokens) >= len(entry.tokens) and np.array_equal(e.tokens[: len(entry.tokens)], entry.tokens)
               for e in self.disk.entries()):
            return
        self._writer.submit(entry.tokens, entry.state, entry.nbytes, None)

    # ------------------------------------------------------------------ the prompt

    def reuse(self, prompt: list[int], session: str | None = None) -> int:
        """Make the live context hold the longest saved prefix of ``prompt`` any tier has; return its
        length (the caller trims the context to what it keeps and evaluates the rest)."""
        llm = self._llm
        arr = np.asarray(prompt, dtype=np.intc)
        n_live = llm.n_tokens
        reuse = common_prefix_len_np(llm.input_ids[:n_live], arr)
        if self.ram is not None:
            entry, n_saved = self.ram.best_match(arr)
            if n_live - reuse >= STASH_MIN_TOKENS:
                self.save()
            if entry is not None and n_saved > reuse:
                if self._load_state(entry.tokens, entry.state, entry.nbytes):
                    reuse = n_saved
                    self.counts.restores += 1
                    self._event("ram", "hit")
                else:
                    reuse = 0
                self.ram.touch(entry)
        elif n_live - reuse >= STASH_MIN_TOKENS and self.disk is not None:
            self.persist(session=None, min_tokens=STASH_MIN_TOKENS)
        if self.disk is not None and len(prompt) - reuse >= DISK_MIN_GAIN:
            found, n_disk = self.disk.best_match(arr, session)
            if found is not None and n_disk - reuse >= DISK_MIN_GAIN:
                reuse = self._restore_from_disk(found, n_disk, reuse)
            elif found is None and reuse == 0:
                self._event("disk", "miss")
        return reuse

    def _restore_from_disk(self, found: Any, n_disk: int, reuse: int) -> int:
        assert self.disk is not None
        loaded = self.disk.load_state(found)
        if loaded is None:
            return reuse  # discarded; the live context is untouched
        if not self._load_state(found.tokens, *loaded):
            # llama.cpp refused a file that passed our checks: never keep it
            self.disk.discard(found, "refused", "llama.cpp refused the state")
            return 0
        self.counts.disk_restores += 1
        return n_disk

    def restore_session(self, session: str) -> int:
        """Load session ``session``'s saved state into the live context now (what the context held
        goes to the RAM tier); the tokens restored, 0 when none is saved or it cannot be used."""
        if self.disk is None:
            return 0
        entry = self.disk.session_entry(session)
        if entry is None:
            return 0
        if self._llm.n_tokens >= STASH_MIN_TOKENS:
            self.save()
        return self._restore_from_disk(entry, len(entry.tokens), 0)

    def persist(self, session: str | None, *, min_tokens: int = PERSIST_MIN_TOKENS) -> bool:
        """Queue the live context for the disk (a session's always, others from ``min_tokens``)."""
        if self._writer is None or self._llm.n_tokens == 0:
            return False
        if session is None and self._llm.n_tokens < min_tokens:
            return False
        copied = self._copy_state()
        if copied is None:
            return False
        self._writer.submit(*copied, session)
        return True

    def flush(self) -> None:
        """Wait for queued disk writes."""
        if self._writer is not None:
            self._writer.flush()

    def clear(self) -> None:
        """Forget the RAM tier (the disk keeps its files; see :meth:`DiskTier.clear`)."""
        if self.ram is not None:
            self.ram.clear()

    def close(self) -> None:
        """Finish queued writes, drop the RAM tier and let go of the context."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.ram is not None:
            self.ram.clear()
        self._llm = self._lib = None


class SlotKVStore:
    """Saved KV of the serving engine's slots: prefixes a slot is about to drop go to a RAM LRU
    (and from there to disk when a disk tier is given), and a request whose prompt starts with
    one is given it back instead of prefilling it. States are llama.cpp sequence states, so one
    saved from one slot loads into any other."""

    def __init__(self, ram_bytes: int, disk: DiskTier | None = None, events: KVEvents | None = None) -> None:
        self._events = events
        self.disk = disk
        self._writer = DiskWriter(disk) if disk is not None else None
        self.ram = PrefixCache(ram_bytes, on_evict=self._spill)
        self.saves = self.restores = 0

    def _event(self, tier: str, event: str) -> None:
        if self._events is not None:
            self._events(tier, event)

    def _spill(self, entry: SavedPrefix) -> None:
        self._event("ram", "evict")
        if self._writer is not None:
            self._writer.submit(entry.tokens, entry.state, entry.nbytes, None)

    def keep(self, tokens: list[int], state: Any, nbytes: int) -> None:
        """Save a slot's state of exactly ``tokens`` (about to be overwritten)."""
        arr = np.asarray(tokens, dtype=np.intc)
        if self.ram.holds(arr):
            return
        if self.ram.put(SavedPrefix(tokens=arr, state=state, nbytes=nbytes)):
            self.saves += 1
            self._event("ram", "save")
        elif self._writer is not None:  # larger than the whole RAM tier: straight to disk
            self._writer.submit(arr, state, nbytes, None)

    def flush(self) -> None:
        """Wait for queued disk writes."""
        if self._writer is not None:
            self._writer.flush()

    def find(self, prompt: list[int], better_than: int) -> tuple[npt.NDArray[np.intc], Any, int] | None:
        """The saved state sharing the longest prefix with ``prompt`` when it beats ``better_than``
        tokens by :data:`DISK_MIN_GAIN`: (its tokens, state, bytes); None otherwise."""
        arr = np.asarray(prompt, dtype=np.intc)
        entry, n = self.ram.best_match(arr)
        if entry is not None and n - better_than >= DISK_MIN_GAIN:
            self.ram.touch(entry)
            self._event("ram", "hit")
            return entry.tokens, entry.state, entry.nbytes
        if self.disk is not None:
            found, n_disk = self.disk.best_match(arr)
            if found is not None and n_disk - better_than >= DISK_MIN_GAIN:
                loaded = self.disk.load_state(found)
                if loaded is not None:
                    return found.tokens, *loaded
        return None

    def close(self) -> None:
        """Finish the queued disk writes."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.ram.clear()
