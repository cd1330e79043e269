"""Prefill/decode disaggregation with vLLM: ``edgecloud serve --engine vllm --disaggregate prefill=N,decode=M``.

This module owns :class:`Disaggregation` (the ``--disaggregate`` value), :func:`connector_config`
(the KV connector each instance runs with, for the platform), :class:`PDProxy` (the OpenAI API
in front of the instances) and :func:`launch_disaggregated` (start them, watch them, serve).

How a request flows: the proxy sends it to a prefill instance with ``max_tokens: 1`` (the
prompt's KV is computed there and handed to the connector), then the original request to a
decode instance, which finds the prompt's KV through the connector instead of computing it,
and streams the answer back through the proxy. The connector:

- ``NixlConnector`` (GPU-to-GPU transfer) where vLLM runs on CUDA and the ``nixl`` package is
  installed; the prefill answer carries ``kv_transfer_params`` the proxy hands to the decode;
- ``ExampleConnector`` (vLLM's shared-storage connector: KV saved under a folder both read)
  elsewhere, the CPU build included. It shows the flow on one machine; on a cluster use NIXL.

The equivalent plain vLLM commands are in the README. Faults: an instance that exits is started
again (the proxy's health checks see it come back); while one side has no healthy instance the
proxy answers 503 naming that side and ``/health`` says which; a request goes to one prefill and
one decode instance, once: nothing is retried after the decode instance has been asked.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import InvalidRequestError
from .vllm import VLLMSettings, format_command, vllm_command, vllm_environment

__all__ = ["Disaggregation", "PDProxy", "connector_args", "connector_config", "launch_disaggregated"]

#: Seconds between health checks of each instance.
HEALTH_EVERY_S = 1.0
#: Seconds before an instance that exited is started again (doubling, up to a minute).
RESTART_AFTER_S = 2.0


@dataclass(frozen=True)
class Disaggregation:
    """How many prefill and decode instances to run."""

    prefill: int
    decode: int

    @classmethod
    def parse(cls, text: str) -> Disaggregation:
        """``"prefill=N,decode=M"`` (both at least 1); an :class:`~edgecloud.errors.InvalidRequestError`
        naming ``disaggregate`` otherwise."""
        counts: dict[str, int] = {}
        for part in text.split(","):
            name, _, value = part.strip().partition("=")
            if name not in ("prefill", "decode") or not value.strip().isdigit() or name in counts:
                raise InvalidRequestError(f"--disaggregate takes prefill=N,decode=M (e.g. prefill=1,decode=1), "
                                          f"not {text!r}", param="disaggregate")
            counts[name] = int(value)
        if set(counts) != {"prefill", "decode"} or min(counts.values()) < 1:
            raise InvalidRequestError(f"--disaggregate needs at least one prefill and one decode instance, not {text!r}",
                                      param="disaggregate")
        return cls(prefill=counts["prefill"], decode=counts["decode"])


def connector_config(*, cuda: bool, nixl: bool, storage: Path) -> dict[str, Any]:
    """The ``--kv-transfer-config`` every instance runs with (each may prefill or decode)."""
    if cuda and nixl:
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}


def connector_args(connector: dict[str, Any], extra_args: list[str]) -> list[str]:
    """What an instance needs besides ``--kv-transfer-config`` for ``connector`` to hand over a
    whole prompt's KV.

    vLLM's shared-storage ``ExampleConnector`` records what to save on a request's first step
    only, so a prompt prefilled in chunks (a long one, or one that arrives while others take
    part of the step's token budget) is saved in part, and the decode side, which claims the
    whole prompt, fails to load it and its engine dies (vllm-project/vllm#16928). Without
    chunked prefill a prompt is always prefilled in one step (vLLM then raises the step budget
    to the context length).
    """
    chunking = any(a.split("=")[0] in ("--enable-chunked-prefill", "--no-enable-chunked-prefill") for a in extra_args)
    return ["--no-enable-chunked-prefill"] if connector["kv_connector"] == "ExampleConnector" and not chunking else []


@dataclass
class Instance:
    """One vLLM server: its role, URL, and what the last health check found."""

    role: str
    url: str
    healthy: bool = False
    problem: str = "not checked yet"
    argv: list[str] = field(default_factory=list)


class PDProxy:
    """The OpenAI API in front of prefill and decode instances (``app`` is a FastAPI app).

    ``uses_params``: the connector hands KV by ``kv_transfer_params`` (NIXL), which the proxy
    asks the prefill instance for and passes to the decode instance.
    """

    def __init__(self, instances: list[Instance], *, api_key: str | None = None, uses_params: bool = False,
                 timeout_s: float = 600.0) -> None:
        import httpx

        self.instances = instances
        self.api_key = api_key
        self.uses_params = uses_params
        self._turn = {role: itertools.count() for role in ("prefill", "decode")}
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self._stop = threading.Event()
        self._checker = threading.Thread(target=self._check_forever, name="pd-health", daemon=True)
        self.app = self._build()

    # ------------------------------------------------------------------ health

    def start(self) -> None:
        """Start the health checks (one round now, so the first request sees the truth)."""
        self.check()
        self._checker.start()

    def close(self) -> None:
        """Stop the health checks."""
        self._stop.set()

    def check(self) -> None:
        """One health check of every instance."""
        import httpx

        for instance in self.instances:
            try:
                status = httpx.get(f"{instance.url}/health", timeout=2.0).status_code
                instance.healthy, instance.problem = status == 200, ("" if status == 200 else f"/health said {status}")
            except httpx.HTTPError as exc:
                instance.healthy, instance.problem = False, f"{type(exc).__name__}: {exc}"

    def _check_forever(self) -> None:
        while not self._stop.wait(HEALTH_EVERY_S):
            self.check()

    def side(self, role: str) -> list[Instance]:
        """The instances of one side."""
        return [i for i in self.instances if i.role == role]

    def _pick(self, role: str) -> Instance | None:
        healthy = [i for i in self.side(role) if i.healthy]
        return healthy[next(self._turn[role]) % len(healthy)] if healthy else None

    def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``: 200 when both sides have a healthy instance, else 503 saying which side is down."""
        sides = {role: [{"url": i.url, "healthy": i.healthy, **({"problem": i.problem} if not i.healthy else {})}
                        for i in self.side(role)] for role in ("prefill", "decode")}
        down = [role for role, items in sides.items() if not any(item["healthy"] for item in items)]
        body: dict[str, Any] = {"status": "ok" if not down else "unavailable", **sides}
        if down:
            body["down"] = down
        return (200 if not down else 503), body

    # ------------------------------------------------------------------ the API

    def _unavailable(self, role: str, why: str) -> Any:
        return JSONResponse(status_code=503, content={"error": {
            "message": f"the {role} side cannot serve: {why}; /health says which instances are down",
            "type": "service_unavailable", "param": None, "code": f"{role}_unavailable"}})

    def _build(self) -> Any:
        proxy = self

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            yield
            await proxy._client.aclose()  # on the loop that used it (closing it elsewhere fails)

        app = FastAPI(title="edgecloud PD proxy", lifespan=lifespan)

        def authorised(request: Request) -> bool:
            return proxy.api_key is None or request.headers.get("authorization") == f"Bearer {proxy.api_key}"

        def unauthorised() -> Any:
            return JSONResponse(status_code=401, content={"error": {
                "message": "invalid API key: send the proxy's --api-key as a bearer token",
                "type": "authentication_error", "param": None, "code": "invalid_api_key"}})

        def headers() -> dict[str, str]:
            return {"Authorization": f"Bearer {proxy.api_key}"} if proxy.api_key else {}

        @app.get("/health")
        async def health() -> Any:
            status, body = proxy.health()
            return JSONResponse(status_code=status, content=body)

        @app.get("/v1/models")
        async def models(request: Request) -> Any:
            if not authorised(request):
                return unauthorised()
            decode = proxy._pick("decode")
            if decode is None:
                return proxy._unavailable("decode", "no healthy decode instance")
            reply = await proxy._client.get(f"{decode.url}/v1/models", headers=headers())
            return Response(content=reply.content, status_code=reply.status_code, media_type="application/json")

        async def relay(request: Request, path: str) -> Any:
            import httpx

            if not authorised(request):
                return unauthorised()
            try:
                body = await request.json()
            except ValueError:
                body = None
            if not isinstance(body, dict):
                return JSONResponse(status_code=400, content={"error": {
                    "message": "the body must be a JSON object", "type": "invalid_request_error", "param": None,
                    "code": None}})
            prefill, decode = proxy._pick("prefill"), proxy._pick("decode")
            if prefill is None:
                return proxy._unavailable("prefill", "no healthy prefill instance")
            if decode is None:
                return proxy._unavailable("decode", "no healthy decode instance")
            first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            first.update(max_tokens=1, stream=False)
            first.pop("max_completion_tokens", None)
            if proxy.uses_params:
                first["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                               "remote_engine_id": None, "remote_block_ids": None,
                                               "remote_host": None, "remote_port": None}
            try:
                done = await proxy._client.post(f"{prefill.url}{path}", json=first, headers=headers())
            except httpx.HTTPError as exc:
                prefill.healthy, prefill.problem = False, f"{type(exc).__name__}: {exc}"
                return proxy._unavailable("prefill", f"{prefill.url} failed ({type(exc).__name__})")
            if 400 <= done.status_code < 500:  # the request itself is wrong: the prefill's answer says why
                return Response(content=done.content, status_code=done.status_code, media_type="application/json")
            if done.status_code >= 500:
                return proxy._unavailable("prefill", f"{prefill.url} answered {done.status_code}")
            second = dict(body)
            if proxy.uses_params:
                second["kv_transfer_params"] = done.json().get("kv_transfer_params")
            if not body.get("stream"):
                try:
                    reply = await proxy._client.post(f"{decode.url}{path}", json=second, headers=headers())
                except httpx.HTTPError as exc:
                    decode.healthy, decode.problem = False, f"{type(exc).__name__}: {exc}"
                    return proxy._unavailable("decode", f"{decode.url} failed ({type(exc).__name__})")
                return Response(content=reply.content, status_code=reply.status_code, media_type="application/json")
            upstream = proxy._client.build_request("POST", f"{decode.url}{path}", json=second, headers=headers())
            try:
                reply = await proxy._client.send(upstream, stream=True)
            except httpx.HTTPError as exc:
                decode.healthy, decode.problem = False, f"{type(exc).__name__}: {exc}"
                return proxy._unavailable("decode", f"{decode.url} failed ({type(exc).__name__})")
            if reply.status_code != 200:
                content = await reply.aread()
                await reply.aclose()
                return Response(content=content, status_code=reply.status_code, media_type="application/json")

            async def chunks() -> Any:
                try:
                    async for piece in reply.aiter_raw():
                        yield piece
                finally:
                    await reply.aclose()

            return StreamingResponse(chunks(), media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await relay(request, "/v1/chat/completions")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await relay(request, "/v1/completions")

        return app


class _Supervisor:
    """Starts every instance and starts again any that exits, until :meth:`stop`."""

    def __init__(self, instances: list[Instance], envs: list[dict[str, str]]) -> None:
        self.instances, self.envs = instances, envs
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * len(instances)
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._keep, args=(i,), daemon=True) for i in range(len(instances))]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _keep(self, index: int) -> None:
        instance, wait = self.instances[index], RESTART_AFTER_S
        while not self._stopping.is_set():
            started = time.monotonic()
            proc = subprocess.Popen(instance.argv, env=self.envs[index], start_new_session=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self._procs[index] = proc
            assert proc.stdout is not None
            for line in proc.stdout:  # vLLM logs to both: one stream, each line said whose
                sys.stderr.write(f"[{instance.role} {instance.url}] {line.decode(errors='replace')}")
            status = proc.wait()
            if self._stopping.is_set():
                return
            wait = RESTART_AFTER_S if time.monotonic() - started > 120 else min(60.0, wait * 2)
            print(f"edgecloud: the {instance.role} instance at {instance.url} exited ({status}); starting it again "
                  f"in {wait:.0f} s", file=sys.stderr, flush=True)
            self._stopping.wait(wait)

    def stop(self) -> None:
        self._stopping.set()
        for proc in self._procs:
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)


def launch_disaggregated(settings: VLLMSettings, split: Disaggregation, *, python: str, module: str, source: str,
                         cpu: bool, nixl: bool, dry_run: bool = False) -> int:
    """Start ``split.prefill`` + ``split.decode`` vLLM instances on the ports after ``settings.port``
    and serve the proxy on ``settings.port`` until SIGINT/SIGTERM; the exit status."""
    storage = Path(tempfile.mkdtemp(prefix="edgecloud-pd-kv-"))
    connector = connector_config(cuda=not cpu, nixl=nixl, storage=storage)
    config = json.dumps(connector)
    roles = ["prefill"] * split.prefill + ["decode"] * split.decode
    cores = os.cpu_count() or 1
    instances, envs = [], []
    for n, role in enumerate(roles):
        port = settings.port + 1 + n
        own = replace(settings, port=port, host="127.0.0.1", extra_args=[
            *settings.extra_args, "--kv-transfer-config", config, *connector_args(connector, settings.extra_args)])
        env = vllm_environment(own, cpu=cpu)
        if cpu and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # one machine's KV budget, shared out
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(env["VLLM_CPU_KVCACHE_SPACE"]) // len(roles)))
        if cpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # the cores shared out, one set each
            share = max(1, cores // len(roles))
            first = (n * share) % cores
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"{first}-{first + share - 1}" if share > 1 else str(first)
        if not cpu and nixl:
            env.setdefault("VLLM_NIXL_SIDE_CHANNEL_PORT", str(5600 + n))
        argv = vllm_command(own, source, python=python, module=module, cpu=cpu)
        instances.append(Instance(role=role, url=f"http://127.0.0.1:{port}", argv=argv))
        envs.append(env)
        print(f"{'' if dry_run else 'edgecloud: '}{role} instance: {format_command(argv, env if cpu else None)}",
              file=sys.stdout if dry_run else sys.stderr, flush=True)
    if dry_run:
        shutil.rmtree(storage, ignore_errors=True)
        return 0
    import uvicorn

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check otherwise
    proxy = PDProxy(instances, api_key=settings.api_key, uses_params=connector["kv_connector"] == "NixlConnector")
    supervisor = _Supervisor(instances, envs)
    supervisor.start()
    proxy.start()
    print(f"edgecloud: PD proxy at http://{settings.host}:{settings.port}/v1 ({split.prefill} prefill, "
          f"{split.decode} decode; /health says when both sides serve)", file=sys.stderr, flush=True)
    # uvicorn in a thread of its own, the signals here: uvicorn.run re-raises SIGTERM once it has
    # stopped, which would end this process before the instances are stopped
    server = uvicorn.Server(uvicorn.Config(proxy.app, host=settings.host, port=settings.port, log_level="warning"))
    serving = threading.Thread(target=server.run, name="pd-proxy", daemon=True)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    serving.start()
    try:
        while not stop.wait(0.5):
            if not serving.is_alive():  # the proxy could not serve (its port taken, ...)
                print(f"edgecloud: error: the PD proxy stopped serving on port {settings.port}", file=sys.stderr)
                return 1
        return 0
    finally:
        server.should_exit = True
        serving.join(timeout=30)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        proxy.close()
        supervisor.stop()
        shutil.rmtree(storage, ignore_errors=True)
