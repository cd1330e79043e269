"""Tool calls and structured output through real parts: the llama.cpp edge runtime, a real
``edgecloud serve`` (Qwen2.5-Coder 0.5B on the llama.cpp engine, whose chat template renders
tools), the official ``openai`` SDK, LangChain, litellm, instructor, pydantic-ai and the OpenAI
Agents SDK, unmodified, and the hybrid client falling back in the middle of a streamed call."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pydantic
import pytest

from edgecloud import EdgeCloud
from edgecloud.edge.llamacpp import LlamaCppBackend
from edgecloud.types import ChatRequest, collect_chunks
from faults import ScriptedServer, ServeProcess, sse_reply

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

QWEN = "qwen2.5-coder-0.5b-instruct-q4"
KEY = "sk-test"
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "description": "the city's name"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city",
                                            "parameters": WEATHER_PARAMS}}
ORDER_PARAMS = {"type": "object", "properties": {
    "item": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
             "required": ["sku", "qty"]},
    "rush": {"type": "boolean"}}, "required": ["item", "rush"]}
ORDER = {"type": "function", "function": {"name": "place_order", "description": "Order an item", "parameters": ORDER_PARAMS}}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "place_order": ORDER_PARAMS}


@pytest.fixture(scope="module")
def qwen_server(qwen05_path: Path) -> Iterator[ServeProcess]:
    with ServeProcess(str(qwen05_path), api_key=KEY, ctx=2048) as proc:
        yield proc


@pytest.fixture(scope="module")
def openai_client(qwen_server: ServeProcess) -> Iterator[Any]:
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{qwen_server.url}/v1", api_key=KEY, max_retries=0) as client:
        yield client


def valid(call: Any) -> dict[str, Any]:
    """The call's arguments, checked against its function's schema."""
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_a_template_without_tools_still_gets_valid_calls_when_required(smollm2_path: Path) -> None:
    # SmolLM2's template knows no tools (they go in as text) and a 135M model writes poor JSON:
    # the grammar alone makes every call parse and fit its schema
    edge = LlamaCppBackend(smollm2_path, n_ctx=1024)
    try:
        for choice in ("required", {"type": "function", "function": {"name": "place_order"}}):
            request = ChatRequest(messages=[{"role": "user", "content": "Order two of sku A-1, rush it."}],
                                  tools=[WEATHER, ORDER], tool_choice=choice, temperature=0, max_tokens=120)
            answer = collect_chunks(edge.stream(request))
            calls = answer.choices[0].message.tool_calls or []
            assert answer.choices[0].finish_reason == "tool_calls" and calls, answer
            for call in calls:
                valid(call)
            if isinstance(choice, dict):
                assert [c.function.name for c in calls] == ["place_order"]  # named: that one, once
    finally:
        edge.close()


def test_openai_sdk_calls_streams_and_follows_up(openai_client: Any) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    whole = openai_client.chat.completions.create(model=QWEN, messages=ask, tools=[WEATHER, ORDER],
                                                  temperature=0, max_tokens=80)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert valid(message.tool_calls[0])["city"] == "Paris"
    # streamed: the SDK assembles the same call from the deltas
    with openai_client.chat.completions.stream(model=QWEN, messages=ask, tools=[WEATHER, ORDER], temperature=0,
                                               max_tokens=80) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    # the agent's next turn: its own call (content null) and the tool's result are accepted
    follow = openai_client.chat.completions.create(
        model=QWEN, temperature=0, max_tokens=40, tools=[WEATHER, ORDER],
        messages=[*ask, message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C and sunny"}])
    assert follow.choices[0].finish_reason in ("stop", "tool_calls", "length")
    none = openai_client.chat.completions.create(model=QWEN, messages=ask, tools=[WEATHER], tool_choice="none",
                                                 temperature=0, max_tokens=20)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_openai_sdk_sees_call_arguments_arrive_in_pieces(openai_client: Any) -> None:
    ask = [{"role": "user", "content": "Order two of sku A-1, rush it."}]
    params: dict[str, Any] = dict(model=QWEN, messages=ask, tools=[WEATHER, ORDER], tool_choice="required",
                                  temperature=0, max_tokens=80)
    pieces = [call for chunk in openai_client.chat.completions.create(**params, stream=True)
              for choice in chunk.choices for call in choice.delta.tool_calls or []]
    whole = openai_client.chat.completions.create(**params).choices[0].message.tool_calls
    first, rest = pieces[0], pieces[1:]
    assert first.index == 0 and first.id and first.type == "function" and first.function.name == "place_order"
    assert len([p for p in rest if p.function.arguments]) > 1
    assert all(p.index == 0 and p.id is None and not p.function.name for p in rest)
    joined = "".join(p.function.arguments or "" for p in pieces)
    jsonschema.validate(json.loads(joined), ORDER_PARAMS)
    # the pieces are the call the same request gets whole
    assert len(whole) == 1 and (whole[0].function.name, whole[0].function.arguments) == (first.function.name, joined)


def test_instructor_in_tools_mode(qwen_server: ServeProcess) -> None:
    """instructor's ``create``, ``create_iterable`` (a list of models: ``$defs`` / ``$ref`` in the
    tool's schema) and ``create_partial`` (one update per streamed piece of the arguments)."""
    instructor = pytest.importorskip("instructor")
    import openai
    import pydantic

    class User(pydantic.BaseModel):
        name: str
        age: int

    with openai.OpenAI(base_url=f"{qwen_server.url}/v1", api_key=KEY, max_retries=0) as raw:
        client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
        one = client.chat.completions.create(model=QWEN, response_model=User, temperature=0, max_tokens=60,
                                             messages=[{"role": "user", "content": "Jason is 25 years old."}])
        many = list(client.chat.completions.create_iterable(
            model=QWEN, response_model=User, temperature=0, max_tokens=120,
            messages=[{"role": "user", "content": "Jason is 25 years old and Sarah is 30."}]))
        partial = list(client.chat.completions.create_partial(
            model=QWEN, response_model=User, temperature=0, max_tokens=60,
            messages=[{"role": "user", "content": "Jason is 25 years old."}]))
    assert (one.name, one.age) == ("Jason", 25)
    assert [(u.name, u.age) for u in many] == [("Jason", 25), ("Sarah", 30)]
    assert len(partial) > 3 and (partial[-1].name, partial[-1].age) == ("Jason", 25)
    assert any(p.age is None for p in partial)  # seen while the call was still being written


