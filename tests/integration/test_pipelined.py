"""Pipelined verified rounds: the edge drafts while a check is in flight, the text stays the cloud's.

A real llama.cpp edge (SmolLM2) and a real ``edgecloud serve`` cloud (the same model, so the
cloud's greedy text is known). The edge is made wrong on purpose (every third token of its
greedy line is another token) so checks reject drafts and the line is drafted again from the
cloud's token; the pipelined answer must still be the strict rounds' answer and the cloud's,
token for token. Faults: a cloud killed while the edge is ahead, a check abandoned by a caller
who stops reading, a cloud whose breaker opens mid-answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from edgecloud import EdgeCloud
from edgecloud.backend import Backend
from edgecloud.errors import BackendError
from edgecloud.types import ChatCompletionChunk
from faults import ServeProcess, WrongDrafts, serving

KEY = "sk-test"
SERVED = "smollm2-135m-instruct-q4"  # the name edgecloud serve gives the file
PROMPTS = ["List three colours of the rainbow, one per line.", "Write a haiku about the sea.",
           "Count from one to ten in words, separated by commas."]


@pytest.fixture(scope="module")
def edge(smollm2_path: Path) -> Iterator[Backend]:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(smollm2_path), n_ctx=1024) as backend:
        yield backend


def client(edge: Any, url: str, model: str = "m", **collab: Any) -> EdgeCloud:
    config = {"collab": collab, "fallback": {"max_retries": 0, "timeout_s": 30, "connect_timeout_s": 2},
              "router": {"pii": "off"}}
    return EdgeCloud(edge_backend=edge, cloud_base_url=url, cloud_model=model, cloud_api_key=KEY, config=config)


def ask(c: EdgeCloud, prompt: str, **params: Any) -> list[ChatCompletionChunk]:
    return list(c.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                          max_tokens=params.pop("max_tokens", 40), temperature=0, stream=True, **params))


def text(chunks: list[ChatCompletionChunk]) -> str:
    return "".join(ch.text for ch in chunks)


@pytest.fixture(scope="module")
def cloud(smollm2_path: Path) -> Iterator[str]:
    with serving("llamacpp", smollm2_path, n_ctx=1024, api_key=KEY) as (url, _):
        yield url


@pytest.mark.parametrize("overlap", [True, False], ids=["edge-drafts-during-checks", "sides-take-turns"])
def test_pipelined_rounds_write_the_strict_rounds_answer_token_for_token(edge: Backend, cloud: str,
                                                                         overlap: bool) -> None:
    with client(WrongDrafts(edge), cloud) as c:
        for prompt in PROMPTS:
            alone = ask(c, prompt, route="cloud", collab="off")
            strict = ask(c, prompt, collab={"mode": "verified", "pipeline": False})
            piped = ask(c, prompt, collab={"mode": "verified", "overlap": overlap})
            assert text(piped) == text(strict) == text(alone), prompt
            final, strict_final = piped[-1], strict[-1]
            assert final.usage.completion_tokens == strict_final.usage.completion_tokens
            assert final.route.tokens["edge"] + final.route.tokens["cloud"] == final.usage.completion_tokens
            assert final.route.tokens["cloud"] > 1  # the corrections of the wrong drafts
            assert final.route.noted("verified_rounds") is not None and not final.route.fallbacks
            # each check is one pass on both counters: the cloud's forward passes as the client counts them
            # (where the cloud streamed the opening, that request is a pass for each token it wrote)
            opened = final.route.noted("cloud_opening")
            assert final.cost.cloud_passes == final.route.cloud_calls + (int(opened.value or 1) - 1 if opened else 0)


@pytest.mark.parametrize("wrong", [False, True], ids=["bets-hold", "bets-lost"])
def test_checks_sent_ahead_of_the_one_out_keep_the_clouds_answer_token_for_token(
        edge: Backend, cloud: str, wrong: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from urllib.parse import urlsplit

    from edgecloud.collab import verified
    from edgecloud.testing import LatencyProxy

    monkeypatch.setattr(verified, "BET_ODDS", 0.0)  # every bet is taken, however unsure the small edge is
    held = 0
    port = urlsplit(cloud).port
    assert port is not None
    # a round trip keeps each check out while the edge drafts past it, so the line past it goes too (long
    # enough for an edge slowed by a busy machine: at 150 ms a loaded CI box drafted past one check in three)
    with LatencyProxy(("127.0.0.1", port), rtt_s=0.3) as proxy, \
            client(WrongDrafts(edge) if wrong else edge, f"{proxy.url}/v1", overlap=True) as c:
        for prompt in PROMPTS:
            alone = ask(c, prompt, route="cloud", collab="off")
            # (every token checked: the cloud's streamed opening would leave fewer checks to bet on)
            one = ask(c, prompt, collab={"mode": "verified", "checks_in_flight": 1, "stream_opening": 0})
            two = ask(c, prompt, collab={"mode": "verified", "checks_in_flight": 2, "stream_opening": 0})
            assert text(two) == text(one) == text(alone), prompt
            final = two[-1]
            assert final.usage.completion_tokens == one[-1].usage.completion_tokens
            assert final.route.tokens["edge"] + final.route.tokens["cloud"] == final.usage.completion_tokens
            assert not final.route.fallbacks and one[-1].route.noted("checks_ahead") is None
            note = final.route.noted("checks_ahead")
            held += int(note.value or 0) if note is not None else 0
    if not wrong:  # the same model drafts: a check out is kept whole, so the one sent behind it is read
        assert held >= len(PROMPTS)


@pytest.mark.parametrize("rounds", [{"pipeline": False}, {"overlap": False}], ids=["strict", "sides-take-turns"])
def test_a_confidence_floor_ends_blocks_where_the_edge_is_unsure_and_keeps_the_text(edge: Backend, cloud: str,
                                                                                   rounds: dict[str, Any]) -> None:
    with client(WrongDrafts(edge), cloud) as c:
        for prompt in PROMPTS[:2]:
            free = ask(c, prompt, collab={"mode": "verified", "draft_confidence": 0, **rounds})
            floored = ask(c, prompt, collab={"mode": "verified", "draft_confidence": 1, **rounds})  # every token below
            assert text(floored) == text(free), prompt
            # a block ends after its first token: more checks, each sending the token before it and one draft
            final = floored[-1]
            assert final.route.cloud_calls > free[-1].route.cloud_calls
            assert final.cost.cloud_input_tokens <= final.usage.prompt_tokens + 2 * final.route.cloud_calls


@pytest.mark.parametrize("overlap", [True, False])
def test_the_first_token_shown_is_the_clouds_own(edge: Backend, cloud: str, overlap: bool) -> None:
    with client(WrongDrafts(edge, delay_s=0.3), cloud, overlap=overlap) as c:  # an edge slower than the cloud's prefill
        piped = ask(c, PROMPTS[0], max_tokens=12)
        strict = ask(c, PROMPTS[0], max_tokens=12, collab={"mode": "verified", "pipeline": False})
    first = next(ch for ch in piped if ch.text)
    assert first.route.target == "cloud"
    assert next(ch for ch in strict if ch.text).route.target == "edge"  # a strict round shows the edge's block first
    assert text(piped) == text(strict)


@pytest.mark.parametrize("collab, kill_after, max_tokens", [
    ({"overlap": True}, 6, 80),  # the edge drafts ahead while checks are out
    ({"overlap": False, "opening_tokens": 12}, 3, 40),  # the sides take turns: the cloud is opening the answer
    ({"overlap": True, "stream_opening": 60}, 3, 80),  # the cloud is streaming the opening
], ids=["while-the-edge-is-ahead", "during-the-opening", "during-the-streamed-opening"])
def test_a_cloud_killed_mid_answer_leaves_the_edge_to_finish(edge: Backend, smollm2_path: Path, collab: dict[str, Any],
                                                             kill_after: int, max_tokens: int) -> None:
    proc = ServeProcess(str(smollm2_path), api_key=KEY).start()
    try:
        with client(edge, proc.url, SERVED, **collab) as c:
            if "stream_opening" in collab:  # (a first answer shows the cloud holds token sessions)
                ask(c, "Hi!", max_tokens=4, collab={"mode": "verified", "pipeline": False})
            chunks: list[ChatCompletionChunk] = []
            stream = c.chat.completions.create(messages=[{"role": "user", "content": "Write a story about a fox."}],
                                               max_tokens=max_tokens, temperature=0, stream=True)
            for chunk in stream:
                chunks.append(chunk)
                if sum(bool(ch.text) for ch in chunks) == kill_after and proc.proc.poll() is None:
                    proc.kill()
            alone = ask(c, "Write a story about a fox.", route="edge", collab="off", max_tokens=max_tokens)
    finally:
        proc.stop()
    final = chunks[-1]
    [switch] = final.route.fallbacks  # the edge finished: the dead cloud was not asked again
    assert (switch["from"], switch["to"], switch["during"]) == ("cloud", "edge", "verification")
    # the same model on both sides: what the caller got is one answer, no token twice or missing
    assert text(chunks) == text(alone)
    assert final.usage.completion_tokens == alone[-1].usage.completion_tokens
    assert final.route.tokens["edge"] + final.route.tokens["cloud"] == final.usage.completion_tokens
    assert sum(ch.choices[0].finish_reason is not None for ch in chunks if ch.choices) == 1
    opening = collab.get("opening_tokens", collab.get("stream_opening"))
    if opening:  # the cloud wrote what it opened before it died, the edge the rest
        assert kill_after <= final.route.tokens["cloud"] < opening and final.route.tokens["edge"] > 0


def test_a_check_nobody_reads_is_dropped(edge: Backend, cloud: str) -> None:
    with client(WrongDrafts(edge, delay_s=0.05), cloud, overlap=True) as c:
        stream = c.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=40,
                                           temperature=0, stream=True)
        while not next(stream).text:  # the caller reads the first token, then walks away mid-answer
            pass
        stream.close()
        threads = threading.active_count()
        time.sleep(0.5)  # the abandoned check lands meanwhile
        again = ask(c, PROMPTS[1], max_tokens=40, collab={"mode": "verified", "pipeline": False})
        piped = ask(c, PROMPTS[1], max_tokens=40)
        stats = c.stats()
    assert text(again) == text(piped) and not piped[-1].route.fallbacks
    assert all(state == "closed" for state in stats["circuits"].values())  # nothing counted against the cloud
    assert threading.active_count() <= threads + 1


def test_failed_checks_count_on_the_breaker_and_an_open_one_is_not_asked(edge: Backend, smollm2_path: Path) -> None:
    proc = ServeProcess(str(smollm2_path), api_key=KEY).start()
    config = {"collab": {"mode": "verified", "overlap": True}, "router": {"pii": "off"},
              "fallback": {"max_retries": 0, "timeout_s": 30, "connect_timeout_s": 1, "failure_threshold": 2,
                           "cooldown_s": 60}}
    try:
        with EdgeCloud(edge_backend=WrongDrafts(edge), cloud_base_url=proc.url, cloud_model=SERVED, cloud_api_key=KEY,
                       config=config) as c:
            chunks: list[ChatCompletionChunk] = []
            for chunk in c.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=60,
                                                   temperature=0, stream=True):
                chunks.append(chunk)
                if sum(bool(ch.text) for ch in chunks) == 3 and proc.proc.poll() is None:
                    proc.kill()
            half_open = c.stats()["circuits"]
            second = ask(c, PROMPTS[0])
            opened = c.stats()["circuits"]
            third = ask(c, PROMPTS[1])
    finally:
        proc.stop()
    assert len(chunks[-1].route.fallbacks) == 1 and len(second[-1].route.fallbacks) == 1
    cloud = f"{proc.url}/v1" if not proc.url.endswith("/v1") else proc.url
    assert half_open[cloud] == "closed" and opened[cloud] == "open"
    assert third[-1].route.fallbacks == [] and third[-1].route.cloud_calls == 0 and text(third)


class CountsDrafts(WrongDrafts):
    """The wrong edge, counting the blocks it drafts."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.blocks = 0

    def draft(self, tokens: list[int], k: int, picker: Any = None, **kw: Any) -> list[int]:
        self.blocks += 1
        return super().draft(tokens, k, picker, **kw)


