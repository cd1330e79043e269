"""Verified mode at any temperature: every token is the cloud's own draw.

A real llama.cpp edge (SmolLM2, wrong on purpose in every third drafted token, so checks reject
drafts) and a real ``edgecloud serve`` cloud. The verified answers' first tokens are drawn from
the same distribution as the cloud's alone (a two-sample chi-square and the total-variation
distance against the spread of shuffled labels); a seed gives the same text twice and the same
text the cloud alone writes; greedy answers are unchanged; a cloud that does not sample in step
(its checks come back without picks, as vLLM ignores the fields) is never a silent greedy answer.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")
stats = pytest.importorskip("scipy.stats")


from edgecloud import EdgeCloud
from edgecloud.backend import Backend
from edgecloud.errors import ExtensionUnsupportedError
from faults import WrongDrafts, ignoring, serving

KEY = "sk-test"
COUPLING_FIELDS = ("coupling", "seed", "top_k", "min_p", "logit_bias")
PROMPTS = ["Name one colour. Reply with the colour only.", "Pick a number between one and ten.",
           "Say one word about the sea."]
# draws per side: a greedy answer (one text every time) fails the test below by far; a subtler bias
# needs more (1000 a side, run by hand, sees shifts about 1.6x smaller); the torch engine is slower
DRAWS = {"llamacpp": 400, "torch": 200}
TOKENS = 2


@pytest.fixture(scope="module")
def edge(smollm2_path: Path) -> Iterator[Backend]:
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(smollm2_path), n_ctx=1024) as backend:
        yield backend


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def cloud(request: pytest.FixtureRequest, smollm2_path: Path) -> Iterator[str]:
    """``edgecloud serve`` on either engine (the torch engine: the same model dequantized)."""
    with serving(request.param, smollm2_path, n_ctx=1024, api_key=KEY) as (url, _):
        yield url


def client(edge: Any, url: str, **collab: Any) -> EdgeCloud:
    config = {"collab": collab, "fallback": {"max_retries": 0, "timeout_s": 30, "connect_timeout_s": 2},
              "router": {"pii": "off"}}
    return EdgeCloud(edge_backend=edge, cloud_base_url=url, cloud_model="m", cloud_api_key=KEY, config=config)


def ask(c: EdgeCloud, prompt: str, **params: Any) -> Any:
    return c.chat.completions.create(messages=[{"role": "user", "content": prompt}], **params)


def pooled(a: Counter[str], b: Counter[str]) -> np.ndarray:
    """A 2 x K table of the two samples' counts; outcomes rarer than 10 in both pooled into one cell."""
    keys = sorted(set(a) | set(b))
    common = [k for k in keys if a[k] + b[k] >= 10]
    rare = [k for k in keys if k not in common]
    table = [[a[k] for k in common] + [sum(a[k] for k in rare)], [b[k] for k in common] + [sum(b[k] for k in rare)]]
    arr = np.array(table, dtype=float)
    return arr[:, arr.sum(axis=0) > 0]


def tv(table: np.ndarray) -> float:
    p = table / table.sum(axis=1, keepdims=True)
    return 0.5 * float(np.abs(p[0] - p[1]).sum())


def noise_tv(table: np.ndarray, rounds: int = 300) -> float:
    """The 99th percentile of the TV distance between two samples of these sizes drawn from one
    distribution (the rows' labels shuffled): how far apart sampling noise alone puts them."""
    rng = np.random.default_rng(0)
    outcomes = np.repeat(np.arange(table.shape[1]), table.sum(axis=0).astype(int))
    n = int(table[0].sum())
    spread = []
    for _ in range(rounds):
        rng.shuffle(outcomes)
        first = np.bincount(outcomes[:n], minlength=table.shape[1])
        second = np.bincount(outcomes[n:], minlength=table.shape[1])
        spread.append(tv(np.array([first, second], dtype=float)))
    return float(np.quantile(spread, 0.99))


# every prompt on the llama.cpp engine; one on the torch engine (the picks are the same code on both)
@pytest.mark.parametrize(("cloud", "prompt", "draws"),
                         [*(("llamacpp", p, DRAWS["llamacpp"]) for p in PROMPTS),
                          ("torch", PROMPTS[0], DRAWS["torch"])],
                         indirect=["cloud"])
