"""A cloud that only chats, as hosted APIs do: every request answers, and says why it was shared so.

A real ``edgecloud serve`` (SmolLM2) behind :class:`~edgecloud.testing.HostedChatProxy`, which
refuses ``/v1/completions`` (404) and body fields OpenAI does not take (400), in OpenAI's words.
The cloud client learns each refusal once (a typed error, a capability remembered for the
client's life, never sent again); the default client steps down from verified mode to the mode
such a cloud can run (lead mode: the cloud opens, the edge takes over where it agrees) within the
first answer, and answers every request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from edgecloud import AsyncEdgeCloud, EdgeCloud
from edgecloud.backend import Backend
from edgecloud.errors import (
    ConfigError,
    ContextOverflowError,
    ContinuationUnsupportedError,
    InvalidRequestError,
    ScoringUnsupportedError,
)
from edgecloud.remote.client import CloudBackend
from edgecloud.testing import HostedChatProxy
from edgecloud.types import ChatCompletionChunk, ChatRequest, collect_chunks
from faults import ServeProcess

KEY = "sk-test"
MODEL = "smollm2-135m-instruct-q4"
PROMPTS = ["List three colours of the rainbow, one per line.", "What is the capital of France?",
           "Write a Python function that adds two numbers."]


@pytest.fixture(scope="module")
def edge(smollm2_path: Path) -> Iterator[Backend]:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(smollm2_path), n_ctx=1024) as backend:
        yield backend


@pytest.fixture()
def hosted(server: ServeProcess) -> Iterator[HostedChatProxy]:
    with HostedChatProxy(server.url) as proxy:
        yield proxy


def client(edge: Backend, url: str, **collab: Any) -> EdgeCloud:
    config = {"collab": collab, "fallback": {"max_retries": 0, "timeout_s": 30}, "router": {"pii": "off"}}
    return EdgeCloud(edge_backend=edge, cloud_base_url=url, cloud_model=MODEL, cloud_api_key=KEY, config=config)


def ask(c: EdgeCloud, prompt: str, **params: Any) -> tuple[str, ChatCompletionChunk]:
    chunks = list(c.chat.completions.create(messages=[{"role": "user", "content": prompt}], max_tokens=32,
                                            temperature=0, stream=True, **params))
    return "".join(ch.text for ch in chunks), chunks[-1]


def continuing(text: str) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": text}],
                       continue_final_message=True, max_tokens=4, temperature=0)


def test_the_backend_learns_each_refusal_once(hosted: HostedChatProxy) -> None:
    with CloudBackend(hosted.url, MODEL, api_key=KEY, max_retries=0) as cloud:
        with pytest.raises(ContinuationUnsupportedError) as refused:
            list(cloud.stream(continuing("Red")))
        assert refused.value.extension == "continue" and refused.value.cause == "unsupported"
        assert hosted.refused["continue_final_message"] == 1
        with pytest.raises(ContinuationUnsupportedError):  # known now: not sent again
            list(cloud.stream(continuing("Red\nOrange")))
        assert hosted.refused["continue_final_message"] == 1
        assert not cloud.supports_continuation
        plain = collect_chunks(cloud.stream(ChatRequest(messages=[{"role": "user", "content": PROMPTS[1]}],
                                                        max_tokens=8, temperature=0)))
        assert plain.text
        with pytest.raises(ScoringUnsupportedError):
            cloud.score([1, 2, 3], start=1)
        with pytest.raises(ScoringUnsupportedError):
            cloud.score([1, 2, 3], start=1)
        assert hosted.refused["completions"] == 1
        table = cloud.capabilities.table()
    assert table["continue"] is False and table["score"] is False and table["json_schema"] is None


def test_a_request_the_endpoint_refuses_for_itself_is_not_blamed_on_an_extension(server: ServeProcess,
                                                                                  hosted: HostedChatProxy) -> None:
    """Refused with and without the extension (too long for the model): the caller's error, and
    nothing learned about the extension."""
    too_long = continuing("word " * 3000)
    with CloudBackend(hosted.url, MODEL, api_key=KEY, max_retries=0) as cloud:
        with pytest.raises(InvalidRequestError) as refused:
            list(cloud.stream(too_long))
        assert not isinstance(refused.value, ContinuationUnsupportedError)
        assert cloud.capabilities.known("continue") is None
    with CloudBackend(server.url, MODEL, api_key=KEY, max_retries=0) as cloud:
        with pytest.raises(ContextOverflowError):
            list(cloud.stream(too_long))
        assert cloud.capabilities.known("continue") is None


def test_the_backend_finds_what_an_endpoint_takes_with_cheap_probes(server: ServeProcess,
                                                                     hosted: HostedChatProxy) -> None:
    with CloudBackend(server.url, MODEL, api_key=KEY) as direct, CloudBackend(hosted.url, MODEL, api_key=KEY) as chat:
        ours, theirs = direct.discover().table(), chat.discover().table()
    assert ours["score"] and ours["continue"] and ours["sessions"] and ours["logprobs"] and ours["stream_ids"]
    assert theirs["score"] is False and theirs["continue"] is False and theirs["logprobs"] is True


def test_the_defaults_answer_every_request_through_a_hosted_api(edge: Backend, hosted: HostedChatProxy) -> None:
    with client(edge, hosted.url) as c:
        answers = [ask(c, prompt) for prompt in PROMPTS]
        stats = c.stats()
    for text, final in answers:
        assert text and final.choices[0].finish_reason in ("stop", "length")
        assert final.route.collab == "lead"
        assert final.route.cloud_calls == 1  # one plain chat request: no check, no span
    first = [n.text for n in answers[0][1].route.notes if n.code == "collab_mode"]
    assert any("'score'" in t for t in first)  # the first answer stepped down within itself
    later = answers[1][1].route.notes
    assert any(n.code == "policy" and "lead" in n.text for n in later)  # later ones start there
    assert hosted.refused["completions"] == 1 and hosted.refused["continue_final_message"] == 1
    assert stats["clouds"][0]["capabilities"]["score"] is False
    assert stats["clouds"][0]["capabilities"]["continue"] is False


@pytest.mark.parametrize("threshold, side", [(0.0, "cloud"), (1.0, "edge")])
def test_probe_mode_gives_the_answer_to_one_side_whole(edge: Backend, hosted: HostedChatProxy, threshold: float,
                                                       side: str) -> None:
    with client(edge, hosted.url, mode="probe", probe_threshold=threshold) as c:
        text, final = ask(c, PROMPTS[2])
        alone, _ = ask(c, PROMPTS[2], route=side, collab="off")
    assert text == alone
    assert final.route.target == side
    assert final.route.cloud_calls == (1 if side == "cloud" else 0)
    assert [f.cause for f in final.route.fallbacks] == (["low_confidence"] if side == "cloud" else [])
    billed = final.cost.cloud_input_tokens if final.cost else 0
    assert (billed > 0) == (side == "cloud")


def test_lead_mode_hands_the_answer_to_the_edge_after_the_clouds_opening(edge: Backend,
                                                                         hosted: HostedChatProxy) -> None:
    with client(edge, hosted.url, mode="lead", lead_tokens=6, lead_agree=0.0) as c:
        text, final = ask(c, PROMPTS[2])
        alone, _ = ask(c, PROMPTS[2], route="cloud", collab="off")
    assert final.route.collab == "lead" and final.route.cloud_calls == 1
    assert final.cost is not None and 0 < final.cost.cloud_output_tokens <= 8  # the opening, and what was in flight
    assert final.cost.cloud_input_tokens > 0  # the prompt is billed though the stream was closed early
    assert final.cost.vs_all_cloud < 1
    opening = alone[:10]
    assert text.startswith(opening)  # the cloud's own opening, then the edge's continuation
    assert final.route.tokens["edge"] > 0 and 0 < final.route.tokens["cloud"] <= 8


def test_the_lead_check_leaves_out_what_the_opening_copies_from_the_prompt(edge: Backend) -> None:
    from edgecloud.collab.lead import agreement

    said = "Repeat after me: the quick brown fox jumps over the lazy dog."
    messages = [{"role": "user", "content": said}]
    opening = "The quick brown fox jumps over the lazy dog. It is a pangram: it uses every letter of"
    every, own = agreement(edge, messages, opening, 16), agreement(edge, messages, opening, 16, copy_ngram=4)
    assert every.tokens == own.tokens == every.counted == 16
    assert 0 < own.counted < own.tokens  # the copied words are not counted, the rest is
    whole = agreement(edge, messages, said, 16, copy_ngram=4)  # a copy, whole: every token counts
    assert whole.counted == whole.tokens > 0


def test_lead_mode_leaves_the_answer_to_the_cloud_where_the_edge_disagrees(qwen05_path: Path,
                                                                           hosted: HostedChatProxy) -> None:
    """Another family on the edge (Qwen 0.5B) does not write SmolLM2's opening token for token: with
    every token required, the cloud writes the whole answer, as it would alone."""
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(qwen05_path), n_ctx=1024) as other:
        with client(other, hosted.url, mode="lead", lead_tokens=8, lead_agree=1.0) as c:
            text, final = ask(c, PROMPTS[0])
            alone, whole = ask(c, PROMPTS[0], route="cloud", collab="off")
    assert text == alone
    assert final.cost is not None and final.cost.cloud_output_tokens == whole.cost.cloud_output_tokens
    assert any(n.code == "collab_mode" and n.value is not None and n.value < 1 for n in final.route.notes)


def test_a_refused_span_leaves_the_edge_to_write_on(edge: Backend, hosted: HostedChatProxy) -> None:
    """Token mode under ``auto`` (a redacted conversation shares text, not token ids): the first
    span needs no continuation; the next is refused, and the edge finishes the answer."""
    config = {"router": {"pii": "redact"}, "collab": {"gate": 0.0, "span_tokens": 2}, "fallback": {"max_retries": 0}}
    with EdgeCloud(edge_backend=edge, cloud_base_url=hosted.url, cloud_model=MODEL, cloud_api_key=KEY,
                   config=config) as c:
        text, final = ask(c, "Write one line to jane.doe@example.com about colours.")
        circuits = c.stats()["circuits"]
    assert text and final.route.collab == "token"
    assert final.route.tokens["cloud"] > 0 and final.route.tokens["edge"] > 0
    assert any(n.code == "collab_mode" and "'continue'" in n.text for n in final.route.notes)
    assert not final.route.fallbacks and set(circuits.values()) == {"closed"}  # a refusal is not an outage


def test_a_mode_asked_for_by_name_says_what_the_endpoint_refused(edge: Backend, hosted: HostedChatProxy) -> None:
    with client(edge, hosted.url, mode="token", gate=0.0, span_tokens=2) as c:
        with pytest.raises(ContinuationUnsupportedError):
            ask(c, PROMPTS[0])
    with client(edge, hosted.url) as c, pytest.raises(ConfigError, match="cannot score"):
        ask(c, PROMPTS[0], collab="verified")


def test_the_async_client_steps_down_too(edge: Backend, hosted: HostedChatProxy) -> None:
    async def main() -> tuple[str, ChatCompletionChunk]:
        config = {"fallback": {"max_retries": 0}, "router": {"pii": "off"}}
        async with AsyncEdgeCloud(edge_backend=edge, cloud_base_url=hosted.url, cloud_model=MODEL, cloud_api_key=KEY,
                                  config=config) as c:
            stream = await c.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[1]}],
                                                     max_tokens=16, temperature=0, stream=True)
            chunks = [chunk async for chunk in stream]
        return "".join(ch.text for ch in chunks), chunks[-1]

    text, final = asyncio.run(main())
    assert text and final.route.collab == "lead"


def test_plan_says_what_a_cloud_takes_and_what_auto_runs_with_it(smollm2_path: Path, server: ServeProcess,
                                                                 hosted: HostedChatProxy,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import typer
    from typer.testing import CliRunner

    from edgecloud.cli.plan import plan_command

    app = typer.Typer()
    app.command("plan")(plan_command)
    app.command("noop")(lambda: None)
    monkeypatch.setenv("EDGECLOUD_CLOUD_API_KEY", KEY)
    modes = {}
    for name, url in (("ours", server.url), ("hosted", hosted.url)):
        result = CliRunner().invoke(app, ["plan", "--model", str(smollm2_path), "--json", "--cloud-base-url", url,
                                          "--cloud-model", MODEL])
        assert result.exit_code == 0, result.output
        cloud = json.loads(result.stdout)["cloud"]
        modes[name] = (cloud["auto_mode"], cloud["capabilities"]["score"], cloud["capabilities"]["continue"])
    assert modes == {"ours": ("verified", True, True), "hosted": ("lead", False, False)}
    table = CliRunner().invoke(app, ["plan", "--model", str(smollm2_path), "--cloud-base-url", hosted.url,
                                     "--cloud-model", MODEL])
    assert table.exit_code == 0 and "lead mode" in table.stdout
    down = CliRunner().invoke(app, ["plan", "--model", str(smollm2_path), "--cloud-base-url", "http://127.0.0.1:9",
                                    "--cloud-model", MODEL])
    assert down.exit_code == 2 and "cannot connect" in down.output
