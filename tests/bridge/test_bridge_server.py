"""The in-process Bridge: every method, every kind of bad input, cancel and concurrency, on the real smollm2."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from edgecloud import __version__, store
from edgecloud.bridge import Bridge
from edgecloud.bridge.protocol import METHODS, PROTOCOL_VERSION
from edgecloud.edge.memory import plan

SMOLLM2 = "smollm2-135m-instruct-q4"
HI = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12, "temperature": 0}


def test_initialize_reports_versions_capabilities_and_config(host: Any, smollm2_path: Path) -> None:
    result = host.call("initialize", {"client_name": "tests"})["result"]
    assert result["protocol_version"] == PROTOCOL_VERSION and result["edgecloud_version"] == __version__
    assert result["capabilities"] == {"methods": list(METHODS), "notifications": ["chat.delta", "models.pull.progress"],
                                      "streaming": True, "cancel": True}
    assert result["config"]["edge_model"] == str(smollm2_path) and result["config"]["cloud"] is False


def test_chat_streams_deltas_then_the_result(host: Any) -> None:
    rid = host.request("chat.create", HI)
    result = host.response(rid)["result"]
    deltas = host.notes(rid)
    assert deltas and [d["index"] for d in deltas] == list(range(len(deltas)))
    assert "".join(d["delta"] for d in deltas) == result["text"]
    assert max(i for i, m in enumerate(host.messages) if m.get("method") == "chat.delta") < host.position(rid)
    assert result["route"]["target"] == "edge" and result["finish_reason"] in ("stop", "length")
    assert 0 < result["usage"]["completion_tokens"] <= 12 and result["completion_id"].startswith("chatcmpl-")
    assert result["cost"] is not None


def test_chat_with_stream_false_sends_no_deltas(host: Any) -> None:
    rid = host.request("chat.create", {**HI, "stream": False})
    assert host.response(rid)["result"]["text"]
    assert host.notes(rid) == []


def assert_still_serving(host: Any) -> None:
    host.send({"jsonrpc": "2.0", "id": "still-there", "method": "models.list"})
    assert "result" in host.response("still-there")


_CHAT = '"method": "chat.create", "params": {"messages": [{"role": "user", "content": "x"}]'


@pytest.mark.parametrize("line, code, rid, param", [
    ('{"jsonrpc": "2.0", "id": 1, "method": "plan", ', -32700, None, None),
    (b'{"jsonrpc": "2.0", "id": 1, "method": "\xff\xfe"}', -32700, None, None),
    ("42", -32600, None, None),
    ('[{"jsonrpc": "2.0", "id": 1, "method": "models.list"}]', -32600, None, None),
    ('{"id": 1, "method": "models.list"}', -32600, 1, None),
    ('{"jsonrpc": "2.0", "id": 1.5, "method": "models.list"}', -32600, None, None),
    ('{"jsonrpc": "2.0", "id": 7, "method": 3}', -32600, 7, None),
    ('{"jsonrpc": "2.0", "id": 7, "method": "chat.completions"}', -32601, 7, None),
    ('{"jsonrpc": "2.0", "id": 7, "method": "plan", "params": ["smollm2"]}', -32602, 7, "params"),
    ('{"jsonrpc": "2.0", "id": 7, "method": "chat.create", "params": {}}', -32602, 7, "messages"),
    ('{"jsonrpc": "2.0", "id": 7, "method": "chat.create", "params": {"messages": [{"role": "robot", "content": "x"}]}}',
     -32602, 7, "messages[0].role"),
    ('{"jsonrpc": "2.0", "id": 7, ' + _CHAT + ', "max_tokenz": 5}}', -32602, 7, "max_tokenz"),
    ('{"jsonrpc": "2.0", "id": 7, ' + _CHAT + ', "route": "cloud"}}', -32602, 7, "route"),
    ('{"jsonrpc": "2.0", "id": 7, "method": "plan", "params": {"model": "smollm2-135m-instruct-q4", "device": "toaster"}}',
     -32602, 7, "device"),
    ('{"jsonrpc": "2.0", "id": 7, "method": "models.list", "params": {"verbose": true}}', -32602, 7, "verbose"),
    # the inputs that once killed or 500'd the server get the same typed refusal here
    ('{"jsonrpc": "2.0", "id": 7, ' + _CHAT + ', "seed": 18446744073709551616}}', -32602, 7, "seed"),
    ('{"jsonrpc": "2.0", "id": 7, "method": "chat.create", "params": {"messages": [{"role": "user", "content": "a\\ud800"}]}}',
     -32602, 7, "messages[0].content"),
    ('{"jsonrpc": "2.0", "id": 7, ' + _CHAT + ', "max_tokens": "4"}}', -32602, 7, "max_tokens"),
    ('{"jsonrpc": "2.0", "id": 7, ' + _CHAT + ', "stream": "yes"}}', -32602, 7, "stream"),
    ('{"jsonrpc": "2.0", "id": 7, ' + _CHAT + ', "stop": ""}}', -32602, 7, "stop"),
    ('{"jsonrpc": "2.0", "id": 7, "method": "models.list", "params": {"x": ' + "[" * 3000 + "]" * 3000 + "}}",
     -32700, None, None),
])
def test_bad_input_is_answered_and_the_bridge_keeps_serving(host: Any, line: str | bytes, code: int, rid: Any,
                                                            param: str | None) -> None:
    host.send(line)
    error = host.wait_for(lambda m: "error" in m)
    assert error["error"]["code"] == code and error["id"] == rid, error
    if param is not None:
        assert error["error"]["data"]["param"] == param and param in error["error"]["message"]
    assert_still_serving(host)


def test_an_over_long_line_is_refused_unparsed(host: Any) -> None:
    host.bridge.max_line_bytes = 1024
    host.send(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "plan", "params": {"model": "x" * 2000}}))
    error = host.wait_for(lambda m: "error" in m)
    assert error["id"] is None and error["error"]["code"] == -32600 and error["error"]["data"] == {"limit": 1024}
    assert_still_serving(host)


def test_notifications_get_no_reply(host: Any) -> None:
    host.send({"jsonrpc": "2.0", "method": "models.list"})
    host.send({"jsonrpc": "2.0", "method": "no.such.method"})
    host.send({"jsonrpc": "2.0", "method": "plan", "params": {"device": 3}})
    host.send({"jsonrpc": "2.0", "method": "chat.cancel", "params": {"id": "nobody"}})
    rid = host.request("initialize")
    host.response(rid)
    assert [m.get("id") for m in host.messages] == [rid]


def test_cancel_stops_a_running_stream(host: Any, long_chat_params: Any) -> None:
    rid = host.request("chat.create", long_chat_params(200))
    host.wait_for(lambda m: m.get("method") == "chat.delta")
    assert host.call("chat.cancel", {"id": rid})["result"] == {"cancelled": True}
    error = host.response(rid)["error"]
    deltas = host.notes(rid)
    assert error["code"] == -32800 and error["data"]["text"] == "".join(d["delta"] for d in deltas)
    assert len(deltas) < 50, f"{len(deltas)} deltas after a cancel at the first"
    assert host.call("chat.create", HI)["result"]["text"]  # the runtime was released


def test_cancel_as_a_notification_cancels_without_a_reply(host: Any, long_chat_params: Any) -> None:
    rid = host.request("chat.create", long_chat_params(200))
    host.wait_for(lambda m: m.get("method") == "chat.delta")
    host.send({"jsonrpc": "2.0", "method": "chat.cancel", "params": {"id": rid}})
    assert host.response(rid)["error"]["code"] == -32800
    assert len(host.notes(rid)) < 50
    assert [m["id"] for m in host.messages if "method" not in m] == [rid]


def test_emit_may_call_handle_itself(bridge: Bridge, long_chat_params: Any) -> None:
    """A host that cancels from inside its delta callback (same thread, same call stack) must not deadlock."""
    seen: list[dict[str, Any]] = []
    answered = threading.Event()

    def emit(line: str) -> None:
        seen.append(json.loads(line))
        if seen[-1].get("method") == "chat.delta" and seen[-1]["params"]["index"] == 0:
            bridge.handle(json.dumps({"jsonrpc": "2.0", "id": "stop", "method": "chat.cancel", "params": {"id": 1}}),
                          emit)
        if seen[-1].get("id") == 1:
            answered.set()

    bridge.handle(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "chat.create", "params": long_chat_params(200)}),
                  emit)
    assert answered.wait(120)
    assert {"jsonrpc": "2.0", "id": "stop", "result": {"cancelled": True}} in seen
    assert seen[-1]["error"]["code"] == -32800 and len(seen) < 50


def test_cancelling_an_unknown_id_is_an_error_and_nothing_else_changes(host: Any) -> None:
    rid = host.request("chat.create", HI)
    error = host.call("chat.cancel", {"id": rid + 100})["error"]
    assert error["code"] == -32602 and error["data"] == {"param": "id"}
    assert host.response(rid)["result"]["text"]


def test_two_chats_interleave_by_id_and_quick_requests_do_not_wait(host: Any, long_chat_params: Any) -> None:
    first = host.request("chat.create", long_chat_params(120))
    second = host.request("chat.create", {**HI, "max_tokens": 8})
    host.wait_for(lambda m: m.get("method") == "chat.delta")
    listed = host.request("models.list")
    results = {rid: host.response(rid)["result"] for rid in (first, second, listed)}
    assert host.position(listed) < host.position(first), "models.list waited for a running chat"
    for rid in (first, second):
        deltas = host.notes(rid)
        assert [d["index"] for d in deltas] == list(range(len(deltas)))
        assert "".join(d["delta"] for d in deltas) == results[rid]["text"]
    assert results[first]["usage"]["completion_tokens"] == 120 and results[second]["usage"]["completion_tokens"] <= 8


def test_concurrent_handle_calls_answer_each_request_once(host: Any) -> None:
    threads = [threading.Thread(target=host.send, args=({"jsonrpc": "2.0", "id": f"t{i}", "method": "models.list"},))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        host.response(f"t{i}")
    assert sorted(m["id"] for m in host.messages) == sorted(f"t{i}" for i in range(8))


def test_an_id_already_in_flight_is_refused(host: Any, long_chat_params: Any) -> None:
    host.send({"jsonrpc": "2.0", "id": "same", "method": "chat.create", "params": long_chat_params(200)})
    host.wait_for(lambda m: m.get("method") == "chat.delta")
    host.send({"jsonrpc": "2.0", "id": "same", "method": "models.list"})
    refused = host.wait_for(lambda m: "error" in m)
    assert refused["id"] == "same" and refused["error"]["code"] == -32600
    host.call("chat.cancel", {"id": "same"})
    assert host.wait_for(lambda m: m.get("error", {}).get("code") == -32800)["id"] == "same"


def test_shutdown_cancels_in_flight_answers_and_refuses_later_requests(host: Any, long_chat_params: Any) -> None:
    rid = host.request("chat.create", long_chat_params(200))
    host.wait_for(lambda m: m.get("method") == "chat.delta")
    assert host.call("shutdown")["result"] == {}
    assert host.response(rid)["error"]["code"] == -32800
    assert host.bridge.stopped.wait(30)
    assert host.call("models.list")["error"]["code"] == -32600


def test_close_cancels_in_flight_requests(host: Any, long_chat_params: Any) -> None:
    rid = host.request("chat.create", long_chat_params(200))
    host.wait_for(lambda m: m.get("method") == "chat.delta")
    host.bridge.close()
    assert host.response(rid, timeout=0)["error"]["code"] == -32800  # answered before close() returned
    assert host.bridge.stopped.is_set()


def test_a_failing_emit_cancels_its_request(bridge: Bridge, long_chat_params: Any) -> None:
    attempts: list[dict[str, Any]] = []
    answered = threading.Event()

    def broken_pipe(line: str) -> None:
        attempts.append(json.loads(line))
        if "method" not in attempts[-1]:
            answered.set()
        raise BrokenPipeError("the host went away")

    bridge.handle(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "chat.create", "params": long_chat_params(200)}),
                  broken_pipe)
    assert answered.wait(120)
    assert attempts[-1]["error"]["code"] == -32800 and len(attempts) < 50


def test_models_list_says_what_is_installed(host: Any, smollm2_path: Path) -> None:
    models = {m["name"]: m for m in host.call("models.list")["result"]["models"]}
    assert set(models) == set(store.catalogue())
    assert models[SMOLLM2]["installed"] is True and models[SMOLLM2]["path"] == str(smollm2_path)
    assert models[SMOLLM2]["size_bytes"] == store.require_entry(SMOLLM2).size_bytes


def test_pulling_a_cached_model_reports_done(host: Any, smollm2_path: Path) -> None:
    rid = host.request("models.pull", {"name": SMOLLM2})
    assert host.response(rid)["result"] == {"name": SMOLLM2, "path": str(smollm2_path)}
    total = store.require_entry(SMOLLM2).size_bytes
    assert host.notes(rid, "models.pull.progress")[-1] == {"id": rid, "done": total, "total": total}


def test_pull_progress_comes_from_the_store_callback(host: Any, bridge: Any, edgecloud_home: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    total = store.require_entry(SMOLLM2).size_bytes

    def reported(size: int) -> Any:
        return lambda m: m.get("method") == "models.pull.progress" and m["params"]["done"] == size

    def fake_pull(name: str, *, progress: bool, force: bool, on_progress: Any) -> Path:
        for size in (100, 300):
            on_progress(size, total)
            host.wait_for(reported(size), 60)  # reported before the next step
        final = store.model_file(name)
        final.write_bytes(b"x")
        on_progress(total, total)
        return final

    monkeypatch.setattr(store, "pull", fake_pull)
    monkeypatch.setattr(bridge, "progress_interval_s", 0.0)  # report every step
    rid = host.request("models.pull", {"name": SMOLLM2})
    assert host.response(rid)["result"]["name"] == SMOLLM2
    done = [n["done"] for n in host.notes(rid, "models.pull.progress")]
    assert done == sorted(done) and {100, 300} <= set(done) and done[-1] == total


def test_pulling_an_unknown_model_is_a_server_error(host: Any) -> None:
    error = host.call("models.pull", {"name": "gpt-17"})["error"]
    assert error["code"] == -32000 and error["data"] == {"type": "not_found_error", "error": "ModelNotFoundError"}
    assert "gpt-17" in error["message"]


def test_plan_answers_the_memory_planner_json(host: Any, smollm2_path: Path) -> None:
    result = host.call("plan", {"model": str(smollm2_path), "device": "phone-8gb", "ctx": 2048})["result"]
    assert result == plan(smollm2_path, "phone-8gb", 2048).to_dict()
    assert result["fits"] is True and result["n_ctx"] == 2048
