"""No request can kill the server: every input that once did (or answered 500) gets a 4xx naming
the field, or a normal answer, and the next normal request is still answered. Both engines
(the torch engine's scheduler and the llama.cpp runtime) behind the real app on loopback.
``/health`` tells the truth: 503 with the reason while the engine cannot serve."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")

from faults import serving

KEY = "sk-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "Say hello."}]
NORMAL = {"messages": HELLO, "max_tokens": 4, "temperature": 0}


def _nested(depth: int) -> str:
    """JSON text of a value nested ``depth`` lists deep (written out: encoding it would recurse)."""
    return "[" * depth + '"x"' + "]" * depth


#: (name, body, the field the error must name)
BAD: list[tuple[str, dict[str, Any], str | None]] = [
    ("seed 2**64", {**NORMAL, "seed": 2**64}, "seed"),
    ("seed 2**70", {**NORMAL, "seed": 2**70}, "seed"),
    ("lone surrogate in content", {**NORMAL, "messages": [{"role": "user", "content": "a\ud800b"}]},
     "messages[0].content"),
    ("lone surrogate in stop", {**NORMAL, "stop": ["\udfff"]}, "stop"),
    ("max_tokens as a string", {**NORMAL, "max_tokens": "4"}, "max_tokens"),
    ("max_tokens as a boolean", {**NORMAL, "max_tokens": True}, "max_tokens"),
    ("stream as a string", {**NORMAL, "stream": "yes"}, "stream"),
    ("stream as an integer", {**NORMAL, "stream": 0}, "stream"),
    ("empty stop string", {**NORMAL, "stop": ""}, "stop"),
    ("prompt_cache_key with a path", {**NORMAL, "prompt_cache_key": "../../etc/passwd"}, "prompt_cache_key"),
    ("prompt_cache_key with a control character", {**NORMAL, "prompt_cache_key": "a\x00b"}, "prompt_cache_key"),
]
NESTED: list[tuple[str, str]] = [
    ("deep unknown field", json.dumps(NORMAL)[:-1] + f', "extra": {_nested(3000)}}}'),
    ("deep content", f'{{"max_tokens": 4, "messages": [{{"role": "user", "content": {_nested(200)}}}]}}'),
    ("deep messages", f'{{"max_tokens": 4, "messages": {_nested(500)}}}'),
]


@pytest.fixture(scope="module", params=["torch", "llamacpp"])
def server(request: pytest.FixtureRequest, smollm2_path: Path) -> Iterator[tuple[str, Any]]:
    if request.param == "torch":
        pytest.importorskip("torch")
    with serving(request.param, smollm2_path, n_ctx=512, api_key=KEY) as (url, backend):
        yield url, backend


def _post(url: str, body: Any, *, raw: str | None = None, path: str = "/v1/chat/completions") -> httpx.Response:
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content.encode("utf-8", "surrogatepass"),
                      headers={**AUTH, "Content-Type": "application/json"}, timeout=120)


def _answers(url: str) -> None:
    reply = _post(url, NORMAL)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize(("name", "body", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_naming_the_field(server: tuple[str, Any], name: str, body: dict[str, Any],
                                             param: str) -> None:
    url, _ = server
    reply = _post(url, body)
    assert reply.status_code == 400, (name, reply.status_code, reply.text)
    assert reply.json()["error"]["param"] == param
    _answers(url)


@pytest.mark.parametrize(("name", "raw"), NESTED, ids=[n[0] for n in NESTED])
def test_deeply_nested_json_is_refused(server: tuple[str, Any], name: str, raw: str) -> None:
    url, _ = server
    reply = _post(url, None, raw=raw)
    assert reply.status_code == 400 and "nests deeper" in reply.json()["error"]["message"], reply.text
    _answers(url)


@pytest.mark.parametrize("temperature", [1e-50, 1e-300, 5e-324, 1e-5])
def test_tiny_temperatures_answer_as_greedy(server: tuple[str, Any], temperature: float) -> None:
    url, _ = server
    greedy = _post(url, {**NORMAL, "max_tokens": 8}).json()["choices"][0]["message"]["content"]
    reply = _post(url, {**NORMAL, "max_tokens": 8, "temperature": temperature})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == greedy
    assert httpx.get(f"{url}/health").status_code == 200
    _answers(url)


def test_completions_prompt_with_a_lone_surrogate(server: tuple[str, Any]) -> None:
    url, backend = server
    reply = _post(url, {"prompt": "x\ud800", "max_tokens": 2}, path="/v1/completions")
    assert reply.status_code == 400
    _answers(url)


def test_health_is_503_while_the_engine_cannot_serve(server: tuple[str, Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # last in this module: it breaks the engine (and, for llama.cpp, closes it)
    url, backend = server
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    if not hasattr(backend, "scheduler"):
        backend.close()  # the llama.cpp runtime is gone: nothing can be served
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "closed" in health.json()["reason"]
        return
    scheduler = backend.scheduler

    def crash() -> None:
        raise RuntimeError("injected: the engine loop crashed")

    def cannot_start() -> None:
        raise RuntimeError("injected: no memory for a new scheduler")

    # fault injection: the scheduler loop dies, and a restart fails too
    monkeypatch.setattr(scheduler, "_step", crash)
    monkeypatch.setattr(backend, "_start_scheduler", cannot_start)
    assert _post(url, NORMAL).status_code == 503  # the request that met the crash
    scheduler._thread.join(timeout=30)
    assert not scheduler.alive and "injected" in (scheduler.failure or "")
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "no memory" in health.json()["reason"]
    assert _post(url, NORMAL).status_code == 503
    # the restart works again: the next probe brings the engine back in-process
    monkeypatch.undo()
    assert httpx.get(f"{url}/health").status_code == 200 and backend.restarts >= 1
    _answers(url)
    metrics = httpx.get(f"{url}/metrics").text
    assert re.search(r'^edgecloud:engine_failures_total\{model_name="[^"]*",scope="scheduler"\} 1\.0$', metrics, re.M)
