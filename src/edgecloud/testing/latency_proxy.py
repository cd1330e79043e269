"""A TCP proxy that adds network latency between the client and a server on this machine.

This module owns :class:`LatencyProxy`: it listens on ``127.0.0.1``, forwards every
connection to ``target`` and holds each piece of data ``rtt/2`` (± ``jitter``) seconds in each
direction, keeping the order of the bytes (a later piece never overtakes an earlier one,
as on a real TCP connection). Benchmarks and tests use it so that figures measured between
two processes on one machine hold beyond loopback: a collaborative answer that makes many
cloud requests pays one round trip per request here too.

    with LatencyProxy(("127.0.0.1", 8000), rtt_s=0.05, jitter_s=0.005) as proxy:
        client = EdgeCloud(cloud_base_url=proxy.url, ...)

Bandwidth is not limited; the proxy is for latency only.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

__all__ = ["LatencyProxy"]


class LatencyProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` with ``rtt_s`` of round-trip delay (see the module docstring)."""

    def __init__(self, target: tuple[str, int], *, rtt_s: float = 0.05, jitter_s: float = 0.0, seed: int = 0) -> None:
        if rtt_s < 0 or jitter_s < 0:
            raise ValueError(f"rtt_s and jitter_s must be >= 0, got {rtt_s}, {jitter_s}")
        self.target, self.rtt_s, self.jitter_s = target, rtt_s, jitter_s
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.port = 0
        #: Connections accepted so far.
        self.connections = 0

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``: give this to the client instead of the server's own URL."""
        return f"http://127.0.0.1:{self.port}"

    def _delay(self) -> float:
        jitter = self._rng.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0
        return max(0.0, self.rtt_s / 2 + jitter)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy ``reader`` to ``writer``, each piece released after its delay, in order."""
        pending: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def release() -> None:
            last = 0.0
            while True:
                due, data = await pending.get()
                due = max(due, last)  # never overtake an earlier piece
                last = due
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        sender = asyncio.ensure_future(release())
        try:
            while True:
                data = await reader.read(65536)
                await pending.put((time.monotonic() + self._delay(), data))
                if not data:
                    break
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()
            writer.close()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        try:
            await asyncio.gather(self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer),
                                 return_exceptions=True)
        except asyncio.CancelledError:  # shutting down: end quietly (a cancelled handler is logged as an error)
            client_writer.close()
            server_writer.close()

    def start(self) -> LatencyProxy:
        """Start listening (on a free port) in a background thread."""

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="latency-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        return self

    async def _shutdown(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.get_running_loop().stop()

    def close(self) -> None:
        """Stop listening; open connections are dropped."""
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
