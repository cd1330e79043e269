"""--engine auto: the engine expected to serve the load best on this machine, steered by the
options given, with the figures it chose by in its reason."""

from __future__ import annotations

import math

import pytest

from edgecloud.runtime.hardware import nvidia_gpus
from edgecloud.serving.engine_choice import choose_engine, expected_tokens_per_s
from edgecloud.serving.engines import ENGINES

pytestmark = pytest.mark.skipif(bool(nvidia_gpus()), reason="an NVIDIA GPU is visible: the CPU rules do not apply")


def test_interpolation_is_in_log_streams_and_flat_beyond_the_ends() -> None:
    measured = {1: 10.0, 4: 30.0, 16: 90.0}
    assert expected_tokens_per_s(measured, 4) == 30.0
    assert math.isclose(expected_tokens_per_s(measured, 2), 20.0)
    assert math.isclose(expected_tokens_per_s(measured, 8), 60.0)
    assert expected_tokens_per_s(measured, 64) == 90.0


def test_one_user_gets_the_fastest_single_stream_and_many_the_best_batch() -> None:
    alone = choose_engine(vllm_version=None, vllm_on_cpu=False, streams=None, torch_installed=True)
    busy = choose_engine(vllm_version=None, vllm_on_cpu=False, streams=16, torch_installed=True, quant="bf16")
    assert alone.engine == "llamacpp" and busy.engine == "torch"
    for choice in (alone, busy):  # the figures it chose by are said
        assert "llama.cpp (INT4) ~" in choice.reason and "torch (" in choice.reason
    assert "16 concurrent streams" in busy.reason


def test_without_torch_the_batch_load_stays_on_llamacpp() -> None:
    choice = choose_engine(vllm_version=None, vllm_on_cpu=False, streams=16, torch_installed=False)
    assert choice.engine == "llamacpp" and "edgecloud[cloud]" in choice.reason


@pytest.mark.parametrize(("given", "streams", "engine"), [({"--quant": True}, None, "torch"),
                                                          ({"--kv-ram-mib": True}, 16, "llamacpp")])
def test_an_option_the_preferred_engine_refuses_steers_to_one_that_takes_it(given: dict[str, bool],
                                                                           streams: int | None, engine: str) -> None:
    choice = choose_engine(vllm_version=None, vllm_on_cpu=False, streams=streams, torch_installed=True, quant="bf16",
                           refuses=lambda name: ENGINES[name].refused(given))
    assert choice.engine == engine
    assert f"{next(iter(given))} does not apply to" in choice.reason
