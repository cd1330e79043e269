"""`edgecloud serve --quant fp8` on the 0.5B model as a real process: clients, metrics, bad input.

One server process (module fixture) with an API key, a batch of 2 and a queue of 1, so that
the queue-full case is reachable with four requests. Everything goes over loopback: the
official ``openai`` client, our ``CloudBackend`` and raw httpx for exact status codes.
"""

from __future__ import annotations

import json

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from edgecloud.remote.client import CloudBackend
from edgecloud.types import ChatRequest

KEY = "sk-engine-test"
MODEL = "qwen2.5-coder-0.5b-instruct-q4"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "Write a Python function that returns the square of x."}]


from faults import free_port as _free_port  # noqa: E402


@pytest.fixture(scope="module")
def server(qwen05_path: Path) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgecloud", "serve", "--engine", "torch", "--model", MODEL, "--quant", "fp8", "--port", str(port),
         "--api-key", KEY, "--max-batch", "2", "--max-queue", "1", "--ctx", "512", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
        assert "Traceback" not in err, err


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    match = re.search(rf"^edgecloud:{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match, f"edgecloud:{name} missing from /metrics"
    return float(match.group(1))


def _wait_idle(base: str) -> None:
    deadline = time.monotonic() + 120
    while _metric(base, "num_requests_running") or _metric(base, "num_requests_waiting"):
        assert time.monotonic() < deadline, "requests never left the batch"
        time.sleep(0.2)


def test_openai_client_plain_and_streaming(server: str) -> None:
    with openai.OpenAI(base_url=f"{server}/v1", api_key=KEY) as client:
        reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    text = reply.choices[0].message.content
    assert text and reply.usage.completion_tokens == 12 and reply.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    # The second identical prompt came from the prefix cache, reported where OpenAI reports it.
    assert _metric(server, "prefix_cache_hits_total") > 0
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and 0 < details.cached_tokens < chunks[-1].usage.prompt_tokens
    assert "speculative" not in (reply.usage.model_extra or {})  # no speculation, no empty block


def test_cloud_backend_and_text_completions(server: str) -> None:
    with CloudBackend(server, MODEL, api_key=KEY) as backend:
        answer = backend.complete(ChatRequest(messages=HELLO, max_tokens=8, temperature=0))
    assert answer.text and answer.usage.completion_tokens == 8
    with openai.OpenAI(base_url=f"{server}/v1", api_key=KEY) as client:
        done = client.completions.create(model=MODEL, prompt="def square(x):\n    return", max_tokens=6, temperature=0)
        pieces = list(client.completions.create(model=MODEL, prompt="def square(x):\n    return", max_tokens=6,
                                                temperature=0, stream=True))
    assert done.object == "text_completion" and done.choices[0].text
    assert "".join(p.choices[0].text for p in pieces if p.choices) == done.choices[0].text
    assert done.usage is not None and done.usage.completion_tokens == 6


def test_metrics_use_vllm_names(server: str) -> None:
    text = httpx.get(f"{server}/metrics").text
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "num_requests_running", "num_requests_waiting",
                 "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "request_success_total"):
        assert f"edgecloud:{name}" in text


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        (b"{not json", 400, None, "not valid JSON"),
        ({"messages": "hi"}, 400, "messages", ""),
        ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", ""),
        ({"messages": []}, 400, "messages", "at least one"),
        ({"messages": HELLO, "max_tokens": "ten"}, 400, "max_tokens", ""),
        ({"messages": HELLO, "n": 2}, 400, "n", "only n=1"),
        ({"messages": HELLO, "model": "gpt-9"}, 404, "model", "does not exist"),
        ({"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages", "context window"),
        ({"messages": HELLO, "max_tokens": 100000}, 400, "messages", "max_tokens"),
    ],
)
def test_bad_input_gets_openai_errors(server: str, body: object, status: int, param: str | None, words: str) -> None:
    url = f"{server}/v1/chat/completions"
    reply = httpx.post(url, content=body, headers=AUTH) if isinstance(body, bytes) else httpx.post(url, json=body, headers=AUTH)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"]
    if "context window" in error["message"]:
        assert error["code"] == "context_length_exceeded" and re.search(r"\d+ tokens", error["message"])


def test_auth_size_and_method_errors(server: str) -> None:
    url = f"{server}/v1/chat/completions"
    assert httpx.post(url, json={"messages": HELLO}).status_code == 401
    wrong = httpx.post(url, json={"messages": HELLO}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    big = httpx.post(url, content=b"x" * (4 * 1024 * 1024 + 1), headers=AUTH)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert httpx.get(url, headers=AUTH).status_code == 405
    bad_completion = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "echo": True}, headers=AUTH)
    assert bad_completion.status_code == 400 and bad_completion.json()["error"]["param"] == "echo"


