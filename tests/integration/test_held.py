"""Tool calls and structured output in verified mode: both sides held to the request's grammar.

A real llama.cpp edge (Qwen2.5-Coder 0.5B, wrong on purpose in every third drafted token) and a
real ``edgecloud serve`` process with the same model. Under the defaults a request with tools or
a ``json_schema`` is verified: the edge drafts under the grammar and every check picks under it,
so the calls and the JSON are the cloud's own — the same as asked of the cloud alone, greedy or
with a seed — and streamed in OpenAI's shape. A cloud that ignores the grammar fields (vLLM) is
never a silent unconstrained answer; bad grammar checks are 400s naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from edgecloud import EdgeCloud
from edgecloud.backend import Backend
from edgecloud.errors import ExtensionUnsupportedError
from edgecloud.types import collect_chunks
from faults import ServeProcess, WrongDrafts, ignoring

KEY = "sk-test"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                     "languages": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "languages"]}}}
WEATHER_ASK = [{"role": "user", "content": "What's the weather in Paris, in celsius?"}]
PERSON_ASK = [{"role": "user", "content": "Extract the person: Ana Lima is 34 and speaks Portuguese and English."}]
CASES = {
    "required": dict(messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice="required"),
    "auto": dict(messages=WEATHER_ASK, tools=[WEATHER, TIME]),
    "named": dict(messages=WEATHER_ASK, tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "function": {"name": "get_time"}}),
    "json_schema": dict(messages=PERSON_ASK, response_format=PERSON),
    "json_object": dict(messages=[{"role": "user", "content": "A JSON object with the keys city and country, for "
                                                              "the capital of Japan."}],
                        response_format={"type": "json_object"}),
}


@pytest.fixture(scope="module")
def edge(qwen05_path: Path) -> Iterator[Backend]:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(qwen05_path), n_ctx=2048) as backend:
        yield backend


@pytest.fixture(scope="module")
def cloud(qwen05_path: Path) -> Iterator[ServeProcess]:
    with ServeProcess(str(qwen05_path), api_key=KEY, ctx=2048) as proc:
        yield proc


def client(edge: Any, url: str, **collab: Any) -> EdgeCloud:
    config = {"collab": collab, "fallback": {"max_retries": 0, "timeout_s": 120}, "router": {"pii": "off"}}
    return EdgeCloud(edge_backend=edge, cloud_base_url=url, cloud_model="qwen2.5-coder-0.5b-instruct-q4",
                     cloud_api_key=KEY, config=config)


def shown(answer: Any, case: str) -> tuple[Any, ...]:
    """What the answer says: its text (parsed, for JSON), its calls (parsed) and why it ended. (Parsed:
    the spacing of JSON can differ at a near tie, llama.cpp's batched logits not being bit-equal to
    one-token ones.)"""
    message = answer.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    content = json.loads(message.content) if case.startswith("json") else message.content
    return content, calls, answer.choices[0].finish_reason


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_calls_and_json_are_the_clouds_own_answer(edge: Backend, cloud: ServeProcess, case: str,
                                                  temperature: float) -> None:
    params = {**CASES[case], "temperature": temperature, "seed": 11, "max_tokens": 80}
    with client(WrongDrafts(edge), cloud.url) as c:
        verified = c.chat.completions.create(**params)
        alone = c.chat.completions.create(route="cloud", **params)
    assert verified.route.collab == "verified" and verified.route.noted("verified_rounds") is not None
    assert shown(verified, case) == shown(alone, case)
    if case in ("required", "named"):
        assert verified.choices[0].finish_reason == "tool_calls"
        assert verified.choices[0].message.tool_calls[0].function.name == ("get_time" if case == "named" else
                                                                          "get_weather")
    if case.startswith("json"):
        json.loads(verified.choices[0].message.content)  # valid JSON, whoever drafted it
    assert verified.route.tokens["cloud"] < verified.usage.completion_tokens  # the edge wrote most of it
    assert verified.cost.passes_vs_all_cloud < 1.0


def test_streamed_calls_keep_their_shape(edge: Backend, cloud: ServeProcess) -> None:
    params = {**CASES["required"], "temperature": 0.0, "max_tokens": 80}
    with client(edge, cloud.url) as c:
        whole = c.chat.completions.create(**params)
        chunks = list(c.chat.completions.create(stream=True, **params))
    pieces = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert len(pieces) > 1  # the arguments stream in pieces
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].index == 0
    assert all(p.index == 0 for p in pieces)
    merged = collect_chunks(chunks).choices[0]
    assert merged.finish_reason == "tool_calls"
    assert json.loads(merged.message.tool_calls[0].function.arguments) == \
        json.loads(whole.choices[0].message.tool_calls[0].function.arguments)


def test_a_cloud_that_ignores_the_grammar_is_never_an_unconstrained_answer(edge: Backend, cloud: ServeProcess) -> None:
    with ignoring(cloud.url, ("grammar", "grammar_from"), "grammar") as url:
        with client(edge, url) as c:
            answer = c.chat.completions.create(**CASES["json_schema"], temperature=0, max_tokens=80)
            assert answer.route.collab != "verified" and "grammar" in answer.route.reason
            json.loads(answer.choices[0].message.content)  # one side wrote it, held to the schema
            assert c.stats()["clouds"][0]["capabilities"]["grammar"] is False
            later = c.chat.completions.create(**CASES["required"], temperature=0, max_tokens=80)
            assert later.route.noted("tools_one_side") is not None and later.choices[0].message.tool_calls
        with client(edge, url, mode="verified") as c, pytest.raises(ExtensionUnsupportedError) as refused:
            c.chat.completions.create(**CASES["json_schema"], temperature=0, max_tokens=80)
        assert refused.value.extension == "grammar"


JSON = {"response_format": {"type": "json_object"}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"grammar": {"response_format": {"type": "json_schema"}}, "grammar_from": 2}, "grammar"),  # no schema
    ({"grammar": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                  "tool_choice": {"type": "function", "function": {"name": "g"}}}, "grammar_from": 2}, "grammar"),
    ({"grammar": {"response_format": {"type": "text"}}, "grammar_from": 2}, "grammar"),  # nothing to hold to
    ({"grammar": {"gbnf": "root ::= ("}, "grammar_from": 2}, "grammar"),  # no raw grammar from the wire
    ({"grammar": JSON, "grammar_from": 9}, "grammar_from"),  # after the first checked token
    ({"grammar": JSON, "grammar_from": 1}, "grammar_from"),  # the answer so far is no JSON
    ({"grammar": JSON}, "grammar_from"),
    ({"grammar_from": 1}, "grammar"),
])
def test_bad_grammar_checks_are_400s_naming_the_field(cloud: ServeProcess, extra: dict[str, Any], param: str) -> None:
    body = {"model": "qwen2.5-coder-0.5b-instruct-q4", "prompt": [9707, 11, 1879, 0], "max_tokens": 1,
            "echo": True, "logprobs": 1, "score_from": 3, **extra}
    answer = httpx.post(f"{cloud.url}/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"},
                        timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert httpx.get(f"{cloud.url}/health", timeout=10).status_code == 200  # the server lives on
