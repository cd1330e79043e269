"""The disk tier of saved KV states: prefixes that outlive the process.

This module owns :class:`DiskTier`, :class:`StateKey` and :class:`KVEvents`. A runtime that can
serialise a sequence's KV (llama.cpp's per-sequence state API) writes it here, and a later
process finds the entry sharing the longest token prefix with its prompt and loads it instead
of recomputing those tokens. It knows nothing about llama.cpp: a state is bytes.

**What a file may be loaded into.** States live under ``<dir>/<namespace>/`` where the namespace
is a hash of the :class:`StateKey` (model sha256, runtime and version, ``n_ctx``, KV type); the
file's header repeats the key, and a file whose key differs (copied between folders, another
runtime build) is discarded, never loaded into the wrong model.

**File format** (``*.kv``): an 8-byte magic, a little-endian u32 header length, a JSON header
(key, token count, payload length, CRC-32 of tokens + payload, session, time), the tokens as
int32, then the payload. Written to a temporary file and renamed into place, so a reader sees
a whole old file or a whole new one, also with two processes writing one session. A file that
is truncated, fails its checksum or cannot be parsed is deleted and recomputed.

**Budget.** The files under ``dir`` (every model's) never exceed ``capacity_bytes``: before a
write, files are evicted by least value, value = bytes x recency (bytes stand for the compute
a state saves: both grow with its tokens and the model's size; recency halves every
:data:`RECENCY_HALF_LIFE_S`). A state larger than the whole budget is not written.

**Sessions.** A state saved with a session name goes to ``s-<hash of name>.kv`` (one file per
conversation, replaced each turn); without one, to ``p-<hash of tokens>.kv``. Finding a state
needs no name: every file in the namespace is matched by token prefix. Saving a state drops
the files whose tokens it extends (the new one serves every prompt they did).

Nothing here raises to the caller on I/O trouble (full disk, read-only dir, a file another
process replaced): the event is logged, counted through ``events`` (tier ``disk``, event
``write_error``, ``corrupt``, ``foreign``, ...) and the caller recomputes.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .prefix_cache import common_prefix_len_np

__all__ = ["DiskEntry", "DiskTier", "KVEvents", "StateKey", "RECENCY_HALF_LIFE_S", "session_file_name"]

logger = logging.getLogger("edgecloud.kv_cache")

MAGIC = b"ECKVST01"
_HEADER_LEN = struct.Struct("<I")
#: A state's value for eviction halves for every this many seconds since it was last used.
RECENCY_HALF_LIFE_S = 6 * 3600.0
#: Headers are small JSON; anything larger is not one of ours.
_MAX_HEADER = 64 * 1024

#: ``events(tier, event)``: called once per cache event (hit, miss, save, evict, corrupt, ...).
KVEvents = Callable[[str, str], None]


@dataclass(frozen=True)
class StateKey:
    """What a saved state belongs to: only a process with the same key may load it."""

    model_sha256: str
    runtime: str
    n_ctx: int
    kv_type: str

    @property
    def namespace(self) -> str:
        """The folder name for this key's states."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass(eq=False)
class DiskEntry:
    """One state file as indexed (its tokens read, its payload not)."""

    path: Path
    tokens: npt.NDArray[np.intc]
    nbytes: int
    session: str | None
    mtime_ns: int


def session_file_name(session: str) -> str:
    """The file a session's state is written to (the name hashed: any name is a safe file name)."""
    return "s-" + hashlib.sha256(session.encode()).hexdigest()[:24] + ".kv"


def _tokens_file_name(tokens: npt.NDArray[np.intc]) -> str:
    return "p-" + hashlib.sha256(tokens.tobytes()).hexdigest()[:24] + ".kv"


class _Unusable(Exception):
    """A state file that must not be loaded (the event name says why)."""

    def __init__(self, event: str, why: str) -> None:
        super().__init__(why)
        self.event = event


