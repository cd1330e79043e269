"""Where model files live on disk, and the record that a file was verified.

The cache root is ``$EDGECLOUD_HOME`` when set, else the platform user cache
(``~/.cache/edgecloud`` on Linux). A verified model is ``models/<name>.gguf`` plus a
``.verified.json`` sidecar holding the sha256 and the file's stat identity (size, mtime, ctime,
inode): a later load re-hashes only when that identity changed, so an edited byte is caught
(any write moves ctime) without hashing a gigabyte on every start.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import platformdirs

__all__ = [
    "home_dir",
    "models_dir",
    "model_file",
    "sha256_file",
    "known_sha256",
    "stat_identity",
    "record_verified",
    "is_recorded_verified",
    "forget_verified",
    "exclusive_lock",
]

_CHUNK = 8 * 1024 * 1024


def home_dir() -> Path:
    """edgecloud's cache root (``EDGECLOUD_HOME`` or the platform user cache dir)."""
    env = os.environ.get("EDGECLOUD_HOME")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("edgecloud"))


def models_dir() -> Path:
    path = home_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_file(name: str) -> Path:
    """Path a catalogue model is (or will be) stored at."""
    return models_dir() / f"{name}.gguf"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of a file, reading in 8 MiB blocks; ``on_bytes`` reports progress."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_CHUNK):
            digest.update(block)
            if on_bytes is not None:
                on_bytes(len(block))
    return digest.hexdigest()


def stat_identity(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def record_verified(path: Path, sha256: str) -> None:
    """Write the sidecar saying ``path`` (as it is now) hashed to ``sha256``."""
    record = {"sha256": sha256, **stat_identity(path)}
    tmp = _sidecar(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, _sidecar(path))


def is_recorded_verified(path: Path, sha256: str) -> bool:
    """True when the sidecar matches both the expected hash and the file's current identity."""
    try:
        record = json.loads(_sidecar(path).read_text(encoding="utf-8"))
        return record.get("sha256") == sha256 and all(
            record.get(k) == v for k, v in stat_identity(path).items()
        )
    except (OSError, ValueError):
        return False


def known_sha256(path: Path) -> str:
    """``path``'s sha256 without re-reading it when avoidable: from its verified sidecar (catalogue
    models) or a record under ``<home>/hashes`` kept by stat identity, else hashed now and recorded."""
    path = Path(path).resolve()
    try:
        record = json.loads(_sidecar(path).read_text(encoding="utf-8"))
        if all(record.get(k) == v for k, v in stat_identity(path).items()):
            return str(record["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    store = home_dir() / "hashes" / (hashlib.sha256(str(path).encode()).hexdigest()[:24] + ".json")
    identity = stat_identity(path)
    try:
        record = json.loads(store.read_text(encoding="utf-8"))
        if record.get("path") == str(path) and all(record.get(k) == v for k, v in identity.items()):
            return str(record["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    digest = sha256_file(path)
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": str(path), "sha256": digest, **identity}), encoding="utf-8")
        os.replace(tmp, store)
    except OSError:
        pass  # a read-only cache: hash again next time
    return digest


def forget_verified(path: Path) -> None:
    _sidecar(path).unlink(missing_ok=True)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block."""
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
