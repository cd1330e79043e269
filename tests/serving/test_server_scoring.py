"""Scoring a given continuation on ``POST /v1/completions`` (``echo`` + ``logprobs``), as the
verified collaboration mode and vLLM clients send it, through the real ``openai`` client.

The scores are checked against the model itself: the echoed logprobs are the llama.cpp
backend's own, the greedy next token is the one it decodes, and the cloud client reads back
what the server wrote.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from edgecloud.runtime.sampling import SamplingParams
from faults import serving

KEY = "sk-test"
TEXT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def scoring_server(smollm2_path: Path) -> Iterator[tuple[str, Any]]:
    with serving("llamacpp", smollm2_path, n_ctx=512, api_key=KEY) as served:
        yield served


_clients: list[Any] = []


def api(url: str) -> Any:
    """An openai client for ``url``, closed when the module ends (:func:`_close_clients`)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    _clients.append(client)
    return client


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _clients:
        _clients.pop().close()


def test_token_ids_are_scored_and_the_greedy_token_follows(scoring_server: tuple[str, Any]) -> None:
    url, backend = scoring_server
    ids = backend.tokenize_text(TEXT)
    answer = api(url).completions.create(model="m", prompt=ids, echo=True, logprobs=3, max_tokens=1, temperature=0,
                                         extra_body={"return_tokens_as_token_ids": True})
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert [int(t.split(":")[1]) for t in lp.tokens[:-1]] == ids
    assert lp.token_logprobs[0] is None and all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    own, nxt = backend.score(ids, start=1, top_n=3)
    assert lp.token_logprobs[1:-1] == pytest.approx([s.logprob for s in own], abs=1e-4)
    generated = list(backend.scheduler.submit(ids, SamplingParams(1, temperature=0.0)))
    assert int(lp.tokens[-1].split(":")[1]) == nxt.token == generated[0]
    best = [max(d, key=d.get) for d in lp.top_logprobs[1:]]
    assert best == [f"token_id:{s.argmax}" for s in [*own, nxt]]
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 1


def test_text_prompt_echoes_the_text_and_score_from_skips_the_prefix(scoring_server: tuple[str, Any]) -> None:
    url, backend = scoring_server
    n = len(backend.tokenize_text(TEXT))
    answer = api(url).completions.create(model="m", prompt=TEXT, echo=True, logprobs=1, max_tokens=0,
                                         extra_body={"score_from": n - 2})
    lp = answer.choices[0].logprobs
    assert answer.choices[0].text == TEXT and "".join(lp.tokens) == TEXT
    assert lp.token_logprobs[: n - 2] == [None] * (n - 2) and None not in lp.token_logprobs[n - 2:]
    assert len(lp.tokens) == n  # max_tokens=0: scores only


