"""OpenAI's logit_bias on the llama.cpp runtime (real SmolLM2), and its refusal where a runtime
does not apply it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from edgecloud.errors import InvalidRequestError
from edgecloud.types import ChatRequest

QUESTION = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def edge(smollm2_path: Path) -> Iterator[object]:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(smollm2_path), n_ctx=512) as backend:
        yield backend


def test_a_strong_bias_forces_a_token_and_a_ban_removes_one(edge: object) -> None:
    plain = edge.complete(ChatRequest(messages=QUESTION, max_tokens=6, temperature=0, logprobs=True))  # type: ignore[attr-defined]
    first = plain.choices[0].logprobs.content[0]
    forced_id = edge.tokenize_text(" banana")[0]  # type: ignore[attr-defined]
    forced = edge.complete(ChatRequest(messages=QUESTION, max_tokens=3, temperature=0,  # type: ignore[attr-defined]
                                       logit_bias={str(forced_id): 100}))
    piece = edge.token_bytes(forced_id).decode()  # type: ignore[attr-defined]
    assert forced.text == piece * 3
    first_id = edge.tokenize_text(first.token)[0]  # type: ignore[attr-defined]
    banned = edge.complete(ChatRequest(messages=QUESTION, max_tokens=6, temperature=0,  # type: ignore[attr-defined]
                                       logit_bias={str(first_id): -100}))
    assert not banned.text.startswith(first.token)


def test_a_token_outside_the_vocabulary_is_refused(edge: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        edge.complete(ChatRequest(messages=QUESTION, max_tokens=2, logit_bias={"99999999": 1}))  # type: ignore[attr-defined]
    assert info.value.param == "logit_bias"


def test_a_runtime_that_does_not_apply_it_says_so() -> None:
    from edgecloud.runtime.sampling import sampling_params

    request = ChatRequest(messages=QUESTION, logit_bias={"5": 1})
    with pytest.raises(InvalidRequestError) as info:
        sampling_params(request, 4)
    assert info.value.param == "logit_bias"
    assert sampling_params(request, 4, logit_bias=True).logit_bias == ((5, 1.0),)
