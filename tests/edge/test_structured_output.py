"""response_format json_object / json_schema on the llama.cpp runtime: the decoder is held to the
grammar, so the answer parses (and validates) whatever the model would have said."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

from edgecloud.errors import InvalidRequestError
from edgecloud.types import ChatRequest

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"},
                                           "role": {"enum": ["admin", "user"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Invent a person."}]


@pytest.fixture(scope="module")
def edge(smollm2_path: Path) -> Iterator[Any]:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(smollm2_path), n_ctx=512) as backend:
        yield backend


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_validate(edge: Any, temperature: float) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    answer = edge.complete(ChatRequest(messages=ASK, max_tokens=80, temperature=temperature, seed=3,
                                       response_format=fmt))
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.text), PERSON)


def test_json_object_answers_parse(edge: Any) -> None:
    ask = [{"role": "user", "content": "Reply with a JSON object with one key, colour, naming a colour."}]
    answer = edge.complete(ChatRequest(messages=ask, max_tokens=120, temperature=0,
                                       response_format={"type": "json_object"}))
    assert answer.choices[0].finish_reason == "stop", answer.text
    assert isinstance(json.loads(answer.text), dict)


def test_unconstrained_answers_are_not_json(edge: Any) -> None:
    answer = edge.complete(ChatRequest(messages=ASK, max_tokens=30, temperature=0))
    with pytest.raises(ValueError):
        json.loads(answer.text)  # the constraint, not the model, made the answers above parse


@pytest.mark.parametrize("fmt, says", [
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "unknown response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "grammar"),
])
def test_bad_formats_are_refused_by_name(edge: Any, fmt: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        edge.complete(ChatRequest(messages=ASK, max_tokens=8, response_format=fmt))
    assert info.value.param.startswith("response_format") and says in str(info.value)


def test_a_runtime_that_cannot_constrain_says_so() -> None:
    from edgecloud.runtime.sampling import sampling_params

    with pytest.raises(InvalidRequestError) as info:
        sampling_params(ChatRequest(messages=ASK, response_format={"type": "json_object"}), 8)
    assert info.value.param == "response_format"
