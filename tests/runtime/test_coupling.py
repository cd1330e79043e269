"""The shared-noise sampler: its picks are draws from the tempered, truncated distribution, the
same on both sides given the same logits, and bad settings are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from edgecloud.errors import InvalidRequestError
from edgecloud.runtime.completions import CompletionRequest
from edgecloud.runtime.coupling import Coupling, gumbel_noise
from edgecloud.runtime.sampling import answer_coupling, sampling_distribution
from edgecloud.types import ChatRequest

RNG = np.random.default_rng(7)
LOGITS = RNG.normal(0.0, 2.0, 40).astype(np.float32)
DRAWS = 6000


def draws(coupling_of_seed: object, logits: np.ndarray, position: int = 11) -> np.ndarray:
    counts = np.zeros(logits.shape[0])
    for seed in range(DRAWS):
        counts[coupling_of_seed(seed).pick(logits, position)] += 1  # type: ignore[operator]
    return counts


def holds(counts: np.ndarray, probs: np.ndarray) -> float:
    """The chi-square goodness-of-fit p-value of ``counts`` against ``probs`` (rare cells pooled)."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    return float(stats.chisquare(observed, wanted).pvalue)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_picks_are_draws_from_the_tempered_distribution(temperature: float) -> None:
    counts = draws(lambda s: Coupling(seed=s, temperature=temperature), LOGITS)
    assert holds(counts, sampling_distribution(LOGITS, temperature)) > 0.01


def test_top_p_keeps_the_nucleus_and_samples_within_it() -> None:
    probs = sampling_distribution(LOGITS, 0.8, top_p=0.7)  # the reference nucleus, renormalised
    counts = draws(lambda s: Coupling(seed=s, temperature=0.8, top_p=0.7), LOGITS)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(probs))
    assert holds(counts, probs) > 0.01


def test_top_k_and_min_p_cut_the_tail() -> None:
    order = np.argsort(-LOGITS)
    counts = draws(lambda s: Coupling(seed=s, top_k=3), LOGITS)
    assert set(np.flatnonzero(counts)) == set(order[:3].tolist())
    probs = sampling_distribution(LOGITS, 1.0)
    kept = probs >= 0.2 * probs.max()
    counts = draws(lambda s: Coupling(seed=s, min_p=0.2), LOGITS)
    assert set(np.flatnonzero(counts)) == set(np.flatnonzero(kept).tolist())
    wanted = np.where(kept, probs, 0.0)
    assert holds(counts, wanted / wanted.sum()) > 0.01


def test_positions_draw_independently() -> None:
    """The pick at one position says nothing about the pick at the next (the noise is fresh)."""
    flat = np.zeros(6, dtype=np.float32)
    pairs = np.zeros((6, 6))
    for seed in range(DRAWS):
        c = Coupling(seed=seed)
        pairs[c.pick(flat, 5), c.pick(flat, 6)] += 1
    assert stats.chi2_contingency(pairs).pvalue > 0.01


def test_the_same_noise_on_any_subset_and_fresh_noise_elsewhere() -> None:
    ids = np.arange(1000)
    full = gumbel_noise(42, 9, ids)
    assert np.array_equal(gumbel_noise(42, 9, ids[[3, 500, 999]]), full[[3, 500, 999]])
    assert not np.allclose(gumbel_noise(42, 10, ids), full)
    assert not np.allclose(gumbel_noise(43, 9, ids), full)
    assert stats.kstest(full, stats.gumbel_r.cdf).pvalue > 0.01


def test_models_that_agree_pick_alike_and_close_ones_mostly() -> None:
    near = LOGITS + RNG.normal(0.0, 0.2, LOGITS.shape).astype(np.float32)
    same = sum(Coupling(seed=s).pick(LOGITS, 3) == Coupling(seed=s).pick(LOGITS.copy(), 3) for s in range(500))
    close = sum(Coupling(seed=s).pick(LOGITS, 3) == Coupling(seed=s).pick(near, 3) for s in range(500))
    assert same == 500
    assert close > 400  # the coupling: independent draws would agree far less often
    independent = sum(Coupling(seed=s).pick(LOGITS, 3) == Coupling(seed=s + 10_000).pick(near, 3) for s in range(500))
    assert close > independent + 100


def test_temperature_zero_is_the_biased_argmax() -> None:
    top = int(LOGITS.argmax())
    assert Coupling(seed=1, temperature=0.0).pick(LOGITS, 0) == top
    other = (top + 1) % LOGITS.shape[0]
    assert Coupling(seed=1, temperature=0.0, bias=((other, 100.0),)).pick(LOGITS, 0) == other


def test_a_request_without_temperature_samples_as_openai_does() -> None:
    ask = {"messages": [{"role": "user", "content": "hi"}]}
    assert answer_coupling(ChatRequest(**ask, temperature=0)) is None
    assert answer_coupling(ChatRequest(**ask)).temperature == 1.0  # type: ignore[union-attr]
    seeded = answer_coupling(ChatRequest(**ask, temperature=0.7, seed=5, top_k=20, min_p=0.05))
    assert seeded == Coupling(seed=5, temperature=0.7, top_k=20, min_p=0.05)


@pytest.mark.parametrize(("settings", "param"), [
    ({"temperature": 2.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -3}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
])
def test_bad_settings_are_refused_by_name(settings: dict[str, float], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        Coupling(seed=0, **settings)  # type: ignore[arg-type]
    assert caught.value.param == param


@pytest.mark.parametrize(("body", "param"), [
    ({"coupling": "gumbel-splitmix64-v1", "seed": 1, "temperature": 1.0}, "coupling"),  # not a scoring request
    ({"echo": True, "logprobs": 1, "coupling": "other-scheme", "seed": 1}, "coupling"),
    ({"echo": True, "logprobs": 1, "coupling": "gumbel-splitmix64-v1", "temperature": 1.0}, "seed"),
    ({"echo": True, "logprobs": 1, "logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"echo": True, "logprobs": 1, "top_k": -2}, "top_k"),
])
def test_bad_coupled_checks_are_refused_by_name(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        CompletionRequest(prompt=[1, 2, 3], **body)
    assert caught.value.param == param


@pytest.mark.parametrize(("field", "value"), [("top_k", -2), ("min_p", 1.5), ("min_p", -0.1)])
def test_bad_truncation_on_a_chat_request_is_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        ChatRequest(messages=[{"role": "user", "content": "hi"}], **{field: value})
    assert caught.value.param == field
