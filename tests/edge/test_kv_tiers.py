"""Sessions that outlive the process, with real models: a conversation resumed after its process
was killed loads its KV from disk (the tokens are not recomputed), and a damaged or foreign
state is recomputed, with the same answer (greedy)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from edgecloud import EdgeCloud
from edgecloud.edge.llamacpp import LlamaCppBackend
from edgecloud.errors import InvalidRequestError
from edgecloud.types import ChatRequest

N_CTX = 2048
SYSTEM = "You are a patient tutor for a class on rivers. " + " ".join(
    f"Fact {i}: river number {i} flows into sea number {i % 7}." for i in range(60))
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which sea does river 12 flow into?"}]


def _turn2(first_answer: str) -> list[dict[str, str]]:
    return [*TURN1, {"role": "assistant", "content": first_answer},
            {"role": "user", "content": "And river 13?"}]


def _ask(backend: LlamaCppBackend, messages: list[dict[str, str]], session: str | None = None) -> tuple[str, int, int]:
    """The answer, the prompt's token count and how many of them were reused."""
    answer = backend.complete(ChatRequest(messages=messages, temperature=0, max_tokens=12, prompt_cache_key=session))
    assert answer.usage is not None
    return answer.text, answer.usage.prompt_tokens, answer.usage.cached_tokens


def _tiered(path: Path, cache: Path) -> LlamaCppBackend:
    return LlamaCppBackend(path, n_ctx=N_CTX, disk_cache_bytes=2**30, cache_dir=cache)


@pytest.fixture(scope="module")
def recomputed(smollm2_path: Path) -> Iterator[tuple[str, str]]:
    """Turn 1 and turn 2 answered from scratch (no saved state anywhere)."""
    with LlamaCppBackend(smollm2_path, n_ctx=N_CTX, reuse_prefix=False) as cold:
        first = _ask(cold, TURN1)[0]
        yield first, _ask(cold, _turn2(first))[0]


_KILLED_AFTER_TURN_1 = textwrap.dedent("""
    import json, os, signal, sys, time
    from edgecloud import EdgeCloud
    path, cache, messages = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    client = EdgeCloud(edge_model=path, n_ctx={n_ctx}, session="lesson-1", config={{"cache": {{"dir": cache}}}})
    answer = client.chat.completions.create(messages=messages, temperature=0, max_tokens=12, route="edge")
    print(json.dumps([answer.text, answer.usage.prompt_tokens]), flush=True)
    for _ in range(600):  # the state is written in the background after the answer
        if client.edge.kv_tiers.disk.entries():
            break
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: the process dies
""").format(n_ctx=N_CTX)


def test_a_conversation_resumed_after_its_process_was_killed_reuses_its_kv(
        smollm2_path: Path, tmp_path: Path, recomputed: tuple[str, str]) -> None:
    import json

    run = subprocess.run([sys.executable, "-c", _KILLED_AFTER_TURN_1, str(smollm2_path), str(tmp_path),
                          json.dumps(TURN1)], capture_output=True, text=True, timeout=300)
    assert run.returncode == -9, run.stderr
    first, turn1_tokens = json.loads(run.stdout)
    assert first == recomputed[0]
    with EdgeCloud(edge_model=smollm2_path, n_ctx=N_CTX, session="lesson-1",
                   config={"cache": {"dir": str(tmp_path)}}) as client:
        answer = client.chat.completions.create(messages=_turn2(first), temperature=0, max_tokens=12, route="edge")
        edge = client.edge
        assert isinstance(edge, LlamaCppBackend)
        assert answer.usage is not None
        # turn 1's prompt and answer came from disk: only the new question was evaluated
        assert answer.usage.cached_tokens >= turn1_tokens
        assert edge.stats.disk_restores == 1
        assert edge.stats.prefill_tokens == answer.usage.prompt_tokens - answer.usage.cached_tokens < 30
        assert answer.text == recomputed[1]
        assert 'edgecloud:kv_cache_events_total{event="hit",tier="disk"} 1.0' in client.metrics.render().decode()


def test_a_corrupted_state_is_recomputed_with_the_same_answer(smollm2_path: Path, tmp_path: Path,
                                                              recomputed: tuple[str, str]) -> None:
    with _tiered(smollm2_path, tmp_path) as writer:
        first = _ask(writer, TURN1, "lesson-2")[0]
    (state,) = tmp_path.glob("*/*.kv")
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x55
    state.write_bytes(bytes(data))
    events: list[tuple[str, str]] = []
    with LlamaCppBackend(smollm2_path, n_ctx=N_CTX, disk_cache_bytes=2**30, cache_dir=tmp_path,
                         kv_events=lambda tier, event: events.append((tier, event))) as reader:
        text, prompt_tokens, cached = _ask(reader, _turn2(first), "lesson-2")
        assert text == recomputed[1]
        assert cached < 10  # only the warm template prefix: everything else was recomputed
        assert reader.stats.disk_restores == 0
    assert ("disk", "corrupt") in events
    assert state.read_bytes() != bytes(data)  # the damaged file went; the session's new state replaced it


def test_a_state_saved_for_another_model_is_never_loaded(smollm2_path: Path, qwen05_path: Path,
                                                         tmp_path: Path) -> None:
    with _tiered(smollm2_path, tmp_path) as smol:
        _ask(smol, TURN1, "lesson-3")
    with LlamaCppBackend(qwen05_path, n_ctx=N_CTX, reuse_prefix=False) as cold:
        expected = _ask(cold, TURN1)[0]
    events: list[tuple[str, str]] = []
    with LlamaCppBackend(qwen05_path, n_ctx=N_CTX, disk_cache_bytes=2**30, cache_dir=tmp_path,
                         kv_events=lambda tier, event: events.append((tier, event))) as qwen:
        qwen.load()
        own = qwen.kv_tiers.disk
        assert own is not None
        own.folder.mkdir(parents=True, exist_ok=True)
        for state in tmp_path.glob("*/*.kv"):  # smollm2's states, copied where qwen's are kept
            if state.parent != own.folder:
                (own.folder / state.name).write_bytes(state.read_bytes())
        text, _, cached = _ask(qwen, TURN1, "lesson-3")
        assert text == expected and cached < 10
        assert qwen.stats.disk_restores == 0
    assert ("disk", "foreign") in events


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "tab\there", ""])
def test_a_session_name_that_is_not_a_name_is_refused(name: str) -> None:
    with pytest.raises(InvalidRequestError) as request_error:
        ChatRequest(messages=[{"role": "user", "content": "hi"}], prompt_cache_key=name)
    assert request_error.value.param == "prompt_cache_key"
    with pytest.raises(InvalidRequestError) as client_error:
        EdgeCloud(edge_model=None, session=name)
    assert client_error.value.param == "session"
