"""A stand-in for a hosted chat API in front of a local OpenAI-compatible server.

This module owns :class:`HostedChatProxy`: it listens on ``127.0.0.1`` and passes chat requests
and the model list through to ``target`` (``edgecloud serve``, vLLM, llama.cpp's server), but
refuses what a hosted chat API refuses, in its words and its error shape:

* ``POST /v1/completions`` answers 404 ("This is a chat model and not supported in the
  v1/completions endpoint"): no scoring of a continuation;
* a chat request with a body field outside the hosted API's own (:data:`HOSTED_CHAT_FIELDS`:
  ``continue_final_message``, ``add_generation_prompt``, ``session``, ...) answers 400
  ("Unrecognized request argument supplied: continue_final_message").

So an app (and edgecloud's own tests and benchmarks) can try what a client does against the
cloud most users point at first, with real answers from a real model behind it:

    with HostedChatProxy("http://127.0.0.1:8000") as hosted:
        client = EdgeCloud(cloud_base_url=hosted.url, cloud_model=...)

``refused`` counts the requests it refused, by reason. Needs ``edgecloud[cloud]`` (FastAPI and
uvicorn). Put a :class:`~edgecloud.testing.LatencyProxy` in front of it for a round trip.
"""

# no ``from __future__ import annotations``: FastAPI reads the handlers' annotations (``Request``,
# imported where the app is made) when they are defined

import contextlib
import json
import threading
from collections import Counter
from typing import Any

import httpx

__all__ = ["HOSTED_CHAT_FIELDS", "HostedChatProxy"]

#: The body fields OpenAI's chat completions endpoint takes; anything else is refused.
HOSTED_CHAT_FIELDS = frozenset({
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
})
_CHAT_MODEL_ONLY = ("This is a chat model and not supported in the v1/completions endpoint. "
                    "Did you mean to use v1/chat/completions?")


def _error(status: int, message: str, param: str | None = None) -> Any:
    from fastapi.responses import JSONResponse

    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


class HostedChatProxy:
    """Pass chat through to ``target`` (an API root or ``scheme://host:port``), refuse what a
    hosted chat API refuses (see the module docstring)."""

    def __init__(self, target: str) -> None:
        root = target.rstrip("/")
        self.target = root if root.endswith("/v1") else f"{root}/v1"
        self.port = 0
        #: Requests refused, by reason (``completions`` or the field that was refused).
        self.refused: Counter[str] = Counter()
        #: Chat requests passed through.
        self.passed = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>/v1``: give this to the client as the cloud's base URL."""
        return f"http://127.0.0.1:{self.port}/v1"

    def _app(self) -> Any:
        from fastapi import FastAPI, Request
        from fastapi.responses import Response, StreamingResponse

        clients: list[httpx.AsyncClient] = []

        @contextlib.asynccontextmanager
        async def lifespan(_: Any) -> Any:
            # made and closed on the server's own loop (closed elsewhere, its sockets outlive the loop)
            clients.append(httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0)))
            try:
                yield
            finally:
                await clients.pop().aclose()

        app = FastAPI(lifespan=lifespan)

        def passed_on(request: Request) -> dict[str, str]:
            keep = ("authorization", "accept")
            return {k: v for k, v in request.headers.items() if k.lower() in keep}

        @app.get("/v1/models")
        async def models(request: Request) -> Any:
            answer = await clients[0].get(f"{self.target}/models", headers=passed_on(request))
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")

        @app.post("/v1/completions")
        async def completions() -> Any:
            self.refused["completions"] += 1
            return _error(404, _CHAT_MODEL_ONLY, "model")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            try:
                body = json.loads(await request.body())
            except ValueError:
                return _error(400, "We could not parse the JSON body of your request.")
            unknown = [k for k in body if k not in HOSTED_CHAT_FIELDS] if isinstance(body, dict) else []
            if unknown:
                self.refused[unknown[0]] += 1
                return _error(400, f"Unrecognized request argument supplied: {unknown[0]}")
            self.passed += 1
            client = clients[0]
            upstream = client.build_request("POST", f"{self.target}/chat/completions", json=body,
                                            headers=passed_on(request))
            answer = await client.send(upstream, stream=True)

            async def relay() -> Any:
                try:
                    async for piece in answer.aiter_raw():
                        yield piece
                finally:
                    await answer.aclose()

            return StreamingResponse(relay(), status_code=answer.status_code,
                                     media_type=answer.headers.get("content-type"))

        return app

    def start(self) -> "HostedChatProxy":
        """Start listening (on a free port) in a background thread."""
        import socket

        import uvicorn

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self._app(), host="127.0.0.1", port=self.port,
                                                     log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, name="hosted-chat-proxy", daemon=True)
        self._thread.start()
        for _ in range(500):
            if self._server.started:
                break
            threading.Event().wait(0.01)
        return self

    def close(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> "HostedChatProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
