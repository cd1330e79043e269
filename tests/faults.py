"""Fault injection over real sockets: a raw HTTP/1.1 server on loopback that answers each
request with a scripted reply (JSON errors, event streams that stall, break or carry junk)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from edgecloud.backend import Backend
from edgecloud.errors import BackendError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


Reply = Callable[[asyncio.StreamWriter], Awaitable[None]]


class ScriptedServer:
    """A raw HTTP/1.1 server on loopback answering each request with the next scripted reply
    (the last one repeats). Records when each request came and what it carried."""

    def __init__(self, port: int = 0) -> None:
        self.replies: list[Reply] = []
        self.hits: list[float] = []
        self.requests: list[tuple[str, dict[str, str], Any]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        start = asyncio.start_server(self._handle, "127.0.0.1", port)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result(10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def script(self, *replies: Reply) -> None:
        self.replies, self.hits, self.requests = list(replies), [], []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            self.hits.append(time.monotonic())
            self.requests.append((head[0], headers, json.loads(body) if body else None))
            reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
            await reply(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def json_reply(status: int, payload: Any, headers: dict[str, str] | None = None) -> Reply:
    async def reply(writer: asyncio.StreamWriter) -> None:
        body = json.dumps(payload).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n{extra}\r\n")
        writer.write(head.encode() + body)
        await writer.drain()

    return reply


def hang_up() -> Reply:
    """Close the connection without answering (a server restarting, or a stale keep-alive)."""

    async def reply(writer: asyncio.StreamWriter) -> None:
        return None

    return reply


def sse_reply(*events: str, cut: bool = False, stall: float = 0.0) -> Reply:
    """A chunked event stream; ``cut`` drops the connection before the last chunk of the body,
    ``stall`` waits that long after the events (a stuck server)."""

    async def reply(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")
        for event in events:
            data = event.encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
        await asyncio.sleep(stall)
        if not cut:
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    return reply


def event(text: str | None = None, finish: str | None = None, **extra: Any) -> str:
    delta = {"content": text} if text is not None else {"role": "assistant", "content": ""}
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    chunk = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
    return f"data: {json.dumps({**chunk, **extra})}\n\n"


USAGE = (
    'data: {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [], '
    '"usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, '
    '"prompt_tokens_details": {"cached_tokens": 3}}}\n\n'
)


class ServeProcess:
    """``edgecloud serve`` as a real child process on 127.0.0.1, to be killed and restarted."""

    def __init__(self, model: str, *, port: int | None = None, api_key: str = "sk-test", ctx: int = 1024,
                 runtime: str = "llamacpp") -> None:
        self.model, self.api_key, self.ctx, self.runtime = model, api_key, ctx, runtime
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Any = None

    def start(self, timeout: float = 180.0) -> ServeProcess:
        import subprocess
        import sys

        import httpx

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgecloud", "serve", "--model", self.model, "--runtime", self.runtime,
             "--port", str(self.port), "--api-key", self.api_key, "--ctx", str(self.ctx), "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"edgecloud serve exited: {self.proc.communicate()[1][-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"edgecloud serve did not become healthy within {timeout:g} s")

    def kill(self) -> None:
        """SIGKILL: the process dies mid-whatever, sockets are reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.communicate(timeout=30)
            except Exception:  # noqa: BLE001
                self.kill()

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_app(app: object) -> Iterator[str]:
    """A real uvicorn serving ``app`` on a free loopback port, in a background thread."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def serving(engine: str, model: Any, *, n_ctx: int, api_key: str, **app: Any) -> Iterator[tuple[str, Any]]:
    """``(url, backend)``: the real app on loopback over the ``torch`` or the ``llamacpp`` engine
    (both batched, what ``edgecloud serve`` runs), loaded first and closed afterwards; ``app``:
    more :func:`~edgecloud.serving.server.create_app` options."""
    from edgecloud.serving.server import create_app

    if engine == "torch":
        from edgecloud.serving.engine_backend import TorchEngineBackend

        backend: Any = TorchEngineBackend(model, n_ctx=n_ctx, max_batch=4)
    else:
        from edgecloud.serving.llamacpp_engine import LlamaCppEngineBackend

        backend = LlamaCppEngineBackend(model, n_ctx=n_ctx, max_batch=2)
    backend.load()
    try:
        with running_app(create_app(backend, model_name="m", api_key=api_key, **app)) as url:
            yield url, backend
    finally:
        backend.close()


class BreaksAfter(Backend):
    """Fault injection: the real edge backend failing after ``n`` content chunks, as a runtime
    that fails while generating reports it (a typed ``runtime_error``)."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner, self.n = inner, n
        self.name = inner.name  # type: ignore[misc]

    def stream(self, request: Any) -> Iterator[Any]:
        seen = 0
        for chunk in self.inner.stream(request):
            if chunk.text:
                seen += 1
                if seen > self.n:
                    raise BackendError("the edge runtime failed mid-stream (injected)", cause="runtime_error")
            yield chunk


class WrongDrafts:
    """Fault injection: the edge, wrong in every third token it drafts (its greedy line and its
    blocks), so checks reject drafts and the cloud's token replaces them; ``delay_s`` per token
    makes it slow."""

    def __init__(self, inner: Any, delay_s: float = 0.0) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def greedy(self, tokens: list[int], limit: int, picker: Any = None) -> Iterator[tuple[int, float]]:
        for i, (token, p) in enumerate(self.inner.greedy(tokens, limit, picker)):
            time.sleep(self.delay_s)
            yield (token if (i + 1) % 3 else (token + 1) % 1000), p

    def draft(self, tokens: list[int], k: int, picker: Any = None, **kw: Any) -> list[int]:
        out = self.inner.draft(tokens, k, picker, **kw)
        time.sleep(self.delay_s * len(out))
        return [t if (i + 1) % 3 else (t + 1) % 1000 for i, t in enumerate(out)]


@contextlib.contextmanager
def ignoring(target: str, fields: tuple[str, ...], marker: str) -> Iterator[str]:
    """Fault injection: a proxy (its API root) that passes everything on to ``target`` but treats a
    check as a server that ignores fields it does not know (vLLM does): ``fields`` are dropped from
    ``/v1/completions`` requests (a sampled check goes greedy) and ``marker`` and the picks from
    the answers (a streamed answer is passed on as it came)."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    app = FastAPI()
    root = target.rstrip("/")
    root = root if root.endswith("/v1") else f"{root}/v1"

    async def relay(path: str, request: Request) -> Response:
        body = await request.body()
        dropped = False
        if path == "completions" and body:
            sent = json.loads(body)
            dropped = any(sent.pop(name, None) is not None for name in fields)
            if dropped and "temperature" in sent:
                sent["temperature"] = 0
            body = json.dumps(sent).encode()
        async with httpx.AsyncClient(timeout=120) as http:
            answer = await http.request(request.method, f"{root}/{path}", content=body or None,
                                        headers={"authorization": request.headers.get("authorization", ""),
                                                 "content-type": "application/json"})
        content = answer.content
        if dropped and answer.status_code == 200 and answer.headers.get("content-type", "").startswith("application/json"):
            got = json.loads(content)
            got.pop(marker, None)
            got["choices"][0]["logprobs"].pop("picks", None)
            content = json.dumps(got).encode()
        return Response(content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type", "application/json"))

    relay.__annotations__ = {"path": str, "request": Request, "return": Response}  # (local imports: FastAPI reads these)
    app.add_api_route("/v1/{path:path}", relay, methods=["GET", "POST"])
    with running_app(app) as url:
        yield f"{url}/v1"
