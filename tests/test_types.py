"""Request validation: every bad field raises InvalidRequestError naming that field."""

from __future__ import annotations

from typing import Any

import pytest

from edgecloud import ChatRequest, InvalidRequestError
from edgecloud.types import ChatCompletionChunk, ChoiceDelta, ChunkChoice, Usage, collect_chunks

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
        ({"messages": [*USER, {"role": "user", "content": {"a": 1}}]}, "messages[1].content"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "max_tokens": -5}, "max_tokens"),
        ({"messages": USER, "temperature": -0.1}, "temperature"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "top_p": 1.01}, "top_p"),
        ({"messages": USER, "stop": [1, 2]}, "stop"),
        ({"messages": USER, "temprature": 0.5}, "temprature"),
        ({"messages": USER, "route": "moon"}, "route"),
    ],
)
def test_bad_field_names_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        ChatRequest(**fields)
    assert info.value.param == param
    assert param in str(info.value)
    assert isinstance(info.value, ValueError)


def test_parse_rejects_non_object() -> None:
    with pytest.raises(InvalidRequestError):
        ChatRequest.parse(["not", "a", "dict"])


def test_parse_translates_like_construction() -> None:
    with pytest.raises(InvalidRequestError) as info:
        ChatRequest.parse({"messages": USER, "max_tokens": 0})
    assert info.value.param == "max_tokens"


def test_text_parts_are_joined_and_developer_maps_to_system() -> None:
    request = ChatRequest(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        stop="END",
    )
    assert request.message_dicts() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    assert request.stop_sequences == ["END"]


def test_collect_chunks_folds_text_finish_and_usage() -> None:
    def chunk(**kw: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id="c1", created=1, model="m", **kw)

    chunks = [
        chunk(choices=[ChunkChoice(delta=ChoiceDelta(role="assistant"))]),
        chunk(choices=[ChunkChoice(delta=ChoiceDelta(content="Hel"))]),
        chunk(choices=[ChunkChoice(delta=ChoiceDelta(content="lo"))]),
        chunk(choices=[ChunkChoice(finish_reason="length")], usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)),
    ]
    done = collect_chunks(chunks)
    assert done.text == "Hello"
    assert done.choices[0].finish_reason == "length"
    assert done.usage.total_tokens == 5


def test_collect_empty_stream_is_an_error() -> None:
    with pytest.raises(InvalidRequestError):
        collect_chunks([])


def test_usage_is_also_in_openai_shape_and_skips_an_empty_speculative_block() -> None:
    import json

    usage = Usage(prompt_tokens=40, completion_tokens=8, total_tokens=48, cached_tokens=32)
    assert usage.prompt_tokens_details.cached_tokens == 32  # the openai client's attribute path
    data = json.loads(usage.model_dump_json())
    assert data["prompt_tokens_details"] == {"cached_tokens": 32} and data["cached_tokens"] == 32
    assert "speculative" not in data
    assert json.loads(Usage(speculative={"drafts": 3}).model_dump_json())["speculative"] == {"drafts": 3}
    assert Usage.model_validate(data) == usage  # what it writes reads back


def test_max_completion_tokens_is_max_tokens() -> None:
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=7)
    assert request.max_tokens == 7
    assert ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=7, max_completion_tokens=7).max_tokens == 7
    with pytest.raises(InvalidRequestError) as info:
        ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=3, max_completion_tokens=4)
    assert info.value.param == "max_completion_tokens"


def test_fields_without_meaning_here_are_accepted() -> None:
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], store=False, metadata={"k": "v"},
                          service_tier="auto", reasoning_effort="low", response_format={"type": "text"},
                          modalities=["text"])
    assert request.messages[0].content == "hi"


@pytest.mark.parametrize("field, value, says", [
    ("functions", [{"name": "f"}], "send the functions as 'tools'"),
    ("tool_choice", "auto", "needs 'tools'"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "JSON object"),
    ("logit_bias", {"x": 5}, "token ids"),
    ("logit_bias", {"42": 500}, "-100..100"),
    ("response_format", {"type": "json_schema", "json_schema": {}}, "needs {'json_schema'"),
    ("response_format", {"type": "yaml"}, "unknown response_format"),
    ("modalities", ["text", "audio"], "modalities"),
])
def test_features_not_implemented_or_malformed_are_named_not_called_unknown(field: str, value: Any, says: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        ChatRequest(messages=[{"role": "user", "content": "hi"}], **{field: value})
    assert info.value.param.startswith(field) and says in str(info.value) and "unknown field" not in str(info.value)


def test_an_image_part_says_the_model_reads_text_only() -> None:
    with pytest.raises(InvalidRequestError) as info:
        ChatRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                            {"type": "image_url", "image_url": {"url": "x"}}]}])
    assert info.value.param == "messages[0].content" and "text only" in str(info.value)
