"""Catalogue models made here: a base pulled, requantized by llama.cpp, then checked like a download."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest
from pydantic import ValidationError

from edgecloud import ModelIntegrityError, store
from edgecloud.errors import ModelFetchError
from edgecloud.store import fetch as pull_module
from edgecloud.store.cache import record_verified, sha256_file
from edgecloud.store.catalogue import CatalogueEntry

SMOLLM2 = "smollm2-135m-instruct-q4"


def _made_entry(name: str, kind: str) -> CatalogueEntry:
    base = store.require_entry(SMOLLM2)
    return base.model_copy(update={"name": name, "sha256": None, "quantization": kind,
                                   "source": base.source.model_copy(update={"kind": "requantized", "parts": (),
                                                                            "base": SMOLLM2, "type": kind})})


@pytest.fixture()
def seeded(edgecloud_home: Path, smollm2_path: Path) -> Path:
    """A fresh cache holding the base (copied, not downloaded)."""
    dest = store.model_file(SMOLLM2)
    shutil.copyfile(smollm2_path, dest)
    record_verified(dest, str(store.require_entry(SMOLLM2).sha256))
    return dest


def _types(path: Path) -> set[str]:
    return {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def _share(path: Path, kind: str) -> float:
    """The part of the file's tensor bytes stored as ``kind``."""
    tensors = gguf.GGUFReader(path).tensors
    return sum(int(t.n_bytes) for t in tensors if t.tensor_type.name == kind) / sum(int(t.n_bytes) for t in tensors)


def test_a_requantized_entry_is_made_once_from_its_base_and_checked_like_a_download(
        seeded: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _made_entry("smollm2-135m-iq4nl", "IQ4_NL")
    monkeypatch.setitem(store.catalogue(), entry.name, entry)
    assert entry.fetchable_here and not store.is_pulled(entry.name)
    seen: list[tuple[int, int]] = []
    path = store.pull(entry.name, progress=False, on_progress=lambda done, total: seen.append((done, total)))
    assert path == store.model_file(entry.name) and store.is_pulled(entry.name)
    # llama.cpp's IQ4_NL mix: the head and most matrices IQ4_NL (it may keep a few tensors
    # higher); nothing of the base's type is left
    assert "Q4_1" in _types(seeded) and "Q4_1" not in _types(path) and "IQ4_NL" in _types(path)
    assert path.stat().st_size < seeded.stat().st_size
    assert seen[-1] == (path.stat().st_size, path.stat().st_size)
    assert not list(path.parent.glob(".*.partial"))
    digest, before = sha256_file(path), path.stat()

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("an intact made file needs no base")

    monkeypatch.setattr(pull_module, "_download_part", no_download)
    seeded.unlink()  # made once: a second pull keeps the file, even with the base gone
    assert store.pull(entry.name, progress=False) == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    shutil.copyfile(smollm2_path, seeded)  # the base back, for the repair below (still no download)
    record_verified(seeded, str(store.require_entry(SMOLLM2).sha256))

    with open(path, "r+b") as fh:  # an altered byte is caught like a downloaded file's
        fh.seek(path.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelIntegrityError, match="--force"):
        store.resolve_model(entry.name, pull=False)
    assert store.pull(entry.name, progress=False) == path  # and a pull makes it again, the same bytes
    assert sha256_file(path) == digest
    store.resolve_model(entry.name, pull=False)


def test_a_type_llama_cpp_cannot_make_is_a_fetch_error_that_leaves_nothing(
        seeded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _made_entry("smollm2-135m-q9", "Q9_9")
    monkeypatch.setitem(store.catalogue(), entry.name, entry)
    with pytest.raises(ModelFetchError, match="Q9_9"):
        store.pull(entry.name, progress=False)
    assert not store.model_file(entry.name).exists()
    assert not list(seeded.parent.glob(".*.partial"))


def test_a_requantized_source_must_name_its_base_and_type() -> None:
    with pytest.raises(ValidationError, match="base"):
        CatalogueEntry.model_validate(
            {**store.require_entry(SMOLLM2).model_dump(), "source": {"kind": "requantized", "type": "IQ4_NL"}})


def test_the_default_edge_model_is_the_published_0_5b_made_smaller_and_still_picks_like_it(qwen05_path: Path) -> None:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    entry = store.require_entry(store.DEFAULT_DRAFT_MODEL)
    assert entry.source.kind == "requantized" and entry.fetchable_here
    made = store.resolve_model(store.DEFAULT_DRAFT_MODEL, progress=False)
    assert made.stat().st_size < 0.8 * qwen05_path.stat().st_size
    assert "Q8_0" in _types(qwen05_path) and "Q8_0" not in _types(made)  # the published head was Q8_0
    assert _share(made, entry.source.type) >= 0.8
    messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
    with LlamaCppBackend(str(qwen05_path), n_ctx=1024) as published:
        prompt = published.tokenize_chat(messages)
        answer = published.draft(prompt, 96)
    with LlamaCppBackend(str(made), n_ctx=1024) as edge:
        scores, _ = edge.score(prompt + answer, start=len(prompt), top_n=1)
    same = sum(s.argmax == t for s, t in zip(scores, answer)) / len(answer)
    assert same >= 0.85, same  # a requantization that broke the model would agree at chance
