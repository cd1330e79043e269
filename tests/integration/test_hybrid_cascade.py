"""The middle-band cascade end to end: a real edge runtime (llama.cpp, torch) answers first, the
confidence check judges it, and the answer is replayed or escalated to a real ``edgecloud serve``.

The check's verdict is pinned by its threshold (a check whose p_good is 0.5 everywhere: accept
when the threshold is below, escalate when above), so each outcome is exercised for certain.
The runtime's capability decides which check judges: with token logprobs the full one, without
them the variant fitted on the other signals.
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
from edgecloud.errors import InvalidRequestError
from edgecloud.router.cascade import SIGNAL_NAMES, ConfidenceCheck
from edgecloud.router.policy import RoutePolicy
from edgecloud.types import ChatCompletionChunk, ChatRequest
from faults import ServeProcess

KEY = "sk-test"
CLOUD_MODEL = "smollm2-135m-instruct-q4"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


class Middle:
    """A scorer in the middle band: every request is answered on the edge first, then checked."""

    name = "middle"
    bands = (0.3, 0.7)

    def score(self, request: Any) -> float:
        return 0.5


class NoLogprobs(Backend):
    """A real edge runtime seen as one that has no token logprobs (as a third-party backend may):
    it declares so, and refuses a request that asks for them, naming the field."""

    supports_logprobs = False

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name, self.model_name = inner.name, inner.model_name  # type: ignore[misc]

    @property
    def n_ctx(self) -> int | None:  # type: ignore[override]
        return self.inner.n_ctx

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        if request.logprobs:
            raise InvalidRequestError("logprobs are not supported by this runtime", param="logprobs")
        return self.inner.stream(request)


def _check(threshold: float, plain_threshold: float) -> ConfidenceCheck:
    flat = [0.0] * len(SIGNAL_NAMES)  # p_good = 0.5 whatever the answer
    return ConfidenceCheck(threshold=threshold, coef=flat, intercept=0.0,
                           without_logprobs=ConfidenceCheck(threshold=plain_threshold, coef=flat, intercept=0.0))


@pytest.fixture(scope="module")
def llamacpp_edge(smollm2_path: Path) -> Iterator[Backend]:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(smollm2_path), n_ctx=1024) as backend:
        yield backend


@pytest.fixture(scope="module")
def torch_edge(smollm2_path: Path) -> Iterator[Backend]:
    pytest.importorskip("torch")
    from edgecloud.edge.torch import TorchBackend

    with TorchBackend(str(smollm2_path), n_ctx=1024, device="cpu") as backend:
        yield backend


def _client(edge: Backend, server: ServeProcess, check: ConfidenceCheck, cls: type = EdgeCloud) -> Any:
    client = cls(edge_model=None, edge_backend=edge, cloud_base_url=server.url, cloud_model=CLOUD_MODEL,
                 cloud_api_key=KEY, policy=RoutePolicy(scorer=Middle(), pii="off"),  # type: ignore[arg-type]
                 collab="cascade")  # the buffered cascade is an explicit choice, never the default
    client.hybrid.confidence = check
    return client


def _ask(client: EdgeCloud) -> tuple[list[ChatCompletionChunk], Any]:
    chunks = list(client.chat.completions.create(messages=QUESTION, max_tokens=12, temperature=0, stream=True))
    return chunks, chunks[-1].route


@pytest.mark.parametrize("runtime", ["llamacpp", "torch"])
def test_accepted_edge_answer_is_replayed(runtime: str, request: pytest.FixtureRequest, server: ServeProcess) -> None:
    edge = request.getfixturevalue(f"{runtime}_edge")
    with _client(edge, server, _check(0.4, 0.4)) as client:
        chunks, route = _ask(client)
    assert route.target == "edge" and route.backend == edge.name and route.fallbacks == []
    assert route.noted("cascade_accepted") is not None
    assert "".join(c.text for c in chunks).strip()
    # the probe asked the edge for logprobs (a signal); the caller did not, and sees none
    assert all(choice.logprobs is None for c in chunks for choice in c.choices)
    assert chunks[-1].usage is not None and chunks[-1].cost is not None


@pytest.mark.parametrize("runtime", ["llamacpp", "torch"])
def test_unsure_edge_answer_is_escalated(runtime: str, request: pytest.FixtureRequest, server: ServeProcess) -> None:
    edge = request.getfixturevalue(f"{runtime}_edge")
    with _client(edge, server, _check(0.6, 0.6)) as client:
        chunks, route = _ask(client)
    assert route.target == "cloud" and route.fallbacks[0]["cause"] == "low_confidence"
    assert "".join(c.text for c in chunks).strip()
    cost = chunks[-1].cost
    assert cost is not None and cost.cloud_output_tokens > 0 and cost.edge_seconds > 0  # both sides were paid


def test_runtime_without_logprobs_is_judged_by_the_plain_check(llamacpp_edge: Backend, server: ServeProcess) -> None:
    edge = NoLogprobs(llamacpp_edge)
    # the full check would accept, the plain one escalates: escalation shows which one judged,
    # and that the edge was never asked for logprobs it cannot give
    with _client(edge, server, _check(0.4, 0.6)) as client:
        chunks, route = _ask(client)
    assert route.target == "cloud" and route.fallbacks[0]["cause"] == "low_confidence"
    with _client(edge, server, _check(0.6, 0.4)) as client:
        chunks, route = _ask(client)
    assert route.target == "edge" and route.noted("cascade_accepted") is not None


def test_async_cascade_escalates_too(llamacpp_edge: Backend, server: ServeProcess) -> None:
    async def run() -> tuple[str, Any]:
        async with _client(llamacpp_edge, server, _check(0.6, 0.6), AsyncEdgeCloud) as client:
            stream = await client.chat.completions.create(messages=QUESTION, max_tokens=12, temperature=0, stream=True)
            chunks = [c async for c in stream]
        return "".join(c.text for c in chunks), chunks[-1].route

    text, route = asyncio.run(run())
    assert text.strip() and route.target == "cloud" and route.fallbacks[0]["cause"] == "low_confidence"


def test_the_cascade_is_not_the_default(llamacpp_edge: Backend, server: ServeProcess) -> None:
    client = EdgeCloud(edge_backend=llamacpp_edge, cloud_base_url=server.url, cloud_model=CLOUD_MODEL,
                       cloud_api_key=KEY, policy=RoutePolicy(scorer=Middle(), pii="off"))  # type: ignore[arg-type]
    client.hybrid.confidence = _check(0.6, 0.6)  # would escalate every answer
    with client:
        chunks, route = _ask(client)
    assert route.collab == "verified" and not any(f["cause"] == "low_confidence" for f in route.fallbacks)
