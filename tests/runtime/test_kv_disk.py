"""The disk tier of saved KV states, on its own (states as bytes, no model): what is loaded, what
is refused, and that the budget holds. The real-model tests are tests/edge/test_kv_tiers.py."""

from __future__ import annotations

import logging
import multiprocessing
import os
import stat
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from edgecloud.runtime.kv_disk import DiskTier, StateKey
from edgecloud.runtime.prefix_cache import PrefixCache, SavedPrefix

KEY = StateKey(model_sha256="a" * 64, runtime="llama-cpp-python 0.3", n_ctx=1024, kv_type="1/1")


def _tier(root: Path, capacity: int = 10**7, key: StateKey = KEY) -> tuple[DiskTier, Counter[tuple[str, str]]]:
    events: Counter[tuple[str, str]] = Counter()
    return DiskTier(root, key, capacity, events=lambda tier, event: events.update([(tier, event)])), events


def _state(n: int, seed: int = 0) -> tuple[np.ndarray, bytes]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, n).astype(np.intc), rng.bytes(n * 64)


def test_a_saved_state_is_found_by_prefix_in_a_new_process(tmp_path: Path) -> None:
    tier, _ = _tier(tmp_path)
    tokens, payload = _state(100)
    assert tier.save(tokens, payload, len(payload))
    fresh, events = _tier(tmp_path)  # what the next process sees
    prompt = np.concatenate([tokens[:80], np.array([7, 7, 7], dtype=np.intc)])
    entry, n = fresh.best_match(prompt)
    assert entry is not None and n == 80
    assert fresh.load(entry) == payload
    assert events[("disk", "hit")] == 1


