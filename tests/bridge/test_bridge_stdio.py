"""The bridge over stdio: the bounded line reader, serve_stdio on real pipes, the CLI's exits."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import pytest

from edgecloud.bridge import Bridge
from edgecloud.bridge.stdio import read_lines, serve_stdio

EDGECLOUD = [sys.executable, "-m", "edgecloud"]


class CountingReader(io.BytesIO):
    """A byte stream that remembers the most bytes any single readline asked for."""

    largest = 0

    def readline(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        assert size is not None and size > 0, "an unbounded readline"
        self.largest = max(self.largest, size)
        return super().readline(size)


def test_read_lines_skips_an_over_long_line_without_holding_it() -> None:
    stream = CountingReader(b"first\r\n" + b"x" * (10 * 1024 * 1024) + b"\nthird\nlast")
    assert list(read_lines(stream, 1024)) == [b"first", None, b"third", b"last"]
    assert stream.largest <= 64 * 1024


def test_read_lines_accepts_a_line_of_exactly_the_limit() -> None:
    assert list(read_lines(io.BytesIO(b"y" * 16 + b"\n" + b"z" * 17 + b"\n"), 16)) == [b"y" * 16, None]


class Pipes:
    """serve_stdio on a thread, fed and read through real OS pipes."""

    def __init__(self, bridge: Bridge) -> None:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        self.stdin: BinaryIO = os.fdopen(in_w, "wb")
        self.stdout: BinaryIO = os.fdopen(out_r, "rb")
        self._server_in, self._server_out = os.fdopen(in_r, "rb"), os.fdopen(out_w, "wb")
        self.exit_code: list[int] = []
        self.thread = threading.Thread(target=self._serve, args=(bridge,), daemon=True)
        self.thread.start()

    def _serve(self, bridge: Bridge) -> None:
        self.exit_code.append(serve_stdio(self._server_in, self._server_out, bridge=bridge))
        self._server_out.close()

    def send(self, message: dict[str, Any]) -> None:
        self.stdin.write(json.dumps(message).encode() + b"\n")
        self.stdin.flush()

    def read(self) -> dict[str, Any]:
        return json.loads(self.stdout.readline())


@pytest.fixture()
def pipes(bridge: Bridge) -> Iterator[Pipes]:
    served = Pipes(bridge)
    yield served
    if not served.stdin.closed:
        served.stdin.close()  # EOF: serve_stdio's reader thread ends
    served.thread.join(30)
    served._server_in.close()
    served.stdout.close()


def test_stdin_closed_cancels_in_flight_requests_and_exits_0(pipes: Pipes, long_chat_params: Any) -> None:
    pipes.send({"jsonrpc": "2.0", "id": 1, "method": "chat.create", "params": long_chat_params(200)})
    assert pipes.read()["method"] == "chat.delta"
    pipes.stdin.close()
    rest = [json.loads(line) for line in pipes.stdout]  # until the server closes its end
    pipes.thread.join(30)
    assert pipes.exit_code == [0]
    assert rest[-1]["id"] == 1 and rest[-1]["error"]["code"] == -32800
    assert len(rest) < 50


def test_shutdown_ends_serving_while_stdin_is_still_open(pipes: Pipes) -> None:
    pipes.send({"jsonrpc": "2.0", "id": "bye", "method": "shutdown"})
    assert pipes.read() == {"jsonrpc": "2.0", "id": "bye", "result": {}}
    pipes.thread.join(30)
    assert pipes.exit_code == [0] and not pipes.stdin.closed


def test_cli_without_stdio_or_a_command_prints_help_and_exits_2() -> None:
    result = subprocess.run([*EDGECLOUD, "bridge"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--stdio" in result.stdout and "schema" in result.stdout


def test_cli_refuses_contradictory_options_before_serving() -> None:
    result = subprocess.run([*EDGECLOUD, "bridge", "--stdio", "--cloud-url", "http://127.0.0.1:9"],
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and "cloud_model" in result.stderr and result.stdout == ""
