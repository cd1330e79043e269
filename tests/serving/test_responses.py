"""``POST /v1/responses`` through the official ``openai`` client: text, streamed events, function
tools, ``previous_response_id``, and 400s that name what is not served; a 404 names the path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from faults import serving

KEY = "sk-test"
ADD = {"type": "function", "name": "add", "description": "Add two numbers",
       "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                      "required": ["a", "b"]}}


@pytest.fixture(scope="module")
def api(smollm2_path: Path) -> Iterator[Any]:
    with serving("llamacpp", smollm2_path, n_ctx=1024, api_key=KEY) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        yield client
        client.close()


def test_a_text_answer_and_its_stream_say_the_same(api: Any) -> None:
    whole = api.responses.create(model="m", input="Name one colour.", max_output_tokens=12, temperature=0,
                                 instructions="Answer in one word.")
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.output[0].type == "message"
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    events = list(api.responses.create(model="m", input="Name one colour.", max_output_tokens=12, temperature=0,
                                       instructions="Answer in one word.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == sorted(e.sequence_number for e in events)


def test_a_function_tool_is_called_and_its_result_continues_the_conversation(api: Any) -> None:
    first = api.responses.create(model="m", input="What is 2 plus 3? Use the add tool.", tools=[ADD],
                                 tool_choice="required", parallel_tool_calls=False, max_output_tokens=64,
                                 temperature=0)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "add" and set(__import__("json").loads(call.arguments)) == {"a", "b"}
    later = api.responses.create(model="m", previous_response_id=first.id, max_output_tokens=16, temperature=0,
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert later.previous_response_id == first.id and later.output_text
    # streamed: the call opens, its arguments arrive in pieces, it closes with all of them
    events = list(api.responses.create(model="m", input="What is 2 plus 3? Use the add tool.", tools=[ADD],
                                       tool_choice="required", parallel_tool_calls=False, max_output_tokens=64,
                                       temperature=0, stream=True))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(added) == 1 and added[0].item.name == "add" and len(deltas) > 1
    assert "".join(deltas) == done.arguments == call.arguments
    assert events[-1].response.output[0].arguments == call.arguments


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "file_search_call"}]}, "input[0].type"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_is_not_served_is_a_400_naming_the_field(api: Any, extra: dict[str, Any], param: str) -> None:
    body = {"model": "m", "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        api.post("/responses", body=body, cast_to=object)
    assert info.value.body["param"] == param, info.value.body


def test_a_404_names_the_path_and_what_is_served(api: Any) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        api.post("/nothing/here", body={}, cast_to=object)
    message = info.value.body["message"]
    assert "/v1/nothing/here" in message and "POST /v1/responses" in message