class Item(pydantic.BaseModel):
    sku: str
    qty: int


class City(pydantic.BaseModel):
    name: str
    country: str


def test_pydantic_ai_nested_model_tool_and_output_type(qwen_server: ServeProcess) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    seen: list[tuple[Item, bool]] = []

    async def once(ctx: Any, tool: Any) -> Any:
        return None if seen else tool  # offered until called (the 0.5B model would call it again and again)

    async def run() -> tuple[Any, Any]:
        provider = OpenAIProvider(base_url=f"{qwen_server.url}/v1", api_key=KEY)
        model = OpenAIChatModel(QWEN, provider=provider)
        settings = ModelSettings(temperature=0, max_tokens=100)
        orders = Agent(model, instructions="Use your tools.", model_settings=settings)

        @orders.tool_plain(prepare=once)
        def place_order(item: Item, rush: bool) -> str:
            """Order an item."""
            seen.append((item, rush))
            return f"Order placed: {item.qty} x {item.sku}."

        try:
            ordered = await orders.run("Order two of sku A-1, rush it.")
            city = await Agent(model, output_type=City, model_settings=settings).run("What is the capital of France?")
        finally:
            await provider.client.close()
        return ordered, city

    ordered, city = asyncio.run(run())
    assert seen and seen[0][0] == Item(sku="A-1", qty=2) and seen[0][1] is True
    assert isinstance(ordered.output, str)
    assert isinstance(city.output, City) and city.output.country == "France"


