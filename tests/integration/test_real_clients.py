"""The clients agents and apps use, against a real ``edgecloud serve`` (llama.cpp, SmolLM2):
LangChain's ``ChatOpenAI`` (which sends ``max_completion_tokens``) and litellm, plain and
streamed, with the fields those clients add."""

from __future__ import annotations

from typing import Any

import pytest

from faults import ServeProcess

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

MODEL = "smollm2-135m-instruct-q4"
KEY = "sk-test"


def test_langchain_invoke_and_stream(server: ServeProcess) -> None:
    openai_chat = pytest.importorskip("langchain_openai")
    llm = openai_chat.ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=MODEL, max_tokens=12,
                                 temperature=0, stream_usage=True)
    try:
        reply = llm.invoke("Say hello.")
        parts = list(llm.stream("Say hello."))
    finally:
        llm.root_client.close()
    assert reply.content and reply.usage_metadata["output_tokens"] <= 12
    streamed = "".join(str(p.content) for p in parts)
    assert streamed == reply.content
    usage = sum((p.usage_metadata or {}).get("output_tokens", 0) for p in parts)
    assert usage == reply.usage_metadata["output_tokens"]  # counted once, not twice


@pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's own pydantic models warn on import
def test_litellm_completion_plain_and_streamed(server: ServeProcess, litellm: Any) -> None:
    import openai

    # litellm would pool a client of its own that nothing closes; it takes the caller's instead
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as client:
        common = {"model": f"openai/{MODEL}", "api_base": f"{server.url}/v1", "api_key": KEY, "client": client,
                  "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12, "temperature": 0}
        whole = litellm.completion(**common)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(stream=True, **common))
    assert whole.choices[0].message.content and whole.usage.completion_tokens <= 12
    assert streamed == whole.choices[0].message.content


def test_openai_sdk_with_the_fields_recent_clients_add(server: ServeProcess) -> None:
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_completion_tokens=8, temperature=0,
            store=False, metadata={"app": "test"}, service_tier="auto", response_format={"type": "text"})
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           functions=[{"name": "f", "parameters": {}}])
    assert reply.choices[0].message.content and reply.usage.completion_tokens <= 8
    assert info.value.body["param"] == "functions" and "tools" in info.value.body["message"]
