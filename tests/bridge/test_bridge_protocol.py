"""The protocol models and the one JSON Schema document generated from them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edgecloud.bridge.protocol import METHODS, ChatCreateParams, ErrorCode, PlanResult, schema
from edgecloud.edge.memory import plan
from edgecloud.errors import InvalidRequestError


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_schema_names_every_method_and_notification_and_every_ref_resolves() -> None:
    doc = schema()
    assert list(doc["x-methods"]) == ["initialize", "chat.create", "chat.cancel", "models.list", "models.pull",
                                      "plan", "session.save", "session.restore", "shutdown"]
    assert set(doc["x-notifications"]) == {"chat.delta", "models.pull.progress"}
    assert doc["x-methods"]["chat.create"]["notifications"] == ["chat.delta"]
    refs = _refs(doc)
    assert refs and all(r.removeprefix("#/$defs/") in doc["$defs"] for r in refs)
    chat = doc["$defs"]["ChatCreateParams"]
    assert {"messages", "model", "max_tokens", "route", "privacy"} <= set(chat["properties"])
    assert chat["properties"]["stream"]["default"] is True and chat["required"] == ["messages"]
    assert {"result", "id"} <= set(doc["$defs"]["Response"]["properties"])


def test_schema_command_prints_the_same_document() -> None:
    result = subprocess.run([sys.executable, "-m", "edgecloud", "bridge", "schema"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == json.loads(json.dumps(schema()))


def test_error_codes_are_json_rpc_and_lsp_codes() -> None:
    assert {c.name: int(c) for c in ErrorCode} == {
        "PARSE_ERROR": -32700, "INVALID_REQUEST": -32600, "METHOD_NOT_FOUND": -32601, "INVALID_PARAMS": -32602,
        "INTERNAL_ERROR": -32603, "SERVER_ERROR": -32000, "REQUEST_CANCELLED": -32800,
    }


def test_params_errors_name_the_field() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        METHODS["plan"].params.parse({"model": "m", "ctx": 0})
    assert caught.value.param == "ctx"
    assert ChatCreateParams.parse({"messages": [{"role": "user", "content": "hi"}]}).stream is True


def test_plan_result_has_exactly_the_planner_fields(smollm2_path: Path) -> None:
    planned = plan(smollm2_path, "phone-8gb").to_dict()
    assert set(PlanResult.model_fields) == set(planned)
    assert PlanResult(**planned).model_dump() == planned
