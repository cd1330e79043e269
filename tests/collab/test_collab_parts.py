"""The pieces of collaboration that need no model: the gate's signals, the verified mode's draft
length, the span deadline."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import pytest

from edgecloud.collab.gate import Gate, signals_of
from edgecloud.collab.run import SpanDeadline, pump
from edgecloud.collab.verified import choose_k
from edgecloud.errors import ConfigError
from edgecloud.types import TokenLogprob, TopLogprob


def entry(*probs: float) -> TokenLogprob:
    tops = [TopLogprob(token=str(i), logprob=math.log(p)) for i, p in enumerate(probs)]
    return TokenLogprob(token="0", logprob=tops[0].logprob, top_logprobs=tops)


def test_signals_of_a_coin_flip_and_of_a_sure_token() -> None:
    coin = signals_of(entry(0.5, 0.5))
    assert coin.entropy == pytest.approx(math.log(2)) and coin.top1 == pytest.approx(0.5)
    assert coin.margin == pytest.approx(0.0)
    sure = signals_of(entry(0.999, 0.001))
    assert sure.entropy < 0.01 and sure.margin == pytest.approx(0.998)


def test_mass_outside_the_alternatives_counts_as_uncertainty() -> None:
    seen = signals_of(entry(0.4, 0.1))  # half the mass is elsewhere
    assert seen.entropy > signals_of(entry(0.8, 0.2)).entropy
    assert seen.margin == pytest.approx(0.3)


@pytest.mark.parametrize("signal", ["entropy", "top1", "margin"])
def test_the_gate_fires_on_the_unsure_token_only(signal: str) -> None:
    gate = Gate(signal, 0.3)  # type: ignore[arg-type]
    assert gate.unsure(entry(0.4, 0.35, 0.25))
    assert not gate.unsure(entry(0.98, 0.01, 0.01))
    assert not Gate(signal, 1.0).unsure(entry(0.34, 0.33, 0.33))  # type: ignore[arg-type]
    assert Gate(signal, 0.0).unsure(entry(0.9, 0.1))  # type: ignore[arg-type]


def test_a_bad_gate_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="signal"):
        Gate("vibes", 0.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="0..1"):
        Gate("top1", 1.5)


def test_draft_length_grows_with_acceptance_and_with_the_cost_of_a_round() -> None:
    assert choose_k(0.95, draft_s=0.01, round_s=0.2, k_max=16) > choose_k(0.5, draft_s=0.01, round_s=0.2, k_max=16)
    assert choose_k(0.8, draft_s=0.01, round_s=0.5, k_max=16) >= choose_k(0.8, draft_s=0.01, round_s=0.02, k_max=16)
    assert choose_k(0.99, draft_s=0.001, round_s=5.0, k_max=6) == 6
    assert choose_k(0.0, draft_s=0.05, round_s=0.01, k_max=8) == 1


def test_pump_gives_up_at_the_deadline_and_stops_the_reader() -> None:
    released = threading.Event()
    stopped = threading.Event()

    def slow() -> Iterator[int]:
        try:
            yield 1
            released.wait(5)
            yield 2
            yield 3
        finally:
            stopped.set()

    reads = pump(slow, first_s=5.0, next_s=0.2)
    assert next(reads) == 1
    with pytest.raises(SpanDeadline) as info:
        next(reads)
    assert info.value.cause == "timeout"
    released.set()
    assert stopped.wait(5)  # the reader thread closed its stream


def test_pump_hands_over_the_readers_error() -> None:
    def broken() -> Iterator[int]:
        yield 1
        raise OSError("reset")

    reads = pump(broken, first_s=5.0)
    assert next(reads) == 1
    with pytest.raises(OSError, match="reset"):
        next(reads)
    assert list(pump(lambda: iter([1, 2]), first_s=5.0)) == [1, 2]