def test_a_session_keeps_one_file_and_a_longer_state_replaces_its_prefix(tmp_path: Path) -> None:
    tier, _ = _tier(tmp_path)
    tokens, payload = _state(200)
    assert tier.save(tokens[:100], payload[:6400], 6400, session="chat-1")
    assert tier.save(tokens, payload, len(payload), session="chat-1")
    other, other_payload = _state(50, seed=1)
    assert tier.save(other, other_payload, len(other_payload))
    assert tier.save(np.concatenate([other, tokens[:10]]), other_payload, len(other_payload))  # extends `other`
    assert len(list(tier.folder.glob("*.kv"))) == 2
    entry, n = _tier(tmp_path)[0].best_match(tokens, session="chat-1")
    assert n == 200 and entry is not None and entry.session == "chat-1"


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_a_damaged_file_is_discarded_never_loaded(tmp_path: Path, damage: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    tier, _ = _tier(tmp_path)
    tokens, payload = _state(100)
    tier.save(tokens, payload, len(payload), session="s")
    path = next(tier.folder.glob("*.kv"))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "garbage":
        data[:16] = b"not a state file"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    fresh, events = _tier(tmp_path)
    with caplog.at_level(logging.WARNING, logger="edgecloud.kv_cache"):
        entry, _ = fresh.best_match(tokens)
        loaded = fresh.load(entry) if entry is not None else None
    assert loaded is None
    assert not path.exists()
    assert events[("disk", "corrupt")] == 1
    assert any(getattr(r, "kv_event", None) == "corrupt" for r in caplog.records)


def test_a_state_of_another_model_is_discarded(tmp_path: Path) -> None:
    tier, _ = _tier(tmp_path)
    tokens, payload = _state(100)
    tier.save(tokens, payload, len(payload))
    other = StateKey(model_sha256="b" * 64, runtime=KEY.runtime, n_ctx=KEY.n_ctx, kv_type=KEY.kv_type)
    theirs, events = _tier(tmp_path, key=other)
    assert theirs.best_match(tokens) == (None, 0)  # another model's folder: not even seen
    theirs.folder.mkdir(parents=True)
    for path in tier.folder.glob("*.kv"):  # copied into its folder by hand: refused by the header
        (theirs.folder / path.name).write_bytes(path.read_bytes())
    assert theirs.best_match(tokens) == (None, 0)
    assert events[("disk", "foreign")] == 1
    assert list(theirs.folder.glob("*.kv")) == []
    assert tier.best_match(tokens)[1] == 100  # the owner's own file is untouched


def test_the_budget_is_never_exceeded_and_the_least_valuable_state_goes_first(tmp_path: Path) -> None:
    tier, events = _tier(tmp_path, capacity=40_000)
    small, small_payload = _state(60, seed=1)
    assert tier.save(small, small_payload, len(small_payload))
    for seed in range(2, 12):
        tokens, payload = _state(150, seed=seed)
        assert tier.save(tokens, payload, len(payload))
        assert tier.nbytes <= 40_000
    assert events[("disk", "evict")] >= 8
    huge, huge_payload = _state(1000, seed=99)
    assert not tier.save(huge, huge_payload, len(huge_payload))  # larger than the whole budget
    assert events[("disk", "too_large")] == 1
    assert tier.nbytes <= 40_000


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_logged_and_nothing_raises(tmp_path: Path) -> None:
    tier, events = _tier(tmp_path)
    tier.folder.mkdir(parents=True)
    tier.folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        tokens, payload = _state(10)
        assert not tier.save(tokens, payload, len(payload))
        assert events[("disk", "write_error")] == 1
    finally:
        tier.folder.chmod(stat.S_IRWXU)


def test_a_cache_dir_that_is_a_file_is_logged_and_nothing_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "kv"
    blocker.write_text("not a folder")
    tier, events = _tier(blocker)
    tokens, payload = _state(10)
    assert not tier.save(tokens, payload, len(payload))
    assert tier.best_match(tokens) == (None, 0)
    assert events[("disk", "write_error")] == 1


def test_a_full_disk_keeps_the_last_good_state_and_nothing_raises(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from edgecloud.runtime import kv_disk

    tier, events = _tier(tmp_path)
    tokens, payload = _state(100)
    assert tier.save(tokens, payload, len(payload), session="chat")

    def no_space(fd: int) -> None:  # the fault: the device fills up while the state is written
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_disk.os, "fsync", no_space)
    longer, longer_payload = _state(150, seed=3)
    assert not tier.save(longer, longer_payload, len(longer_payload), session="chat")
    monkeypatch.undo()
    assert events[("disk", "write_error")] == 1
    assert [f.name for f in tier.folder.iterdir() if f.name.endswith(".tmp")] == []  # no half-written file left
    entry, n = _tier(tmp_path)[0].best_match(tokens, session="chat")
    assert entry is not None and n == 100 and _tier(tmp_path)[0].load(entry) == payload


def _write_session(root: str, seed: int) -> None:
    tier = DiskTier(root, KEY, 10**8)
    for i in range(15):
        tokens, payload = _state(300, seed=seed * 100 + i)
        tier.save(tokens, payload, len(payload), session="shared")


def test_two_processes_writing_one_session_leave_a_whole_file(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_write_session, args=(str(tmp_path), seed)) for seed in (1, 2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
        assert w.exitcode == 0
    tier, events = _tier(tmp_path)
    (entry,) = tier.entries()
    assert tier.load(entry) is not None  # one writer's whole state, never a mix
    assert events[("disk", "corrupt")] == 0
    assert not list(tier.folder.glob("*.tmp"))


def test_the_ram_tier_spills_what_it_evicts_and_keeps_what_saves_most() -> None:
    spilled: list[SavedPrefix] = []
    cache = PrefixCache(capacity_bytes=300, on_evict=spilled.append)
    long_ = SavedPrefix(tokens=np.arange(1000, dtype=np.intc), state=b"l", nbytes=100)
    short = SavedPrefix(tokens=np.arange(5000, 5010, dtype=np.intc), state=b"s", nbytes=100)
    assert cache.put(long_) and cache.put(short)
    assert cache.put(SavedPrefix(tokens=np.arange(9000, 9500, dtype=np.intc), state=b"m", nbytes=100))
    assert cache.put(SavedPrefix(tokens=np.arange(7000, 7500, dtype=np.intc), state=b"n", nbytes=100))
    assert spilled == [short]  # the newer but 100x cheaper state goes first
    assert cache.best_match(np.arange(1000))[1] == 1000