def test_full_queue_429_and_disconnects_free_the_batch(server: str) -> None:
    _wait_idle(server)
    # ignore_eos (vLLM's extension): these answers cannot end before the test closes them.
    long = {"messages": HELLO, "max_tokens": 300, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as client:
        streams = []
        iters = []
        refused = None
        try:
            # Capacity is max_batch 2 + max_queue 1: the 4th concurrent request must be refused.
            for _ in range(4):
                response = client.send(client.build_request("POST", f"{server}/v1/chat/completions",
                                                            json=long, headers=AUTH), stream=True)
                streams.append(response)
                if response.status_code != 200:
                    refused = response
                    break
                # Keep the line iterator alive: a discarded one is closed when it is garbage-collected,
                # which closes the connection, and the server then rightly cancels that request.
                lines = response.iter_lines()
                iters.append(lines)
                next(lines)  # the role chunk: the request is in the scheduler
            assert refused is not None and len(streams) == 4, "four concurrent requests were all accepted"
            refused.read()
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["type"] == "rate_limit_error"
        finally:
            for response in streams:
                response.close()  # the client disconnects mid-stream
    _wait_idle(server)
    assert _metric(server, "num_requests_running") == 0


def test_tools_and_structured_output_are_held_to_their_schemas(server: str) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"},
                                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                 "required": ["city", "unit"], "additionalProperties": False}}}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    with openai.OpenAI(base_url=f"{server}/v1", api_key=KEY) as client:
        auto = client.chat.completions.create(model=MODEL, messages=ask, tools=[tool], max_tokens=48, temperature=0)
        # required, streamed (FP8 on a CPU is slow: the same call asked for whole is not asked again)
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello!"}], tools=[tool], stream=True,
            tool_choice="required", max_tokens=48, temperature=0))
        pieces = [call for chunk in chunks for choice in chunk.choices for call in choice.delta.tool_calls or []]
        finish = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
        shaped = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Give a number and a word."}], max_tokens=48,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"n": {"type": "integer"}, "w": {"type": "string", "maxLength": 12}},
                "required": ["n", "w"], "additionalProperties": False}}})
    # under auto the model (Qwen2.5's template renders the tools) calls it, and the call fits
    assert auto.choices[0].finish_reason == "tool_calls" and auto.choices[0].message.tool_calls[0].function.name == "get_weather"
    # required: a call even where the model would not make one, its arguments exactly the schema's,
    # arriving in pieces after a first delta with its id and name
    assert pieces[0].id and pieces[0].function.name == "get_weather" and len(pieces) > 2
    args = json.loads("".join(p.function.arguments or "" for p in pieces))
    assert finish == ["tool_calls"] and set(args) == {"city", "unit"}
    assert args["unit"] in ("celsius", "fahrenheit")
    answer = json.loads(shaped.choices[0].message.content)
    assert shaped.choices[0].finish_reason == "stop" and isinstance(answer["n"], int) and len(answer["w"]) <= 12


def test_penalties_change_what_greedy_decoding_repeats(server: str) -> None:
    ask = [{"role": "user", "content": "Write the word 'echo' twenty times, separated by spaces."}]
    with openai.OpenAI(base_url=f"{server}/v1", api_key=KEY) as client:
        plain = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=20, temperature=0)
        penalised = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=20, temperature=0,
                                                   frequency_penalty=2.0, presence_penalty=1.0)
    text, less = plain.choices[0].message.content, penalised.choices[0].message.content
    assert text.lower().count("echo") > less.lower().count("echo")


def test_logprobs_and_logit_bias_as_the_llama_cpp_engine_gives_them(server: str, qwen05_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    with openai.OpenAI(base_url=f"{server}/v1", api_key=KEY) as client:
        plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                               logprobs=True, top_logprobs=3)
        content = plain.choices[0].logprobs.content
        assert "".join(t.token for t in content) == plain.choices[0].message.content
        assert len(content) == plain.usage.completion_tokens
        for token in content:
            alternatives = [a.logprob for a in token.top_logprobs]
            assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
            # greedy: the token taken is the most likely one, with the same logprob
            assert token.top_logprobs[0].token == token.token and abs(alternatives[0] - token.logprob) < 1e-4
            assert token.logprob <= 0.0
        vocab = llama_cpp.Llama(model_path=str(qwen05_path), vocab_only=True, verbose=False)
        try:
            first_id = vocab.tokenize(content[0].token.encode(), add_bos=False, special=False)[0]
        finally:
            vocab.close()
        banned = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                                logit_bias={str(first_id): -100})
        assert not banned.choices[0].message.content.startswith(content[0].token)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, logit_bias={"99999999": 1})
        assert info.value.param == "logit_bias"