def test_the_cloud_client_reads_the_scores_back(scoring_server: tuple[str, Any]) -> None:
    from edgecloud.remote.client import CloudBackend

    url, backend = scoring_server
    ids = backend.tokenize_text(TEXT)
    with CloudBackend(url, "m", api_key=KEY) as cloud:
        scores, nxt = cloud.score(ids, start=3)
    own, own_next = backend.score(ids, start=3)
    assert [s.token for s in scores] == ids[3:]
    assert [s.argmax for s in scores] == [s.argmax for s in own] and nxt.token == own_next.token


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 1, "stream": True}, "stream"),
    ({"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 2}, "max_tokens"),
    ({"prompt": [1, 2, 10**9], "echo": True, "logprobs": 1, "max_tokens": 1}, "prompt"),
    ({"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 1, "score_from": 99}, "score_from"),
    ({"prompt": "hi", "echo": True, "logprobs": 21, "max_tokens": 1}, "logprobs"),
    ({"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0.8}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 1, "session": {"id": "s1"}}, "session"),
    ({"prompt": [1, 2], "echo": True, "logprobs": 1, "max_tokens": 1, "session": {"id": "../x"}}, "session.id"),
    ({"prompt": [1, 2], "echo": True, "logprobs": 1, "max_tokens": 1, "session": {"id": "s", "base": -1}},
     "session.base"),
    ({"prompt": [1, 2], "echo": True, "logprobs": 1, "max_tokens": 0, "session": {"id": "s", "keep_verified": True}},
     "max_tokens"),
    ({"prompt": [], "echo": True, "logprobs": 1, "max_tokens": 1}, "prompt"),  # nothing to continue
    ({"prompt": [], "echo": True, "logprobs": 1, "max_tokens": 1, "session": {"id": "s", "base": 0}}, "prompt"),
    ({"prompt": [], "max_tokens": 4}, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 4, "return_token_ids": "yes"}, "return_token_ids"),
])
def test_bad_scoring_requests_are_400s_naming_the_field(scoring_server: tuple[str, Any], body: dict[str, Any],
                                                         param: str) -> None:
    import httpx

    url, _ = scoring_server
    response = httpx.post(f"{url}/v1/completions", json={"model": "m", **body},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_torch_engine_scores_too(smollm2_path: Path) -> None:
    """Scoring (and so checked and verified mode) on the torch engine: the greedy next token it
    returns is the one it decodes, and a session round continues the held context."""
    pytest.importorskip("torch")
    with serving("torch", smollm2_path, n_ctx=256, api_key=KEY) as (url, backend):
        ids = backend.tokenize_text(TEXT)
        scored = api(url).completions.create(model="m", prompt=ids, echo=True, logprobs=2, max_tokens=1,
                                             temperature=0, extra_body={"return_tokens_as_token_ids": True})
        decoded = api(url).completions.create(model="m", prompt=TEXT, max_tokens=1, temperature=0)
        held = _post(url, {"prompt": ids[:-2], "session": {"id": "torch-1"}}).json()
        later = _post(url, {"prompt": ids[-2:], "session": {"id": "torch-1", "base": len(ids) - 2}}).json()
        lp = scored.choices[0].logprobs
        nxt = backend.token_bytes(int(lp.tokens[-1].split(":")[1])).decode()
    assert len(lp.tokens) == len(ids) + 1 and all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert nxt == decoded.choices[0].text
    assert held["session"]["tokens"] == len(ids) - 2 and later["usage"]["prompt_tokens"] == 2
    assert later["choices"][0]["logprobs"]["tokens"][-1] == lp.tokens[-1]


def _metric(url: str, name: str) -> float:
    import httpx

    body = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(f"edgecloud:{name}{{"))


def _post(url: str, body: dict[str, Any]) -> Any:
    import httpx

    return httpx.post(f"{url}/v1/completions", json={"model": "m", "max_tokens": 1, "temperature": 0, "echo": True,
                                                      "logprobs": 1, "return_tokens_as_token_ids": True, **body},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_a_session_round_sends_only_what_is_new_and_scores_the_same(scoring_server: tuple[str, Any]) -> None:
    url, backend = scoring_server
    ids = backend.tokenize_text(TEXT)
    cut = len(ids) - 3
    passes, prompt_total = _metric(url, "forward_passes_total"), _metric(url, "prompt_tokens_total")
    first = _post(url, {"prompt": ids[:cut], "session": {"id": "answer-1", "base": 0}, "score_from": cut - 1}).json()
    assert first["session"] == {"id": "answer-1", "tokens": cut, "resumes": True}
    assert first["usage"]["prompt_tokens"] == cut and "context_tokens" in first["usage"]
    later = _post(url, {"prompt": ids[cut:], "session": {"id": "answer-1", "base": cut}, "score_from": cut}).json()
    # only the three new tokens were sent and billed; the held ones are context
    assert later["usage"]["prompt_tokens"] == 3 and later["usage"]["context_tokens"] == cut
    assert later["session"]["tokens"] == len(ids)
    assert [int(t.split(":")[1]) for t in later["choices"][0]["logprobs"]["tokens"][:3]] == ids[cut:]
    whole = _post(url, {"prompt": ids, "score_from": cut}).json()
    assert later["choices"][0]["logprobs"]["top_logprobs"][:4] == whole["choices"][0]["logprobs"]["top_logprobs"][cut:]
    # every scoring request moves the server's own counters: prompt tokens sent, forward passes
    assert _metric(url, "prompt_tokens_total") - prompt_total == cut + 3 + len(ids)
    assert _metric(url, "forward_passes_total") - passes >= 3
    assert _metric(url, "session_context_tokens_total") >= cut


def test_a_check_that_keeps_what_it_verified_holds_its_own_token_and_nothing_is_sent_back(
        scoring_server: tuple[str, Any]) -> None:
    url, backend = scoring_server
    ids = backend.tokenize_text(TEXT)
    greedy: list[int] = []  # the model's own continuation, a token at a time
    for _ in range(5):
        answer = _post(url, {"prompt": ids + greedy, "score_from": len(ids) + len(greedy)}).json()
        greedy.append(int(answer["choices"][0]["logprobs"]["tokens"][-1].split(":")[1]))
    wrong = (greedy[2] + 1) % 1000

    def check(sid: str, prompt: list[int], base: int, score_from: int) -> Any:
        body = {"prompt": prompt, "session": {"id": sid, "base": base, "keep_verified": True}, "score_from": score_from}
        return _post(url, body).json()

    # two drafts it agrees with, then a wrong one: it keeps the two and its own third token
    first = check("kv-1", ids + [greedy[0], greedy[1], wrong, greedy[3]], 0, len(ids))
    assert first["verified"] == {"accepted": 2, "token": greedy[2]}
    assert first["session"]["tokens"] == len(ids) + 3 and first["usage"]["completion_tokens"] == 1
    # the next check sends its drafts alone, and scores them as the whole context would
    later = check("kv-1", [greedy[3]], len(ids) + 3, len(ids) + 3)
    assert later["usage"]["prompt_tokens"] == 1 and later["verified"] == {"accepted": 1, "token": greedy[4]}
    whole = _post(url, {"prompt": ids + greedy[:4], "score_from": len(ids) + 3}).json()
    assert later["choices"][0]["logprobs"]["top_logprobs"] == whole["choices"][0]["logprobs"]["top_logprobs"][-2:]
    assert later["session"]["tokens"] == len(ids) + 5
    # a block it agrees with whole: its token after the block
    whole_block = check("kv-2", ids + greedy[:2], 0, len(ids))
    assert whole_block["verified"] == {"accepted": 2, "token": greedy[2]}
    # a plain session round keeps everything it was sent, and says nothing of verification
    plain = _post(url, {"prompt": ids + [wrong], "session": {"id": "kv-3"}, "score_from": len(ids)}).json()
    assert plain["session"]["tokens"] == len(ids) + 1 and plain.get("verified") is None


def _greedy(url: str, ids: list[int], n: int) -> list[int]:
    """The model's own continuation of ``ids``, ``n`` tokens, a token at a time, whole contexts sent."""
    greedy: list[int] = []
    for _ in range(n):
        answer = _post(url, {"prompt": ids + greedy, "score_from": len(ids) + len(greedy)}).json()
        greedy.append(int(answer["choices"][0]["logprobs"]["tokens"][-1].split(":")[1]))
    return greedy


def test_a_check_without_drafts_continues_from_what_the_session_holds_and_bills_no_input(
        scoring_server: tuple[str, Any]) -> None:
    url, backend = scoring_server
    ids = backend.tokenize_text(TEXT)
    greedy = _greedy(url, ids, 3)
    passes = _metric(url, "forward_passes_total")
    body = {"prompt": ids, "session": {"id": "open-1", "keep_verified": True}, "score_from": len(ids)}
    first = _post(url, body).json()  # the prompt's check: the server holds the prompt and its first token
    assert first["verified"] == {"accepted": 0, "token": greedy[0]} and first["session"]["resumes"] is True
    held = first["session"]["tokens"]
    for token in greedy[1:]:  # then nothing new: each check answers the token after what it holds
        body = {"prompt": [], "session": {"id": "open-1", "base": held, "keep_verified": True}, "score_from": held}
        later = _post(url, body).json()
        assert later["verified"] == {"accepted": 0, "token": token}
        assert later["usage"]["prompt_tokens"] == 0 and later["usage"]["completion_tokens"] == 1
        assert later["session"]["tokens"] == held + 1
        held = later["session"]["tokens"]
    assert _metric(url, "forward_passes_total") - passes == 3  # a pass each, as its own decoding takes


def test_a_generation_streams_the_token_ids_it_writes_and_its_session_holds_them(
        scoring_server: tuple[str, Any]) -> None:
    """``return_token_ids`` (vLLM's field): each streamed chunk names the tokens its text came from;
    in a session the server then holds them too and says so, so a check after it sends only its
    drafts (how the cloud opens a verified answer: :mod:`edgecloud.remote.opening`)."""
    from edgecloud.remote.client import CloudBackend
    from edgecloud.runtime.scoring import TokenSession

    url, backend = scoring_server
    ids = backend.tokenize_text(TEXT)
    greedy = _greedy(url, ids, 6)
    chunks = list(api(url).completions.create(model="m", prompt=ids, max_tokens=5, temperature=0, stream=True,
                                              extra_body={"return_token_ids": True}))
    assert [t for c in chunks for t in (c.choices[0].token_ids or [])] == greedy[:5]
    assert "".join(c.choices[0].text for c in chunks) == b"".join(backend.token_bytes(t) for t in greedy[:5]).decode()
    with CloudBackend(url, "m", api_key=KEY) as cloud:
        session = TokenSession()
        stream = cloud.generate_in(session, ids, 5)
        assert list(stream) == greedy[:5] and stream.finish == "length"
        assert stream.generated == 5 and stream.sent == len(ids)
        assert session.supported is True and session.held == len(ids) + 5 and session.resumes is True
        draft = [greedy[5], greedy[0]]  # the next token, then one it will not take
        passes = _metric(url, "forward_passes_total")
        checked = cloud.score_in(session, ids + greedy[:5] + draft, start=len(ids) + 5, keep_verified=True)
    assert checked.sent == len(draft) and checked.verified is not None and checked.verified[0] >= 1
    assert _metric(url, "forward_passes_total") - passes == 1  # the slot holds what it generated: one pass
    assert cloud.capabilities.known("stream_ids") is True


def test_a_scored_prompt_read_from_the_prefix_cache_is_reported_cached(scoring_server: tuple[str, Any]) -> None:
    url, backend = scoring_server
    ids = backend.tokenize_text(TEXT)
    _post(url, {"prompt": ids, "score_from": len(ids)})  # a slot holds the text now
    other = [t for t in backend.tokenize_text(" and then something else entirely") if t != ids[6]]
    queries, hits = _metric(url, "prefix_cache_queries_total"), _metric(url, "prefix_cache_hits_total")
    shared = _post(url, {"prompt": ids[:6] + other, "score_from": 6 + len(other)}).json()
    assert shared["usage"]["prompt_tokens"] == 6 + len(other)
    assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] == 6  # the six it shares, not computed again
    # the server's prefix-cache counters say the same as the answer
    assert _metric(url, "prefix_cache_queries_total") - queries == 6 + len(other)
    assert _metric(url, "prefix_cache_hits_total") - hits == 6
    # in a session only the sent tokens count: the held context is neither billed nor "cached"
    _post(url, {"prompt": ids[:-2], "session": {"id": "cache-1"}, "score_from": len(ids) - 2})
    later = _post(url, {"prompt": ids[-2:], "session": {"id": "cache-1", "base": len(ids) - 2},
                        "score_from": len(ids) - 2}).json()
    assert later["usage"]["prompt_tokens"] == 2 and later["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_session_the_server_does_not_hold_is_a_409_and_the_client_resends(scoring_server: tuple[str, Any]) -> None:
    from edgecloud.remote.client import CloudBackend
    from edgecloud.runtime.scoring import TokenSession

    url, backend = scoring_server
    ids = backend.tokenize_text(TEXT)
    gone = _post(url, {"prompt": ids[4:], "session": {"id": "never-opened", "base": 4}})
    assert gone.status_code == 409 and gone.json()["error"]["code"] == "session_expired"
    assert gone.json()["error"]["param"] == "session"
    session = TokenSession(held=4, supported=True)  # it believes the server holds 4 tokens
    with CloudBackend(url, "m", api_key=KEY) as cloud:
        scored = cloud.score_in(session, ids, start=4)
        own, _ = backend.score(ids, start=4)
    assert session.resent == 1 and scored.sent == len(ids)  # the whole context again: same scores
    assert [s.argmax for s in scored.scores] == [s.argmax for s in own]
    assert session.held == len(ids) and session.supported
