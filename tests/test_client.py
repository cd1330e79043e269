"""EdgeCloud / AsyncEdgeCloud on the real SmolLM2 model (edge only, no cloud configured)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from edgecloud import AsyncEdgeCloud, ChatCompletion, EdgeCloud, InvalidRequestError

QUESTION = [{"role": "user", "content": "Name a primary colour."}]


@pytest.fixture(scope="module")
def client(smollm2_path: Path):  # type: ignore[no-untyped-def]
    with EdgeCloud(edge_model=smollm2_path, n_ctx=1024) as c:
        yield c


def test_create_returns_openai_shape_with_route(client: EdgeCloud) -> None:
    reply = client.chat.completions.create(messages=QUESTION, max_tokens=8, temperature=0)
    assert isinstance(reply, ChatCompletion)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0
    assert reply.route is not None and reply.route.target == "edge"
    assert reply.route.noted("only_side") is not None


def test_stream_chunks_each_carry_the_route(client: EdgeCloud) -> None:
    chunks = list(client.chat.completions.create(messages=QUESTION, max_tokens=8, temperature=0, stream=True))
    assert chunks and all(c.route is not None and c.route.backend == "llamacpp" for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.text for c in chunks)
    whole = client.chat.completions.create(messages=QUESTION, max_tokens=8, temperature=0)
    assert streamed == whole.choices[0].message.content


def test_a_stream_is_a_context_manager_that_stops_generation(client: EdgeCloud) -> None:
    with client.chat.completions.create(messages=QUESTION, max_tokens=64, temperature=0, stream=True) as stream:
        first = [next(stream) for _ in range(3)]
    assert first[0].choices[0].delta.role == "assistant"
    with pytest.raises(StopIteration):
        next(stream)  # closed: nothing more comes


def test_include_usage_puts_usage_on_a_last_chunk_without_choices(client: EdgeCloud) -> None:
    chunks = list(client.chat.completions.create(messages=QUESTION, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason in ("stop", "length") and chunks[-2].cost is not None
    plain = list(client.chat.completions.create(messages=QUESTION, max_tokens=8, temperature=0, stream=True))
    assert plain[-1].choices and plain[-1].usage is not None  # without it: on the finish chunk, with route and cost


def test_privacy_pin_is_reported(client: EdgeCloud) -> None:
    reply = client.chat.completions.create(messages=QUESTION, max_tokens=4, privacy="local_only")
    assert reply.route is not None and reply.route.noted("privacy") is not None


def test_cloud_route_without_cloud_is_a_clear_error(client: EdgeCloud) -> None:
    with pytest.raises(InvalidRequestError, match="no cloud endpoint"):
        client.chat.completions.create(messages=QUESTION, route="cloud")


def test_bad_input_fails_before_any_model_loads() -> None:
    lazy = EdgeCloud(edge_model="no-such-model")
    with pytest.raises(InvalidRequestError) as info:
        lazy.chat.completions.create(messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert info.value.param == "temperature"


def test_async_stream_is_an_async_context_manager(smollm2_path: Path) -> None:
    async def go() -> list[Any]:
        async with AsyncEdgeCloud(edge_model=smollm2_path, n_ctx=1024) as ac:
            stream = await ac.chat.completions.create(messages=QUESTION, max_tokens=8, temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
            async with stream:
                return [c async for c in stream]

    chunks = asyncio.run(go())
    assert chunks[-1].choices == [] and chunks[-1].usage is not None


def test_async_client(smollm2_path: Path) -> None:
    async def go() -> tuple[str, str]:
        async with AsyncEdgeCloud(edge_model=smollm2_path, n_ctx=1024) as ac:
            whole = await ac.chat.completions.create(messages=QUESTION, max_tokens=8, temperature=0)
            stream = await ac.chat.completions.create(messages=QUESTION, max_tokens=8, temperature=0, stream=True)
            text = "".join([c.text async for c in stream])
            return whole.choices[0].message.content, text

    whole, streamed = asyncio.run(go())
    assert whole and whole == streamed


@pytest.mark.parametrize(("params", "field"), [
    ({"seed": 2**64}, "seed"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stop": ""}, "stop"),
])
def test_inputs_that_killed_the_server_are_refused_naming_the_field(client: EdgeCloud, params: dict, field: str) -> None:
    from edgecloud.errors import InvalidRequestError

    request = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **params}
    with pytest.raises(InvalidRequestError) as info:
        client.chat.completions.create(**request)
    assert info.value.param == field
    assert client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=2).choices


def test_a_tiny_temperature_answers_as_greedy(client: EdgeCloud) -> None:
    ask = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6}
    greedy = client.chat.completions.create(**ask, temperature=0).choices[0].message.content
    assert client.chat.completions.create(**ask, temperature=1e-50).choices[0].message.content == greedy
