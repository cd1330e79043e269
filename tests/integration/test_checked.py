"""Checked and verified mode (verified is what auto runs): the edge drafts, the cloud checks.

A real llama.cpp edge (SmolLM2) and a real ``edgecloud serve`` cloud (the same model, so the
cloud's greedy text is known: what it writes alone). The edge is made unsure and wrong on
purpose (a wrapper that doubts every third token and corrupts its drafts) to show the cloud's
choice is kept wherever it checks; the trust threshold's two ends; the call budget; token
sessions (each token sent once; a server that forgets sessions gets the whole context again and
the answer does not change); and what every answer reports it cost.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from edgecloud import EdgeCloud
from edgecloud.backend import Backend
from edgecloud.errors import InvalidRequestError
from edgecloud.types import ChatCompletionChunk
from faults import ScriptedServer, ServeProcess, json_reply, serving

KEY = "sk-test"
QUESTION = [{"role": "user", "content": "List three colours of the rainbow, one per line."}]


@pytest.fixture(scope="module")
def edge(smollm2_path: Path) -> Iterator[Backend]:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(smollm2_path), n_ctx=1024) as backend:
        yield backend


class Doubting:
    """The edge, unsure of every third token it writes and wrong in every third token it drafts."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def greedy(self, tokens: list[int], limit: int, picker: Any = None) -> Iterator[tuple[int, float]]:
        for i, (token, p) in enumerate(self.inner.greedy(tokens, limit, picker)):
            yield token, (0.01 if i % 3 == 2 else p)

    def draft(self, tokens: list[int], k: int, picker: Any = None, **kw: Any) -> list[int]:
        return [t if (i + 1) % 3 else (t + 1) % 1000 for i, t in enumerate(self.inner.draft(tokens, k, picker, **kw))]


def client(edge: Any, url: str, **collab: Any) -> EdgeCloud:
    config = {"collab": collab, "fallback": {"max_retries": 0, "timeout_s": 30}, "router": {"pii": "off"}}
    return EdgeCloud(edge_backend=edge, cloud_base_url=url, cloud_model="m", cloud_api_key=KEY, config=config)


def run(c: EdgeCloud, **params: Any) -> tuple[str, ChatCompletionChunk]:
    chunks = list(c.chat.completions.create(messages=QUESTION, max_tokens=params.pop("max_tokens", 40), temperature=0,
                                            stream=True, **params))
    return "".join(ch.text for ch in chunks), chunks[-1]


@pytest.fixture(scope="module")
def cloud(smollm2_path: Path) -> Iterator[str]:
    with serving("llamacpp", smollm2_path, n_ctx=1024, api_key=KEY) as (url, _):
        yield url


@pytest.fixture(scope="module")
def cloud_text(edge: Backend, cloud: str) -> str:
    with client(edge, cloud) as c:
        return run(c, route="cloud", collab="off")[0]


def test_the_default_is_verified_mode_and_every_answer_says_what_it_cost(edge: Backend, cloud: str) -> None:
    with client(Doubting(edge), cloud) as c:
        text, final = run(c)
        stats = c.stats()
    route, cost, usage = final.route, final.cost, final.usage
    assert route.collab == "verified" and route.noted("collab_mode") is not None
    assert text and route.cloud_calls >= 1 and route.tokens["cloud"] >= 1
    assert route.tokens["edge"] + route.tokens["cloud"] == usage.completion_tokens
    assert cost.cloud_calls == route.cloud_calls and cost.cloud_passes >= route.cloud_calls
    assert cost.all_cloud_passes >= usage.completion_tokens and cost.passes_vs_all_cloud < 1
    assert cost.cloud_output_tokens == route.cloud_calls  # one token of the cloud's own per check
    assert cost.vs_all_cloud == pytest.approx(cost.usd / cost.cloud_equivalent_usd, rel=1e-3)
    assert stats["cloud_calls"] == route.cloud_calls and stats["cost_vs_all_cloud"] is not None


def test_where_the_cloud_checks_its_choice_stands(edge: Backend, cloud: str, cloud_text: str) -> None:
    with client(Doubting(edge), cloud, trust=1.0) as c:  # every token checked
        text, final = run(c, collab="checked")
    assert text == cloud_text
    assert final.route.tokens["cloud"] > 0  # the corrections of the corrupted drafts


def test_a_trusted_edge_writes_alone(edge: Backend, cloud: str) -> None:
    with client(Doubting(edge), cloud, trust=0.0) as c:
        text, final = run(c, collab="checked")
        alone, _ = run(c, route="edge", collab="off")
    assert text == alone and final.route.cloud_calls == 0 and final.route.tokens["cloud"] == 0
    assert final.cost.cloud_input_tokens == 0 and final.cost.usd == 0.0


