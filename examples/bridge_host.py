"""A host app's side of the edgecloud bridge: spawn ``edgecloud bridge --stdio`` and talk JSON-RPC.

Run:
    python examples/bridge_host.py                      # the default edge model (pulled on first use)
    python examples/bridge_host.py --model path/to/model.gguf

What a Swift or Kotlin app does (see examples/mobile/), in Python with the standard library
only: write one JSON request per line to the child's stdin, read one JSON message per line
from its stdout on a reader thread, and dispatch each by id (responses by their ``id``,
``chat.delta`` / ``models.pull.progress`` by ``params.id``). It streams a chat, cancels one,
lists models, plans memory, sends every kind of bad input (the bridge answers each and keeps
going) and finally closes stdin mid-answer (the bridge cancels it and exits 0). It prints
what it does and exits 1 when anything is not as the protocol promises.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import subprocess
import sys
import threading
from typing import Any

TIMEOUT_S = 180.0


class Unexpected(Exception):
    """The bridge did something the protocol does not promise."""


class BridgeProcess:
    """A spawned bridge: send requests, read every message back, sorted by request id."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.ids = itertools.count(1)
        self.inbox: dict[Any, queue.Queue[dict[str, Any]]] = {}
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _box(self, rid: Any) -> queue.Queue[dict[str, Any]]:
        with self.lock:
            return self.inbox.setdefault(rid, queue.Queue())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            message = json.loads(raw)
            # a notification names its request in params.id; a response (or an id-less error) in id
            rid = message["params"]["id"] if "method" in message else message.get("id")
            self._box(rid).put(message)

    def send_line(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def request(self, method: str, params: dict[str, Any] | None = None) -> int:
        rid = next(self.ids)
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            message["params"] = params
        self.send_line(json.dumps(message).encode())
        return rid

    def next_message(self, rid: Any) -> dict[str, Any]:
        try:
            return self._box(rid).get(timeout=TIMEOUT_S)
        except queue.Empty:
            raise Unexpected(f"nothing for id {rid!r} within {TIMEOUT_S:.0f} s") from None

    def response(self, rid: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The response to ``rid`` and the notifications that came before it."""
        notes = []
        while "method" in (message := self.next_message(rid)):
            notes.append(message)
        return message, notes

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        message, _ = self.response(self.request(method, params))
        if "error" in message:
            raise Unexpected(f"{method} failed: {message['error']}")
        return message["result"]

    def pending(self, rid: Any) -> int:
        return self._box(rid).qsize()


def check(ok: bool, what: str) -> None:
    if not ok:
        raise Unexpected(what)
    print(f"  ok: {what}")


def expect_error(bridge: BridgeProcess, line: bytes, code: int, rid: Any = None, param: str | None = None) -> None:
    bridge.send_line(line)
    message = bridge.next_message(rid)
    error = message.get("error") or {}
    check(error.get("code") == code and message.get("id") == rid,
          f"{line[:40]!r}{'...' if len(line) > 40 else ''} -> {code} ({error.get('message', '')[:60]})")
    if param is not None:
        check(error.get("data", {}).get("param") == param, f"the error names the field {param!r}")


def stream_chat(bridge: BridgeProcess) -> None:
    print("chat.create, streamed:")
    rid = bridge.request("chat.create", {"messages": [{"role": "user", "content": "Name three colours."}],
                                         "max_tokens": 24, "temperature": 0})
    response, deltas = bridge.response(rid)
    print("  " + "".join(d["params"]["delta"] for d in deltas))
    result = response.get("result") or {}
    check(bool(deltas) and result.get("text") == "".join(d["params"]["delta"] for d in deltas),
          f"{len(deltas)} chat.delta notifications add up to the result text")
    check(result.get("route", {}).get("target") == "edge", f"ran on {result.get('route')}")
    check(result.get("usage", {}).get("completion_tokens", 0) > 0, f"usage {result.get('usage')}")


def cancel_chat(bridge: BridgeProcess, max_tokens: int) -> None:
    print(f"chat.create (max_tokens={max_tokens}), cancelled after the first delta:")
    rid = bridge.request("chat.create", {"messages": [{"role": "user", "content": "Tell a long story."}],
                                         "max_tokens": max_tokens, "ignore_eos": True})
    first = bridge.next_message(rid)
    check(first.get("method") == "chat.delta", "the first delta arrived")
    cancel = bridge.call("chat.cancel", {"id": rid})
    check(cancel == {"cancelled": True}, f"chat.cancel -> {cancel}")
    response, deltas = bridge.response(rid)
    error = response.get("error") or {}
    check(error.get("code") == -32800, f"the chat answered -32800 ({error.get('message')})")
    check(1 + len(deltas) < max_tokens // 2, f"it stopped early: {1 + len(deltas)} deltas of up to {max_tokens}")


def bad_input(bridge: BridgeProcess) -> None:
    print("bad input (the bridge answers and keeps going):")
    expect_error(bridge, b'{"jsonrpc": "2.0", "id": 1, "method": ', -32700)
    expect_error(bridge, b'{"hello": "world"}', -32600)
    expect_error(bridge, b'[1, 2, 3]', -32600)
    expect_error(bridge, b'{"jsonrpc": "2.0", "id": "u1", "method": "no.such.method"}', -32601, "u1")
    expect_error(bridge, b'{"jsonrpc": "2.0", "id": "p1", "method": "chat.create", "params": '
                         b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}}', -32602, "p1",
                 param="max_tokens")
    expect_error(bridge, b'{"jsonrpc": "2.0", "id": "c1", "method": "chat.cancel", "params": {"id": "nobody"}}',
                 -32602, "c1", param="id")
    # A notification (no id) is never answered: the next request's answer is the next thing we get.
    bridge.send_line(b'{"jsonrpc": "2.0", "method": "models.list"}')
    bridge.call("initialize")
    check(bridge.pending(None) == 0, "a notification got no reply")
    huge = b'{"jsonrpc": "2.0", "id": "big", "method": "chat.create", "params": {"messages": [{"role": "user", ' \
           b'"content": "' + b"a" * (10 * 1024 * 1024) + b'"}]}}'
    expect_error(bridge, huge, -32600)
    check(bridge.call("models.list") is not None, "still serving after all of that")


def close_mid_answer(bridge: BridgeProcess) -> None:
    print("stdin closed mid-answer:")
    rid = bridge.request("chat.create", {"messages": [{"role": "user", "content": "Count to a thousand."}],
                                         "max_tokens": 200, "ignore_eos": True})
    check(bridge.next_message(rid).get("method") == "chat.delta", "the answer started")
    assert bridge.proc.stdin is not None
    bridge.proc.stdin.close()
    response, _ = bridge.response(rid)
    check((response.get("error") or {}).get("code") == -32800, "the in-flight chat was cancelled")
    code = bridge.proc.wait(timeout=TIMEOUT_S)
    check(code == 0, f"the bridge exited {code}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="edge model: catalogue name or .gguf path")
    args = parser.parse_args(argv)
    command = [sys.executable, "-m", "edgecloud", "bridge", "--stdio"]
    if args.model:
        command += ["--model", args.model]
    bridge = BridgeProcess(command)
    try:
        info = bridge.call("initialize", {"client_name": "bridge_host.py"})
        print(f"initialize: protocol {info['protocol_version']}, edgecloud {info['edgecloud_version']}, "
              f"edge model {info['config']['edge_model']}")
        stream_chat(bridge)
        cancel_chat(bridge, max_tokens=200)
        models = bridge.call("models.list")["models"]
        print("models.list: " + ", ".join(f"{m['name']}{' (installed)' if m['installed'] else ''}" for m in models))
        fit = bridge.call("plan", {"model": info["config"]["edge_model"], "device": "phone-8gb"})
        print(f"plan on phone-8gb: fits={fit['fits']}, context {fit['n_ctx']} tokens ({fit['reason']})")
        bad_input(bridge)
        close_mid_answer(bridge)
    except Unexpected as exc:
        print(f"UNEXPECTED: {exc}", file=sys.stderr)
        bridge.proc.kill()
        return 1
    print("all as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