def test_the_sides_taking_turns_the_cloud_opens_the_answer_and_a_short_one_is_its_alone(edge: Backend,
                                                                                        cloud: str) -> None:
    counting = CountsDrafts(edge)
    with client(counting, cloud, overlap=False) as c:
        for prompt in PROMPTS[:2]:
            alone = ask(c, prompt, route="cloud", collab="off")
            strict = ask(c, prompt, collab={"mode": "verified", "pipeline": False})
            opened = ask(c, prompt, collab={"mode": "verified", "opening_tokens": 6})
            assert text(opened) == text(strict) == text(alone), prompt
            shown = [ch.route.target for ch in opened if ch.text]
            assert shown[:6] == ["cloud"] * 6 and "edge" in shown[6:]  # then the edge's drafts, checked
            assert opened[-1].usage.completion_tokens == strict[-1].usage.completion_tokens
            # an answer no longer than the opening: the cloud wrote it, one pass a token, the edge drafted nothing;
            # streamed in one request (the cloud was seen to hold sessions by now)
            before = counting.blocks
            short = ask(c, prompt, max_tokens=5, collab={"mode": "verified", "opening_tokens": 8})
            final = short[-1]
            assert counting.blocks == before and text(short) and text(alone).startswith(text(short))
            assert final.route.tokens == {"edge": 0, "cloud": final.usage.completion_tokens}
            assert final.route.cloud_calls == 1 and final.cost.cloud_passes == final.usage.completion_tokens
            assert final.route.noted("cloud_opening").value == final.usage.completion_tokens
            # the prompt is the only input
            assert final.cost.cloud_input_tokens == final.usage.prompt_tokens