def test_verified_first_tokens_are_distributed_as_the_clouds_alone(edge: Backend, cloud: str, prompt: str,
                                                                  draws: int) -> None:
    verified: Counter[str] = Counter()
    alone: Counter[str] = Counter()
    notes: set[str] = set()

    def cloud_alone() -> None:
        with client(edge, cloud) as c:
            for seed in range(draws):  # other seeds than the verified draws': independent samples
                alone[ask(c, prompt, route="cloud", temperature=1.0, seed=10**6 + seed, max_tokens=TOKENS).text] += 1

    worker = threading.Thread(target=cloud_alone)
    worker.start()
    with client(WrongDrafts(edge), cloud) as c:
        for seed in range(draws):
            answer = ask(c, prompt, temperature=1.0, seed=seed, max_tokens=TOKENS)
            verified[answer.text] += 1
            notes |= {n.code for n in answer.route.notes}
    worker.join()
    assert "sampling" in notes and "verified_rounds" in notes  # verified, and sampled, every time
    table = pooled(verified, alone)
    assert table.shape[1] >= 2, f"the prompt should have several likely answers: {verified.most_common(3)}"
    assert stats.chi2_contingency(table).pvalue > 0.01
    assert tv(table) <= noise_tv(table)


def test_a_seed_writes_the_same_text_as_the_cloud_alone_and_twice_the_same(edge: Backend, cloud: str) -> None:
    with client(WrongDrafts(edge), cloud) as c:
        for seed in (3, 2**40):  # a small seed and one past 32 bits
            for prompt in PROMPTS:
                params = dict(temperature=0.9, top_p=0.95, seed=seed, max_tokens=24)
                first, again = ask(c, prompt, **params), ask(c, prompt, **params)
                alone = ask(c, prompt, route="cloud", **params)
                assert first.text == again.text == alone.text
                # verified (a short answer may be the cloud's opening alone), sampled
                assert first.route.collab == "verified" and first.route.noted("sampling") is not None
                assert first.usage.completion_tokens > 0
        unseeded = {ask(c, PROMPTS[0], temperature=1.0, max_tokens=8).text for _ in range(8)}
        assert len(unseeded) > 1  # no seed: a fresh one per answer


def test_truncation_reaches_the_cloud(edge: Backend, cloud: str) -> None:
    """top_k 1 is greedy whatever the temperature, on both paths; min_p near 1 too."""
    with client(WrongDrafts(edge), cloud) as c:
        greedy = ask(c, PROMPTS[2], temperature=0, max_tokens=16).text
        for extra in ({"top_k": 1}, {"min_p": 0.999}):
            assert ask(c, PROMPTS[2], temperature=1.5, seed=4, max_tokens=16, **extra).text == greedy
            assert ask(c, PROMPTS[2], route="cloud", temperature=1.5, seed=4, max_tokens=16, **extra).text == greedy


def test_greedy_answers_are_unchanged(edge: Backend, cloud: str) -> None:
    with client(WrongDrafts(edge), cloud) as c:
        for prompt in PROMPTS:
            verified = ask(c, prompt, temperature=0, max_tokens=24)
            assert verified.text == ask(c, prompt, route="cloud", temperature=0, max_tokens=24).text
            assert "sampling" not in {n.code for n in verified.route.notes}


def test_a_cloud_that_does_not_sample_in_step_is_never_a_silent_greedy_answer(edge: Backend, cloud: str) -> None:
    with ignoring(cloud, COUPLING_FIELDS, "coupling") as url:
        with client(edge, url) as c:
            answer = ask(c, PROMPTS[0], temperature=1.0, seed=1, max_tokens=12)
            codes = {n.code for n in answer.route.notes}
            assert answer.text and "verified_rounds" not in codes and "sampling" not in codes
            assert "coupling" in answer.route.reason  # the step down says what was refused
            assert c.stats()["clouds"][0]["capabilities"]["coupling"] is False
            # the next sampled answer goes straight to a mode where the cloud samples itself
            later = ask(c, PROMPTS[1], temperature=1.0, seed=2, max_tokens=12)
            assert "verified_rounds" not in {n.code for n in later.route.notes}
            # greedy requests are still verified against it
            greedy = ask(c, PROMPTS[1], temperature=0, max_tokens=12)
            assert "verified_rounds" in {n.code for n in greedy.route.notes}
        with client(edge, url, mode="verified") as c, pytest.raises(ExtensionUnsupportedError) as refused:
            ask(c, PROMPTS[0], temperature=1.0, seed=1, max_tokens=12)
        assert refused.value.extension == "coupling"


def test_penalties_are_not_verified(edge: Backend, cloud: str) -> None:
    from edgecloud.errors import InvalidRequestError

    with client(edge, cloud) as c:
        answer = ask(c, PROMPTS[0], temperature=0.7, presence_penalty=0.5, max_tokens=8)
        assert "verified_rounds" not in {n.code for n in answer.route.notes}
        assert "presence_penalty" in answer.route.reason
    with client(edge, cloud, mode="verified") as c, pytest.raises(InvalidRequestError) as caught:
        ask(c, PROMPTS[0], temperature=0.7, frequency_penalty=0.5, max_tokens=8)
    assert caught.value.param == "frequency_penalty"