def test_a_pinned_route_is_that_side_alone(edge: Backend, cloud: str, cloud_text: str) -> None:
    with client(Doubting(edge), cloud) as c:
        pinned_edge, on_edge = run(c, route="edge")  # collab="auto" stays the default
        alone, _ = run(c, route="edge", collab="off")
        named, by_name = run(c, route="edge", collab="verified")
        pinned_cloud, on_cloud = run(c, route="cloud")
    assert pinned_edge == alone == named and pinned_cloud == cloud_text
    for final in (on_edge, by_name):
        assert final.route.cloud_calls == 0 and final.route.tokens["cloud"] == 0 and final.route.collab == "off"
    assert on_cloud.route.tokens["edge"] == 0 and on_cloud.route.collab == "off"


def test_the_call_budget_bounds_the_round_trips(edge: Backend, cloud: str) -> None:
    with client(Doubting(edge), cloud, trust=1.0) as c:
        _, unbounded = run(c, collab="checked")
        text, bounded = run(c, collab={"mode": "checked", "max_calls": 2})
        _, none = run(c, collab={"mode": "checked", "max_calls": 0})
    assert unbounded.route.cloud_calls > 2
    assert bounded.route.cloud_calls == 2 and text and bounded.choices[0].finish_reason in ("stop", "length")
    assert none.route.cloud_calls == 0 and none.route.tokens["cloud"] == 0
    with client(edge, cloud) as c, pytest.raises(InvalidRequestError) as info:
        run(c, collab={"mode": "checked", "max_calls": -1})
    assert info.value.param == "collab.max_calls"
    with client(edge, cloud) as c, pytest.raises(InvalidRequestError) as info:
        run(c, collab={"mode": "checked", "draft_min": 8}, max_tokens=4)
    assert info.value.param == "collab.draft_min"
    with client(edge, cloud) as c, pytest.raises(InvalidRequestError) as info:
        run(c, collab={"mode": "verified", "draft_min": 8, "draft_max": 4})
    assert info.value.param == "collab.draft_max" and "draft_min" in str(info.value)
    with client(edge, cloud) as c, pytest.raises(InvalidRequestError) as info:
        run(c, collab={"mode": "verified", "overlap": "sometimes"})
    assert info.value.param == "collab.overlap"


def test_a_session_sends_each_token_once(edge: Backend, cloud: str, smollm2_path: Path) -> None:
    from edgecloud.serving.sessions import SessionStore

    with client(edge, cloud, trust=1.0) as c:  # the edge is the cloud's model: every draft kept
        text, final = run(c, collab="checked")
    usage, cost, route = final.usage, final.cost, final.route
    assert route.cloud_calls >= 3 and route.tokens["cloud"] >= 2
    # the prompt once, each drafted token once (the end-of-turn token too): not calls x context;
    # the cloud's own tokens are never sent back (it holds them, as its own generation would)
    assert usage.prompt_tokens + route.tokens["edge"] <= cost.cloud_input_tokens
    assert cost.cloud_input_tokens <= usage.prompt_tokens + route.tokens["edge"] + 1
    # a server that holds no session answers each delta 409: the client sends the whole context
    with serving("llamacpp", smollm2_path, n_ctx=1024, api_key=KEY, sessions=SessionStore(max_sessions=0)) as (url, _):
        with client(edge, url, trust=1.0) as c:
            forgetful_text, forgetful = run(c, collab="checked")
    assert forgetful_text == text
    assert forgetful.cost.cloud_input_tokens > 2 * cost.cloud_input_tokens


def test_text_spans_where_token_ids_cannot_be_shared(edge: Backend, server: ServeProcess) -> None:
    """A redacted conversation cannot be sent as token ids: ``auto`` runs token mode (text spans)."""
    config = {"router": {"pii": "redact"}, "collab": {"gate": 0.0}, "fallback": {"max_retries": 0}}
    with EdgeCloud(edge_backend=edge, cloud_base_url=server.url, cloud_model=Path(server.model).stem,
                   cloud_api_key=KEY, config=config) as c:
        final = list(c.chat.completions.create(
            messages=[{"role": "user", "content": "Write one line to jane.doe@example.com about colours."}],
            max_tokens=12, temperature=0, stream=True))[-1]
    assert final.route.collab == "token"


def test_auto_steps_aside_for_a_cloud_that_cannot_score(edge: Backend) -> None:
    """An OpenAI-compatible endpoint without scoring (here one that refuses every request, so its
    continuing text cannot be told either): the first answer steps down to text spans before
    anything is shown (and says why), later ones start there; asked for by name, verified mode is a
    ConfigError."""
    from edgecloud.errors import ConfigError

    fake = ScriptedServer()
    try:
        refusal = {"error": {"message": "echo is not supported", "type": "invalid_request_error", "param": "echo",
                             "code": None}}
        fake.script(json_reply(400, refusal))
        with client(Doubting(edge), fake.url, gate=1.0) as c:
            text, first = run(c)
            _, later = run(c)
        assert text and first.route.collab == "token" and first.route.tokens["cloud"] == 0
        assert any("'score'" in n.text for n in first.route.notes if n.code == "collab_mode")
        assert later.route.collab == "token"
        assert not any(n.code == "collab_mode" and "refused" in n.text for n in later.route.notes)
        fake.script(json_reply(400, refusal))
        with client(Doubting(edge), fake.url) as c, pytest.raises(ConfigError, match="cannot score"):
            run(c, collab="verified")
    finally:
        fake.close()