@pytest.mark.parametrize("overlap", [True, False])
def test_a_cloud_down_at_the_first_check_leaves_the_whole_answer_to_the_edge(edge: Backend, overlap: bool) -> None:
    from faults import free_port

    with client(edge, f"http://127.0.0.1:{free_port()}", overlap=overlap) as c:
        answer = ask(c, PROMPTS[2], collab="verified")
        alone = ask(c, PROMPTS[2], route="edge", collab="off")
    final = answer[-1]
    assert [f["cause"] for f in final.route.fallbacks] == ["connect"] and final.route.tokens["cloud"] == 0
    assert text(answer) == text(alone) and final.choices[0].finish_reason in ("stop", "length")


def test_the_edge_drafting_during_checks_the_cloud_streams_the_opening_and_a_short_answer_is_its_alone(
        edge: Backend, cloud: str) -> None:
    """``collab.stream_opening``: against a cloud seen to hold token sessions, the cloud streams the
    answer's first tokens in one request while the edge drafts; the checks go on after them and the
    text is still the strict rounds' and the cloud's own."""
    with client(WrongDrafts(edge), cloud, overlap=True) as c:
        for prompt in PROMPTS[:2]:
            alone = ask(c, prompt, route="cloud", collab="off")
            strict = ask(c, prompt, collab={"mode": "verified", "pipeline": False})  # (shows the sessions held)
            opened = ask(c, prompt, collab={"mode": "verified", "stream_opening": 6})
            assert text(opened) == text(strict) == text(alone), prompt
            shown = [ch.route.target for ch in opened if ch.text]
            assert shown[:6] == ["cloud"] * 6 and "edge" in shown[6:]  # then the edge's drafts, checked
            final = opened[-1]
            assert final.route.noted("cloud_opening").value == 6
            assert final.usage.completion_tokens == strict[-1].usage.completion_tokens
            # one request for the opening (a pass a token), then a pass a check
            assert final.cost.cloud_passes == final.route.cloud_calls - 1 + 6
            short = ask(c, prompt, max_tokens=5, collab={"mode": "verified", "stream_opening": 8})
            last = short[-1]
            assert text(alone).startswith(text(short)) and last.usage.completion_tokens == 5
            assert last.route.tokens == {"edge": 0, "cloud": 5} and last.route.cloud_calls == 1
            assert last.cost.cloud_input_tokens == last.usage.prompt_tokens and last.cost.cloud_passes == 5