def test_openai_sdk_structured_output_parses(openai_client: Any) -> None:
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str
        country: str
        population_millions: float

    answer = openai_client.chat.completions.parse(
        model=QWEN, messages=[{"role": "user", "content": "Describe the capital of France."}],
        response_format=City, temperature=0, max_tokens=80)
    assert isinstance(answer.choices[0].message.parsed, City)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}]},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]}, "messages[0].tool_call_id"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_tool_input_is_a_400_naming_the_field(openai_client: Any, fields: dict[str, Any], param: str) -> None:
    import openai

    body = {"model": QWEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(**body)
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


def test_langchain_bind_tools_invoke_and_stream(qwen_server: ServeProcess) -> None:
    openai_chat = pytest.importorskip("langchain_openai")
    llm = openai_chat.ChatOpenAI(base_url=f"{qwen_server.url}/v1", api_key=KEY, model=QWEN, temperature=0,
                                 max_tokens=80)

    def get_weather(city: str) -> str:
        """The weather now in a city."""
        return "sunny"

    bound = llm.bind_tools([get_weather])
    merged = None
    try:
        reply = bound.invoke("What's the weather in Rome?")
        for part in bound.stream("What's the weather in Rome?"):
            merged = part if merged is None else merged + part
        forced = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Hello there")
    finally:
        llm.root_client.close()
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"] and reply.tool_calls[0]["args"]["city"]
    assert merged is not None and [c["name"] for c in merged.tool_calls] == ["get_weather"]
    assert [c["name"] for c in forced.tool_calls] == ["get_weather"]


@pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's own pydantic models warn on import
def test_litellm_with_tools(qwen_server: ServeProcess, litellm: Any) -> None:
    import openai

    # litellm would pool a client of its own that nothing closes; it takes the caller's instead
    with openai.OpenAI(base_url=f"{qwen_server.url}/v1", api_key=KEY, max_retries=0) as client:
        reply = litellm.completion(model=f"openai/{QWEN}", api_base=f"{qwen_server.url}/v1", api_key=KEY, client=client,
                                   messages=[{"role": "user", "content": "Weather in Oslo, in fahrenheit?"}],
                                   tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80)
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and valid(call)["city"]


@pytest.mark.parametrize("api", ["default", "chat"])
def test_openai_agents_sdk_runs_a_function_tool(qwen_server: ServeProcess, api: str) -> None:
    """The Agents SDK, unmodified, with one function tool: its default model (the provider picks
    the Responses API, ``/v1/responses``) and ``OpenAIChatCompletionsModel``. The 0.5B model calls
    the tool again after its result rather than answering, so the run stops at the tool."""
    agents = pytest.importorskip("agents")
    import openai

    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        seen.append(city)
        return f"It is 18 C and sunny in {city}."

    async def run() -> Any:
        # the client is opened and closed on the loop that runs the agent (Runner.run_sync would
        # leave its own loop and the client's pooled connection open)
        async with openai.AsyncOpenAI(base_url=f"{qwen_server.url}/v1", api_key=KEY, max_retries=0) as client:
            model = QWEN if api == "default" else agents.OpenAIChatCompletionsModel(model=QWEN, openai_client=client)
            agent = agents.Agent(name="weather", instructions="Use your tools to answer.", model=model,
                                 tools=[get_weather], model_settings=agents.ModelSettings(temperature=0, max_tokens=80),
                                 tool_use_behavior="stop_on_first_tool")
            config = agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client))
            return await agents.Runner.run(agent, "What's the weather in Madrid?", max_turns=3, run_config=config)

    agents.set_tracing_disabled(True)
    default = agents.OpenAIProvider(openai_client=openai.AsyncOpenAI(base_url=qwen_server.url, api_key=KEY)).get_model(QWEN)
    assert isinstance(default, agents.OpenAIResponsesModel)  # what "default" runs
    result = asyncio.run(run())
    assert seen and "Madrid" in seen[0] and result.final_output == f"It is 18 C and sunny in {seen[0]}."


def test_the_hybrid_client_calls_tools_on_either_side(qwen05_path: Path, qwen_server: ServeProcess) -> None:
    edge = LlamaCppBackend(qwen05_path, n_ctx=2048)
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    try:
        # a generous timeout: on a busy machine a slow cloud answer must not turn into a fallback here
        with EdgeCloud(edge_backend=edge, cloud_base_url=qwen_server.url, cloud_model=QWEN, cloud_api_key=KEY,
                       config={"fallback": {"timeout_s": 300}}) as c:
            for route in ("edge", "cloud"):
                answer = c.chat.completions.create(messages=ask, tools=[WEATHER], route=route, temperature=0, max_tokens=80)
                assert answer.route.target == route and answer.choices[0].finish_reason == "tool_calls"
                assert valid(answer.choices[0].message.tool_calls[0])["city"] == "Paris"
                assert answer.route.noted("tools_one_side") is not None
            with c.chat.completions.create(messages=ask, tools=[WEATHER], route="edge", temperature=0, max_tokens=80,
                                           stream=True, stream_options={"include_usage": True}) as stream:
                chunks = list(stream)
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
            assert collect_chunks(chunks).choices[0].message.tool_calls[0].function.name == "get_weather"
    finally:
        edge.close()


def piece(**delta: Any) -> str:
    chunk = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    return f"data: {json.dumps(chunk)}\n\n"


def test_a_stream_broken_inside_a_call_restarts_that_call_on_the_other_side(qwen05_path: Path) -> None:
    # a cloud that streams a call in pieces (as vLLM does) and drops the connection inside it
    fake = ScriptedServer()
    fake.script(sse_reply(piece(role="assistant", content=""),
                          piece(tool_calls=[{"index": 0, "id": "call_c", "type": "function",
                                             "function": {"name": "get_weather", "arguments": '{"city": "Ber'}}]),
                          cut=True))
    edge = LlamaCppBackend(qwen05_path, n_ctx=2048)
    try:
        with EdgeCloud(edge_backend=edge, cloud_base_url=fake.url, cloud_model="m",
                       config={"fallback": {"max_retries": 0}}) as c:
            chunks = list(c.chat.completions.create(
                messages=[{"role": "user", "content": "What is the weather in Paris right now?"}], tools=[WEATHER],
                route="cloud", temperature=0, max_tokens=80, stream=True))
    finally:
        edge.close()
        fake.close()
    pieces = [d for ch in chunks for choice in ch.choices for d in choice.delta.tool_calls or []]
    assert all(d.function.name for d in pieces)  # never half a call: each one whole
    answer = collect_chunks(chunks)
    calls = answer.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"] and valid(calls[0])["city"] == "Paris"
    assert answer.route.target == "edge" and answer.route.fallbacks[0]["from"] == "cloud"