class DiskTier:
    """Saved KV states in files under ``root``, for one :class:`StateKey`, within ``capacity_bytes``."""

    def __init__(self, root: str | os.PathLike[str], key: StateKey, capacity_bytes: int,
                 events: KVEvents | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError("disk tier capacity must be >= 0 bytes")
        self.root = Path(root).expanduser()
        self.key = key
        self.capacity_bytes = capacity_bytes
        self.folder = self.root / key.namespace
        self._events = events
        self._lock = threading.Lock()
        self._index: dict[Path, DiskEntry] = {}
        #: The folder's mtime when it was last listed (None: never): files other processes add or
        #: remove change it, and the next lookup lists it again.
        self._listed: int | None = None

    # ------------------------------------------------------------------ index

    def _event(self, event: str, message: str | None = None, *args: Any) -> None:
        if message is not None:  # typed for log handlers: record.kv_tier, record.kv_event
            logger.warning(message, *args, extra={"kv_tier": "disk", "kv_event": event})
        if self._events is not None:
            self._events("disk", event)

    def _read_header(self, fh: Any) -> tuple[dict[str, Any], npt.NDArray[np.intc]]:
        head = fh.read(len(MAGIC) + _HEADER_LEN.size)
        if len(head) < len(MAGIC) + _HEADER_LEN.size or head[: len(MAGIC)] != MAGIC:
            raise _Unusable("corrupt", "not an edgecloud KV state (bad magic or truncated header)")
        (length,) = _HEADER_LEN.unpack(head[len(MAGIC):])
        if length > _MAX_HEADER:
            raise _Unusable("corrupt", f"header of {length} bytes is not one of ours")
        try:
            header = json.loads(fh.read(length))
            n_tokens, payload = int(header["n_tokens"]), int(header["payload_bytes"])
            key = header["key"]
        except (ValueError, KeyError, TypeError) as exc:
            raise _Unusable("corrupt", f"unreadable header ({exc})") from exc
        if key != asdict(self.key):
            raise _Unusable("foreign", f"saved for {key}, not for this model and runtime {asdict(self.key)}")
        raw = fh.read(4 * n_tokens)
        if len(raw) != 4 * n_tokens or n_tokens < 1 or payload < 1:
            raise _Unusable("corrupt", "truncated token list")
        return header, np.frombuffer(raw, dtype="<i4").astype(np.intc)

    def _index_file(self, path: Path) -> DiskEntry | None:
        try:
            with open(path, "rb") as fh:
                header, tokens = self._read_header(fh)
                stat = os.fstat(fh.fileno())
        except _Unusable as exc:
            self._discard(path, exc.event, str(exc))
            return None
        except OSError:
            return None  # gone (another process replaced or evicted it)
        entry = DiskEntry(path, tokens, int(stat.st_size), header.get("session"), stat.st_mtime_ns)
        self._index[path] = entry
        return entry

    def _scan(self) -> None:
        try:
            mtime = self.folder.stat().st_mtime_ns
        except OSError:
            self._index.clear()
            return
        if mtime == self._listed:
            return
        self._listed = mtime
        try:
            paths = set(self.folder.glob("*.kv"))
        except OSError:
            return
        for gone in set(self._index) - paths:
            del self._index[gone]
        for path in sorted(paths - set(self._index)):
            self._index_file(path)

    def discard(self, entry: DiskEntry, event: str, why: str) -> None:
        """Delete ``entry``'s file (a caller found it unusable: ``event`` names why, for the metric)."""
        with self._lock:
            self._discard(entry.path, event, why)

    def _discard(self, path: Path, event: str, why: str) -> None:
        self._index.pop(path, None)
        self._event(event, "discarding KV state %s (it will be recomputed): %s", path, why)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("could not delete %s: %s", path, exc)

    def entries(self) -> list[DiskEntry]:
        """The states indexed for this key."""
        with self._lock:
            self._scan()
            return list(self._index.values())

    @property
    def nbytes(self) -> int:
        """Bytes of every state file under the root (all models), as on disk now."""
        return sum(size for _, size, _ in self._all_files())

    # ------------------------------------------------------------------ lookup

    def best_match(self, tokens: Sequence[int] | npt.NDArray[np.intc],
                   session: str | None = None) -> tuple[DiskEntry | None, int]:
        """The state sharing the longest token prefix with ``tokens`` and that length; the
        session's own file is checked first (it usually is the one)."""
        arr = np.asarray(tokens, dtype=np.intc)
        with self._lock:
            self._scan()
            if session is not None:
                self._session_entry(session)
            best, best_len = None, 0
            for entry in self._index.values():
                n = common_prefix_len_np(entry.tokens, arr)
                if n > best_len:
                    best, best_len = entry, n
            return best, best_len

    def _session_entry(self, session: str) -> DiskEntry | None:
        # another process may have written it since the folder was listed
        path = self.folder / session_file_name(session)
        known = self._index.get(path)
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            self._index.pop(path, None)
            return None
        if known is None or known.mtime_ns != mtime:
            return self._index_file(path)
        return known

    def session_entry(self, session: str) -> DiskEntry | None:
        """Session ``session``'s state, if one is saved."""
        with self._lock:
            self._scan()
            return self._session_entry(session)

    def load_state(self, entry: DiskEntry) -> tuple[Any, int] | None:
        """:meth:`load` as a ctypes byte array (what llama.cpp's state API takes) and its size."""
        payload = self.load(entry)
        if payload is None:
            return None
        return (ctypes.c_uint8 * len(payload)).from_buffer(payload), len(payload)

    def load(self, entry: DiskEntry) -> bytearray | None:
        """``entry``'s payload after checking it, or None (the file is discarded, the caller recomputes)."""
        try:
            with open(entry.path, "rb") as fh:
                header, tokens = self._read_header(fh)
                if not np.array_equal(tokens, entry.tokens):
                    raise _Unusable("stale", "replaced by another writer since it was indexed")
                size = int(header["payload_bytes"])
                payload = bytearray(size)
                if fh.readinto(payload) != size or fh.read(1):
                    raise _Unusable("corrupt", "payload truncated or followed by extra bytes")
            crc = zlib.crc32(payload, zlib.crc32(tokens.astype("<i4").tobytes()))
            if crc != int(header["crc32"]):
                raise _Unusable("corrupt", "checksum mismatch")
        except _Unusable as exc:
            with self._lock:
                if exc.event == "stale":
                    self._index.pop(entry.path, None)
                    self._index_file(entry.path)
                    self._event("stale")
                else:
                    self._discard(entry.path, exc.event, str(exc))
            return None
        except OSError as exc:
            with self._lock:
                self._index.pop(entry.path, None)
            self._event("read_error", "could not read KV state %s (recomputing): %s", entry.path, exc)
            return None
        try:
            os.utime(entry.path)  # recency for eviction
        except OSError:
            pass
        self._event("hit")
        return payload

    # ------------------------------------------------------------------ saving

    def save(self, tokens: npt.NDArray[np.intc], payload: Any, nbytes: int, session: str | None = None) -> bool:
        """Write the state of exactly ``tokens`` (``payload``: ``nbytes`` bytes, any buffer);
        False when it was not written (too large for the budget, or an I/O error: logged)."""
        tokens = np.asarray(tokens, dtype=np.intc)
        body = tokens.astype("<i4").tobytes()
        view = memoryview(payload).cast("B")[:nbytes]
        crc = zlib.crc32(view, zlib.crc32(body))
        header = json.dumps({"key": asdict(self.key), "n_tokens": len(tokens), "payload_bytes": nbytes, "crc32": crc,
                             "session": session, "saved_at": time.time()}).encode()
        size = len(MAGIC) + _HEADER_LEN.size + len(header) + len(body) + nbytes
        if size > self.capacity_bytes:
            self._event("too_large")
            return False
        name = session_file_name(session) if session is not None else _tokens_file_name(tokens)
        path = self.folder / name
        with self._lock:
            self._scan()
            tmp = path.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._make_room(size, replacing=path)
                with open(tmp, "wb") as fh:
                    fh.write(MAGIC + _HEADER_LEN.pack(len(header)) + header + body)
                    fh.write(view)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except OSError as exc:
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass
                self._event("write_error", "could not write KV state to %s (kept in RAM only): %s", self.folder, exc)
                return False
            # the files this one extends serve nothing it does not
            for old in list(self._index.values()):
                if old.path != path and len(old.tokens) <= len(tokens) and np.array_equal(
                        old.tokens, tokens[: len(old.tokens)]):
                    self._index.pop(old.path, None)
                    old.path.unlink(missing_ok=True)
            st = path.stat()
            self._index[path] = DiskEntry(path, tokens.copy(), st.st_size, session, st.st_mtime_ns)
        self._event("save")
        return True

    def _all_files(self) -> list[tuple[Path, int, float]]:
        found = []
        try:
            for path in self.root.glob("*/*.kv"):
                try:
                    st = path.stat()
                except OSError:
                    continue
                found.append((path, st.st_size, st.st_mtime))
        except OSError:
            pass
        return found

    def _make_room(self, size: int, *, replacing: Path) -> None:
        files = [f for f in self._all_files() if f[0] != replacing]
        used = sum(s for _, s, _ in files)
        if used + size <= self.capacity_bytes:
            return
        now = time.time()
        files.sort(key=lambda f: f[1] * 0.5 ** (max(0.0, now - f[2]) / RECENCY_HALF_LIFE_S))
        for path, bytes_, _ in files:
            if used + size <= self.capacity_bytes:
                break
            path.unlink(missing_ok=True)
            self._index.pop(path, None)
            used -= bytes_
            self._event("evict")

    def clear(self) -> None:
        """Delete this key's state files."""
        with self._lock:
            self._scan()
            for path in list(self._index):
                path.unlink(missing_ok=True)
            self._index.clear()
