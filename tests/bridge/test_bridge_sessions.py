"""The bridge's session methods, as a mobile host uses them: save on background, and after the
app was killed, restore on foreground; the next turn then reuses the conversation's KV."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from edgecloud import EdgeCloud
from edgecloud.bridge import Bridge

pytest.importorskip("llama_cpp")

SYSTEM = "You answer questions about a shop's opening hours. " + " ".join(
    f"Branch {i} opens at {7 + i % 4} and closes at {17 + i % 5}." for i in range(40))


def test_a_session_saved_on_background_is_restored_by_the_next_process(smollm2_path: Path, tmp_path: Path,
                                                                      host_for: Callable[[Bridge], Any]) -> None:
    config = {"cache": {"dir": str(tmp_path)}}
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When does branch 3 open?"}]
    with EdgeCloud(edge_model=smollm2_path, config=config) as client, Bridge(client) as bridge:
        host = host_for(bridge)
        assert "session.save" in host.call("initialize", {"session": "shop-app"})["result"]["capabilities"]["methods"]
        first = host.call("chat.create", {"messages": turn1, "max_tokens": 10, "temperature": 0})["result"]
        saved = host.call("session.save", {})["result"]
        assert saved["session"] == "shop-app" and saved["tokens"] >= first["usage"]["prompt_tokens"]
    # the app was killed; a new process starts the bridge again
    with EdgeCloud(edge_model=smollm2_path, config=config) as client, Bridge(client) as bridge:
        host = host_for(bridge)
        host.call("initialize", {"session": "shop-app"})
        restored = host.call("session.restore", {})["result"]
        assert restored["tokens"] >= saved["tokens"]  # (the idle-time prefetch may have added the next header)
        turn2 = [*turn1, {"role": "assistant", "content": first["text"]},
                 {"role": "user", "content": "And branch 4?"}]
        second = host.call("chat.create", {"messages": turn2, "max_tokens": 10, "temperature": 0})["result"]
        usage = second["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
        assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] < 30


def test_a_session_name_with_path_characters_is_invalid_params(host: Any) -> None:
    error = host.call("session.restore", {"session": "../../etc"})["error"]
    assert error["code"] == -32602 and error["data"]["param"] == "session"
    error = host.call("initialize", {"session": "a/b"})["error"]
    assert error["code"] == -32602 and error["data"]["param"] == "session"
