"""The tool-call parts without a model: request validation, the streamed parser, prompts for
templates without tools, and the call grammar (compiled by real llama.cpp)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from edgecloud.errors import InvalidRequestError
from edgecloud.runtime.chat_template import CHATML_TEMPLATE, ChatTemplate
from edgecloud.tools.parse import ToolCallParser
from edgecloud.tools.spec import ToolCall, ToolCallDelta
from edgecloud.types import ChatCompletionChunk, ChatRequest, ChunkChoice, ChoiceDelta, collect_chunks

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}


def request(**fields: Any) -> ChatRequest:
    return ChatRequest(**{"messages": ASK, "tools": [WEATHER, ADD], **fields})


def parse(text: str, step: int, names: tuple[str, ...] = ("get_weather", "add"),
          stream: bool = False) -> tuple[str, list[tuple[str, Any]]]:
    """Text and calls of ``text`` pushed ``step`` characters at a time, the calls assembled from the
    parser's deltas as the openai SDK assembles them."""
    text_out, held = stream_parse(text, step, names, stream)
    return text_out, [(held[i].function.name, json.loads(held[i].function.arguments)) for i in sorted(held)]


def stream_parse(text: str, step: int, names: tuple[str, ...] = ("get_weather", "add"),
                 stream: bool = True, pieces: list[ToolCallDelta] | None = None) -> tuple[str, dict[int, ToolCall]]:
    """Text and calls (by index) of ``text`` pushed ``step`` characters at a time; ``pieces``
    collects each ``tool_calls`` delta as sent."""
    parser, out, held = ToolCallParser(names, stream=stream), [], {}
    sent = pieces if pieces is not None else []
    for i in range(0, len(text) + step, step):
        delta, found = parser.push(text[i:i + step]) if i < len(text) else parser.flush()
        out.append(delta)
        for piece in parser.deltas(found):
            sent.append(piece.model_copy(deep=True))
            ToolCallDelta.gather(held, piece)
        if i >= len(text):
            break
    calls = {i: d.call() for i, d in held.items()}
    assert [c.id for c in parser.calls] == [calls[i].id for i in sorted(calls)]
    return "".join(out), calls


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("stream", [False, True])
def test_tagged_calls_come_out_whole_whatever_the_delta_size(step: int, stream: bool) -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert parse(text, step, stream=stream) == ("Let me check.", [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})])


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("stream", [False, True])
def test_text_is_never_lost(step: int, stream: bool) -> None:
    for text in ["Hello <tool_ca there", "a < b and <tool", "<tool_call>\nnot json\n</tool_call> ok",
                 "```python\nprint(1)\n```", '{"a": 1}', '{"name": "unknown_fn", "arguments": {}}', "   "]:
        assert parse(text, step, stream=stream) == (text, []), text


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bare_call_opening_the_answer_is_a_call(step: int, stream: bool) -> None:
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```'
    assert parse(fenced, step, stream=stream) == ("", [("get_weather", {"city": "Paris"})])
    assert parse('{"name": "add", "parameters": {"a": 2, "b": 3}} Done.', step, stream=stream) == ("Done.", [("add", {"a": 2, "b": 3})])


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_counts_only_if_it_parses(stream: bool) -> None:
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert parse(cut, 3, stream=stream)[1] == [("add", {"a": 1, "b": 2})]
    assert parse('<tool_call>\n{"name": "add", "argu', 3, stream=stream) == ('<tool_call>\n{"name": "add", "argu', [])
    # once its arguments have started to stream a call stays one, cut off as OpenAI's are (the
    # answer's finish_reason, "length", says so)
    shown, calls = stream_parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b', 3)
    assert shown == "" and calls[0].function.arguments == '{"a": 1, "b'


@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_arguments_arrive_in_pieces_that_join_into_the_call(step: int) -> None:
    arguments = '{"city": "Oslo \\"centre\\" {not a brace}", "unit": "c", "days": [1, {"x": [2]}]}'
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": ' + arguments + '}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    pieces: list[ToolCallDelta] = []
    shown, calls = stream_parse(text, step, pieces=pieces)
    assert shown == "Checking."
    assert [(c.function.name, c.function.arguments) for c in calls.values()] == [
        ("get_weather", arguments), ("add", '{"a": 1, "b": 2}')]
    first = [p for p in pieces if p.index == 0]
    # OpenAI's order: index, id, type and name first (arguments empty), then only arguments
    assert first[0].id and first[0].type == "function" and first[0].function.name == "get_weather"
    assert first[0].function.arguments == ""
    assert all(p.id is None and p.function.name is None for p in first[1:])
    assert len(first) > 2 and "".join(p.function.arguments for p in first) == arguments
    assert [p.index for p in pieces] == sorted(p.index for p in pieces)  # one call at a time


def test_a_streamed_bare_call_and_calls_that_cannot_stream() -> None:
    pieces: list[ToolCallDelta] = []
    shown, calls = stream_parse('```json\n{{"name": "add", "arguments": {"a": 2}}\n```', 2, pieces=pieces)
    assert shown == "" and calls[0].function.arguments == '{"a": 2}' and len(pieces) > 2
    # arguments written as a JSON text, keys in another order, a name nobody declared: not
    # streamed, whole at the end (as without streaming)
    for text in ['<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',
                 '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>',
                 '<tool_call>{"name": "sub", "arguments": {"a": 1}}</tool_call>']:
        pieces = []
        shown, calls = stream_parse(text, 1, pieces=pieces)
        assert shown == "" and json.loads(calls[0].function.arguments) == {"a": 1} and len(pieces) == 1, text


def test_tool_choice_forms_and_their_errors() -> None:
    assert request().tool_mode.mode == "auto" and ChatRequest(messages=ASK).tool_mode.mode == "none"
    named = request(tool_choice={"type": "function", "function": {"name": "add"}})
    assert (named.tool_mode.mode, named.tool_mode.name, named.tool_mode.parallel) == ("required", "add", False)
    assert request(tool_choice="none").tool_dicts() is None
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ]
    for fields, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            request(**fields)
        assert info.value.param == param, (fields, info.value)


def test_tool_results_must_answer_a_call() -> None:
    ok = request(messages=[*ASK, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "3 C"}])
    assert ok.message_dicts()[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # an object, for templates
    for bad, param in [({"role": "tool", "tool_call_id": "call_9", "content": "3 C"}, "messages[2].tool_call_id"),
                       ({"role": "tool", "content": "3 C"}, "messages[2].tool_call_id")]:
        with pytest.raises(InvalidRequestError) as info:
            request(messages=[*ASK, CALLED, bad])
        assert info.value.param == param
    with pytest.raises(InvalidRequestError, match="only assistant"):
        request(messages=[{**ASK[0], "tool_calls": CALLED["tool_calls"]}])
    with pytest.raises(InvalidRequestError, match="null"):
        request(messages=[{"role": "user", "content": None}])


def test_a_template_without_tools_gets_them_as_text() -> None:
    plain = ChatTemplate(CHATML_TEMPLATE)
    assert not plain.renders_tools
    req = request(messages=[*ASK, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "3 C, rain"}])
    text = plain.prompt(req.message_dicts(), tools=req.tool_dicts())
    assert text.startswith("<|im_start|>system\n") and '"name": "get_weather"' in text.split("<|im_end|>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n3 C, rain\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert plain.prompt(ChatRequest(messages=ASK).message_dicts()) == plain.prompt(ASK)  # no tools: unchanged


def test_collected_stream_assembles_calls_and_null_content() -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id="c", created=0, model="m",
                                   choices=[ChunkChoice(delta=ChoiceDelta(**delta), finish_reason=finish)])

    pieces = [{"role": "assistant"},
              {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}]
    done = collect_chunks([chunk(p) for p in pieces] + [chunk({}, "tool_calls")])
    message = done.choices[0].message
    assert message.content is None and done.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []] == [("call_a", "add", '{"a": 1}')]


def test_a_schema_the_grammar_compiler_cannot_handle_is_named_before_decoding() -> None:
    pytest.importorskip("llama_cpp")
    from edgecloud.runtime.sampling import sampling_params

    # valid JSON Schema, but a $ref the converter cannot resolve: refused, never decoded unconstrained
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}
    with pytest.raises(InvalidRequestError) as info:
        sampling_params(ChatRequest(messages=ASK, tools=[broken], tool_choice="required"), 16, grammar=True)
    assert info.value.param == "tools[0].function.parameters"


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize("stream", [False, True])
def test_a_slipped_doubled_brace_is_still_a_call(step: int, stream: bool) -> None:
    assert parse('{{"name": "add", "arguments": {"a": 1, "b": 2}}}', step, stream=stream) == ("", [("add", {"a": 1, "b": 2})])
    assert parse('```json\n{{"name": "add", "arguments": {"a": 1}}\n```', step, stream=stream) == ("", [("add", {"a": 1})])
    tagged = '<tool_call>\n{{"name": "get_weather", "arguments": {"city": "Oslo"}}}\n</tool_call>'
    assert parse(tagged, step, stream=stream) == ("", [("get_weather", {"city": "Oslo"})])
    assert parse("{{not a call}}", step, stream=stream) == ("{{not a call}}", [])


def test_nested_models_with_defs_and_refs_compile_per_tool() -> None:
    """What pydantic writes for nested models (``$defs`` + ``$ref``, lists of models, recursion), in
    two tools that both name a ``User``: each keeps its own, and the grammar compiles."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from edgecloud.runtime.sampling import sampling_params
    from edgecloud.runtime.tool_grammar import hoist_definitions

    user = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    team = {"type": "object", "properties": {"name": {"type": "string"},
                                             "members": {"type": "array", "items": {"$ref": "#/$defs/User"}},
                                             "sub": {"anyOf": [{"$ref": "#/$defs/Team"}, {"type": "null"}]}}}
    first = {"type": "function", "function": {"name": "f", "parameters": {
        "$defs": {"User": user}, "type": "object", "properties": {"u": {"$ref": "#/$defs/User"}}}}}
    second = {"type": "function", "function": {"name": "g", "parameters": {
        "definitions": {"User": {"type": "string"}, "Team": team}, "type": "object",
        "properties": {"t": {"$ref": "#/definitions/Team"}, "owner": {"$ref": "#/definitions/User"}}}}}
    into: dict[str, Any] = {}
    moved = hoist_definitions(second["function"]["parameters"], "g_", into)
    assert "definitions" not in moved and moved["properties"]["t"] == {"$ref": "#/$defs/g_Team"}
    assert into["g_Team"]["properties"]["members"]["items"] == {"$ref": "#/$defs/g_User"}
    params = sampling_params(ChatRequest(messages=ASK, tools=[first, second], tool_choice="required"), 16, grammar=True)
    assert params.grammar is not None
    rules = {name.replace("_", "-") for name in re.findall(r"tool\d[-_][A-Za-z]+", params.grammar)}
    assert {"tool0-User", "tool1-Team"} <= rules  # each tool its own definitions
    llama_cpp.LlamaGrammar.from_string(params.grammar, verbose=False)  # llama.cpp parses it