def test_a_cloud_that_streams_no_token_ids_opens_the_answer_with_checks(edge: Backend, cloud: str) -> None:
    """A server that streams text without the ids (a proxy drops ``return_token_ids``) is
    remembered as such; the cloud opens the answer with a check without drafts a token instead,
    and the text is the same."""
    from faults import ignoring

    with ignoring(cloud, ("return_token_ids",), "none") as plain, client(WrongDrafts(edge), plain, overlap=False) as c:
        strict = ask(c, PROMPTS[0], collab={"mode": "verified", "pipeline": False})
        opened = ask(c, PROMPTS[0], collab={"mode": "verified", "opening_tokens": 6})
        again = ask(c, PROMPTS[0], collab={"mode": "verified", "opening_tokens": 6})
        capabilities = c.stats()["clouds"][0]["capabilities"]
    assert text(opened) == text(again) == text(strict)
    for answer in (opened, again):
        assert [ch.route.target for ch in answer if ch.text][:6] == ["cloud"] * 6
        assert answer[-1].route.noted("cloud_opening") is None and not answer[-1].route.fallbacks
    assert capabilities["stream_ids"] is False


class FailsDrafting(WrongDrafts):
    """The wrong edge, whose drafting while checks are out fails at once, while the cloud is still
    reading the prompt (its strict rounds' blocks still draft)."""

    def greedy(self, tokens: list[int], limit: int, picker: Any = None) -> Iterator[tuple[int, float]]:
        yield from ()
        raise BackendError("the edge runtime failed mid-draft (injected)", cause="runtime_error")


def test_an_edge_that_fails_during_the_streamed_opening_leaves_the_cloud_to_finish(edge: Backend, cloud: str) -> None:
    with client(FailsDrafting(edge), cloud, overlap=True) as c:
        alone = ask(c, PROMPTS[2], route="cloud", collab="off")
        ask(c, PROMPTS[2], collab={"mode": "verified", "pipeline": False})  # (shows the sessions held)
        answer = ask(c, PROMPTS[2], collab={"mode": "verified", "stream_opening": 6})
        stats = c.stats()
    final = answer[-1]
    [switch] = final.route.fallbacks
    assert (switch["from"], switch["to"]) == ("edge", "cloud")
    assert text(answer) == text(alone) and final.route.tokens["edge"] == 0
    assert all(state == "closed" for state in stats["circuits"].values())  # the cloud was not blamed
