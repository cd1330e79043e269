"""Model store: the catalogue, pulling and verifying models, and the cache directory.

``resolve_model(name_or_path)`` is the one door every runtime uses: a catalogue name becomes
a verified file in the cache (pulled on first use when allowed), a local ``.gguf`` path is
checked to exist and to be a GGUF file.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelFetchError, ModelIntegrityError, ModelNotFoundError
from .cache import home_dir, model_file, models_dir
from .catalogue import DEFAULT_DRAFT_MODEL, DEFAULT_EDGE_MODEL, DEFAULT_MODEL, CatalogueEntry, catalogue, get_entry, require_entry
from . import fetch
from .fetch import is_pulled, pull, verify

__all__ = [
    "DEFAULT_DRAFT_MODEL",
    "DEFAULT_EDGE_MODEL",
    "DEFAULT_MODEL",
    "CatalogueEntry",
    "catalogue",
    "get_entry",
    "require_entry",
    "pull",
    "verify",
    "is_pulled",
    "resolve_model",
    "fetch_hub_file",
    "is_local_path",
    "check_gguf_magic",
    "home_dir",
    "models_dir",
    "model_file",
]

_GGUF_MAGIC = b"GGUF"


HUB_PREFIX = "hf://"


def fetch_hub_file(hub_id: str) -> Path:
    """Download ``hf://OWNER/REPO/FILE.gguf`` with huggingface_hub (where a network allows it)."""
    parts = hub_id.removeprefix(HUB_PREFIX).split("/")
    if len(parts) < 3 or not parts[-1].endswith(".gguf"):
        raise ModelNotFoundError(f"{hub_id!r} is not a hub id; write hf://OWNER/REPO/FILE.gguf")
    repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
    try:
        from huggingface_hub import hf_hub_download  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ModelFetchError(f"{hub_id} needs huggingface_hub: pip install huggingface_hub") from exc
    try:
        path = Path(hf_hub_download(repo, filename))
    except Exception as exc:  # noqa: BLE001 - any hub/network failure means the same to the user
        raise ModelFetchError(
            f"could not fetch {hub_id} ({type(exc).__name__}); download it where the hub is reachable "
            "and pass the local path instead"
        ) from exc
    check_gguf_magic(path)
    return path


def is_local_path(name_or_path: str | os.PathLike[str]) -> bool:
    """True when the argument names a file rather than a catalogue entry."""
    if isinstance(name_or_path, os.PathLike):
        return True
    text = str(name_or_path)
    return text.endswith(".gguf") or os.sep in text or text.startswith((".", "~"))


def check_gguf_magic(path: Path) -> None:
    """ModelIntegrityError unless ``path`` starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read model file {path}: {exc.strerror}") from exc
    if head != _GGUF_MAGIC:
        raise ModelIntegrityError(f"{path} is not a GGUF file (it does not start with b'GGUF')")


def resolve_model(
    name_or_path: str | os.PathLike[str], *, pull: bool = True, progress: bool = True
) -> Path:
    """A verified local file for a catalogue name or a ``.gguf`` path.

    Catalogue names are pulled on first use when ``pull`` is true (with a progress bar on
    stderr when ``progress``); otherwise a missing model raises ModelNotFoundError saying how
    to pull it. A cached file that fails size/sha256 verification raises ModelIntegrityError.
    """
    if str(name_or_path).startswith(HUB_PREFIX):
        return fetch_hub_file(str(name_or_path))
    if is_local_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(f"no model file at {path}")
        check_gguf_magic(path)
        return path.resolve()
    name = str(name_or_path)
    entry = require_entry(name)
    path = model_file(name)
    if not path.is_file():
        if not pull:
            raise ModelNotFoundError(f"model {name!r} is not pulled yet; run `edgecloud models pull {name}`")
        return fetch.pull(name, progress=progress)
    verify(entry, path, progress=progress)
    return path

