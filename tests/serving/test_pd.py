"""The prefill/decode proxy in front of real servers: the openai client through it (plain and
streamed), each request sent to one prefill and one decode server once, a side that goes down is
a 503 naming it (and /health says which), and a side that comes back is picked up. The servers
here are edgecloud's own llama.cpp engine (they compute the prompt again instead of receiving its
KV: the proxy's flow is the same); tests/integration/test_vllm_real.py runs real vLLM instances
with a KV connector."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")
from openai import OpenAI

from edgecloud.errors import InvalidRequestError
from edgecloud.serving.pd import Disaggregation, Instance, PDProxy
from faults import free_port, running_app

HELLO = [{"role": "user", "content": "Say hello."}]


class Counted:
    """An ASGI app that counts the POSTs it is sent, per path."""

    def __init__(self, app: Any) -> None:
        self.app, self.posts = app, Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.posts[scope["path"]] += 1
        await self.app(scope, receive, send)


class Side:
    """A real server on a fixed port that can be stopped and started again."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app, self.port, self._uvicorn = app, free_port(), uvicorn
        self.server: Any = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        config = self._uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = self._uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        assert self.thread is not None
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def pd(smollm2_path: Path) -> Iterator[tuple[str, Side, Side, PDProxy]]:
    from edgecloud.serving.llamacpp_engine import LlamaCppEngineBackend
    from edgecloud.serving.server import create_app

    backend = LlamaCppEngineBackend(smollm2_path, n_ctx=512, max_batch=2)
    backend.load()
    prefill = Side(Counted(create_app(backend, model_name="m")))
    decode = Side(Counted(create_app(backend, model_name="m")))
    prefill.start()
    decode.start()
    proxy = PDProxy([Instance("prefill", prefill.url), Instance("decode", decode.url)])
    proxy.start()
    try:
        with running_app(proxy.app) as url:
            yield url, prefill, decode, proxy
    finally:
        proxy.close()
        prefill.stop()
        decode.stop()
        backend.close()


def test_the_openai_client_is_answered_through_the_proxy_once_per_request(pd: tuple[str, Side, Side, PDProxy]) -> None:
    url, prefill, decode, _ = pd
    before_p, before_d = prefill.app.posts["/v1/chat/completions"], decode.app.posts["/v1/chat/completions"]
    with OpenAI(base_url=f"{url}/v1", api_key="none") as client:
        plain = client.chat.completions.create(model="m", messages=HELLO, max_tokens=8, temperature=0)
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="m", messages=HELLO, max_tokens=8, temperature=0, stream=True) if c.choices]
    assert plain.choices[0].message.content and plain.usage.completion_tokens > 1
    assert "".join(pieces) == plain.choices[0].message.content  # the same greedy answer, streamed
    assert prefill.app.posts["/v1/chat/completions"] - before_p == 2
    assert decode.app.posts["/v1/chat/completions"] - before_d == 2


def test_a_side_that_goes_down_is_a_503_naming_it_and_is_picked_up_when_back(pd: tuple[str, Side, Side, PDProxy]) -> None:
    url, _, decode, proxy = pd
    decode.stop()
    proxy.check()
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["down"] == ["decode"]
    reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4}, timeout=60)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "decode_unavailable"
    decode.start()
    deadline = time.monotonic() + 20  # the proxy's own health checks, not a call from here
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the proxy did not see the decode side come back"
        time.sleep(0.2)
    reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4}, timeout=60)
    assert reply.status_code == 200, reply.text


def test_bad_input_is_answered_by_the_servers_own_400(pd: tuple[str, Side, Side, PDProxy]) -> None:
    url = pd[0]
    assert httpx.post(f"{url}/v1/chat/completions", content=b"[1, 2]").status_code == 400
    reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("text", ["prefill=1", "prefill=1,decode=0", "decode=2,decode=1", "prefill=x,decode=1", ""])
def test_a_split_that_is_not_prefill_n_decode_m_is_refused_naming_the_option(text: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        Disaggregation.parse(text)
    assert error.value.param == "disaggregate"
