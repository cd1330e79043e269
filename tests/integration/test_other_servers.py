"""The defaults against another real OpenAI-compatible server, as users run it: llama-cpp-python's.

``python -m llama_cpp.server`` (SmolLM2) refuses a prompt of token ids on ``/v1/completions`` and
takes ``continue_final_message`` without honouring it (it answers a new turn). The client learns
both — the second from the prompt tokens the server counts, not from its text — and the default
client answers every request in the mode such a cloud can run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python's server extra is not installed")

from edgecloud import EdgeCloud
from edgecloud.backend import Backend
from edgecloud.remote.client import CloudBackend
from faults import free_port

PROMPTS = ["List three colours of the rainbow, one per line.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def llama_server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(API root, served model name) of llama-cpp-python's own server on loopback."""
    port = free_port()
    log = tmp_path_factory.mktemp("llama-server") / "log.txt"
    with log.open("w") as sink:  # a file, not a pipe: its log would fill a pipe nobody reads and stall it
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_path), "--port",
                                 str(port), "--n_ctx", "2048", "--host", "127.0.0.1"],
                                stdout=sink, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama_cpp.server exited: {log.read_text()[-2000:]}")
            try:
                listing = httpx.get(f"{url}/models", timeout=1).json()
                break
            except (httpx.HTTPError, ValueError):
                if time.monotonic() > deadline:
                    pytest.fail("llama_cpp.server did not answer within 120 s")
                time.sleep(0.3)
        yield url, listing["data"][0]["id"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def edge(smollm2_path: Path) -> Iterator[Backend]:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(smollm2_path), n_ctx=1024) as backend:
        yield backend


def test_a_server_that_ignores_continuation_is_found_out(llama_server: tuple[str, str]) -> None:
    url, model = llama_server
    with CloudBackend(url, model) as cloud:
        table = cloud.discover().table()
        why = cloud.capabilities.why("continue")
    assert table["score"] is False and table["continue"] is False and table["logprobs"] is True
    assert "new turn" in why


def test_the_defaults_answer_every_request(edge: Backend, llama_server: tuple[str, str]) -> None:
    url, model = llama_server
    config = {"fallback": {"max_retries": 0, "timeout_s": 60}, "router": {"pii": "off"}}
    with EdgeCloud(edge_backend=edge, cloud_base_url=url, cloud_model=model, config=config) as c:
        finals = []
        for prompt in PROMPTS:
            chunks = list(c.chat.completions.create(messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                                    temperature=0, stream=True))
            assert "".join(ch.text for ch in chunks)
            finals.append(chunks[-1])
        capabilities = c.stats()["clouds"][0]["capabilities"]
    assert [f.route.collab for f in finals] == ["lead", "lead"]
    assert capabilities["score"] is False and capabilities["continue"] is False


def test_a_broken_edge_answer_is_not_continued_by_a_server_that_would_start_a_new_turn(
        edge: Backend, llama_server: tuple[str, str]) -> None:
    """The edge fails mid-answer; the failover asks the server once whether it continues text (it
    does not: it answers a new turn), so the partial answer is not followed by a second one: the
    edge's failure is raised, typed."""
    from edgecloud.errors import BackendError
    from faults import BreaksAfter

    url, model = llama_server
    config = {"fallback": {"max_retries": 0, "timeout_s": 60}, "router": {"pii": "off"}}
    with EdgeCloud(edge_backend=BreaksAfter(edge, 3), cloud_base_url=url, cloud_model=model, config=config) as c:
        with pytest.raises(BackendError) as failed:
            list(c.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=24,
                                           temperature=0, stream=True, route="edge", collab="off"))
        capabilities = c.stats()["clouds"][0]["capabilities"]
    assert failed.value.cause == "runtime_error"
    assert capabilities["continue"] is False
