"""CostModel prices tokens and device seconds exactly; CostTotals sums them across threads."""

from __future__ import annotations

import threading

import pytest

from edgecloud.config import Prices
from edgecloud.observability.cost import CostModel, CostTotals
from edgecloud.types import CostInfo, Usage

# $0.50 / $1.50 per million tokens, $0.0001 per device second
PRICES = Prices(cloud_input_per_mtok=0.5, cloud_output_per_mtok=1.5, edge_per_second=0.0001)


def usage(prompt: int, completion: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def test_cloud_request_costs_its_tokens_and_saves_nothing() -> None:
    cost = CostModel(PRICES).price("cloud", usage(1000, 200))
    # 1000 * 0.5e-6 + 200 * 1.5e-6
    assert cost == CostInfo(usd=0.0008, cloud_equivalent_usd=0.0008, saved_usd=0.0,
                            edge_seconds=0.0, cloud_input_tokens=1000, cloud_output_tokens=200,
                            cloud_calls=1, cloud_passes=201, all_cloud_passes=201, vs_all_cloud=1.0,
                            all_cloud_input_tokens=1000, all_cloud_output_tokens=200,
                            passes_vs_all_cloud=1.0)  # 2 prefill passes, then 199 decode steps


def test_edge_request_costs_device_seconds_and_saves_the_cloud_price() -> None:
    cost = CostModel(PRICES).price("edge", usage(1000, 200), edge_seconds=2.5)
    assert cost == CostInfo(usd=0.00025, cloud_equivalent_usd=0.0008, saved_usd=0.00055,
                            edge_seconds=2.5, cloud_input_tokens=0, cloud_output_tokens=0,
                            all_cloud_passes=201, vs_all_cloud=0.3125, passes_vs_all_cloud=0.0,
                            all_cloud_input_tokens=1000, all_cloud_output_tokens=200)


def test_free_edge_by_default_and_negative_saving_when_the_device_is_dearer() -> None:
    assert CostModel().price("edge", usage(1000, 200), edge_seconds=9.0).saved_usd == 0.0008
    dear = CostModel(Prices(edge_per_second=0.01)).price("edge", usage(1000, 200), edge_seconds=1.0)
    assert (dear.usd, dear.saved_usd) == (0.01, -0.0092)


def test_mid_stream_fallback_prices_each_side_for_its_share() -> None:
    model = CostModel(PRICES)
    # 40 tokens on the cloud, then the edge re-reads prompt + partial answer and writes 60 more in 1.5 s
    parts = [model.price_part("cloud", 1000, 40), model.price_part("edge", 1040, 60, seconds=1.5)]
    assert parts[0].usd == 0.00056 and parts[1].usd == 0.00015
    total = model.combine(parts, usage(1000, 100))
    # cloud part 0.0005 + 0.00006, edge part 1.5 s * 0.0001; equivalent 1000*0.5e-6 + 100*1.5e-6
    assert total == CostInfo(usd=0.00071, cloud_equivalent_usd=0.00065, saved_usd=-0.00006,
                             edge_seconds=1.5, cloud_input_tokens=1000, cloud_output_tokens=40,
                             cloud_calls=1, cloud_passes=41, all_cloud_passes=101, vs_all_cloud=1.092308,
                             passes_vs_all_cloud=0.405941, all_cloud_input_tokens=1000, all_cloud_output_tokens=100)
    # price() with both sides given is the same request priced at once
    at_once = model.price("edge", usage(1000, 100), edge_seconds=1.5, cloud_input_tokens=1000, cloud_output_tokens=40)
    assert at_once == total
    # without usage the equivalent is the parts' sum (the prompt counted twice)
    assert model.combine(parts).cloud_equivalent_usd == 0.00117  # 0.00056 + 0.00061


def test_amounts_are_rounded_to_nano_dollars() -> None:
    cost = CostModel(Prices(cloud_input_per_mtok=0.1, cloud_output_per_mtok=0.2)).price("cloud", usage(1, 2))
    assert cost.usd == 0.0000005  # 0.1e-6 + 0.4e-6, without float noise


def test_unknown_target_is_refused() -> None:
    with pytest.raises(ValueError, match="'edge' or 'cloud'"):
        CostModel().price("gpu", usage(1, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'edge' or 'cloud'"):
        CostTotals().add(CostInfo(), "gpu")


def test_totals_sum_requests_sides_and_savings() -> None:
    model, totals = CostModel(PRICES), CostTotals()
    totals.add(model.price("cloud", usage(1000, 200)), "cloud", tokens={"edge": 0, "cloud": 200})
    totals.add(model.price("edge", usage(1000, 200), edge_seconds=2.5), "edge", fallbacks=1,
               tokens={"edge": 150, "cloud": 50})
    snap = totals.snapshot()
    assert snap == {
        "requests": 2, "edge_requests": 1, "cloud_requests": 1, "fallbacks": 1,
        "cost_usd": 0.00105, "cloud_equivalent_usd": 0.0016, "saved_usd": 0.00055,
        "saved_pct": 34.375, "edge_seconds": 2.5, "cloud_input_tokens": 1000, "cloud_output_tokens": 200,
        "edge_answer_tokens": 150, "cloud_answer_tokens": 250, "cloud_token_share": 0.625,
        "cloud_cached_tokens": 0, "cloud_calls": 1, "cloud_passes": 201, "all_cloud_passes": 402,
        "all_cloud_input_tokens": 2000, "all_cloud_output_tokens": 400,
        "cost_vs_all_cloud": 0.65625, "passes_vs_all_cloud": 0.5,
    }
    totals.reset()
    assert totals.snapshot()["requests"] == 0 and totals.snapshot()["saved_pct"] == 0.0


def test_totals_are_thread_safe() -> None:
    totals = CostTotals()
    one = CostInfo(usd=0.000001, cloud_equivalent_usd=0.000002, saved_usd=0.000001, cloud_output_tokens=1)

    def work() -> None:
        for _ in range(2000):
            totals.add(one, "edge")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = totals.snapshot()
    assert (snap["requests"], snap["edge_requests"], snap["cloud_output_tokens"]) == (8000, 8000, 8000)
    assert (snap["cost_usd"], snap["saved_pct"]) == (0.008, 50.0)


def test_cached_input_is_priced_at_its_share_and_unreported_cache_as_uncached() -> None:
    model = CostModel(Prices(cloud_input_per_mtok=1.0, cloud_output_per_mtok=2.0, cloud_cached_input_share=0.1))
    cached = model.price_part("cloud", 1000, 10, cached_tokens=800)
    assert cached.usd == 0.0003  # 200 uncached 0.0002, 800 at 10 % 0.00008, 10 out 0.00002
    assert cached.cloud_cached_tokens == 800
    assert model.price_part("cloud", 1000, 10).usd == 0.00102  # no cached tokens reported: all uncached
    free = CostModel(Prices(cloud_input_per_mtok=1.0, cloud_cached_input_share=0.0)).price_part("cloud", 100, 0,
                                                                                                 cached_tokens=100)
    assert free.usd == 0.0


def test_forward_passes_count_prefill_chunks_and_decode_steps() -> None:
    from edgecloud.observability.cost import PREFILL_CHUNK, forward_passes

    assert forward_passes(10, 1) == 1  # a verification round: one pass
    assert forward_passes(10, 5) == 5  # the prompt's pass gives the first token, then 4 steps
    assert forward_passes(PREFILL_CHUNK + 1, 1) == 2
    assert forward_passes(0, 0) == 0
    model = CostModel(PRICES)
    total = model.combine([model.price_part("cloud", 40, 1, passes=1), model.price_part("cloud", 6, 1, passes=1),
                           model.price_part("edge", 0, 0, seconds=2.0)], usage(40, 30))
    assert (total.cloud_calls, total.cloud_passes, total.all_cloud_passes) == (2, 2, 30)
    assert total.passes_vs_all_cloud == pytest.approx(2 / 30, rel=1e-4)
    assert total.vs_all_cloud == pytest.approx(total.usd / total.cloud_equivalent_usd, rel=1e-4)


def test_totals_compare_with_the_same_answers_all_cloud() -> None:
    model, totals = CostModel(PRICES), CostTotals()
    totals.add(model.combine([model.price_part("cloud", 50, 2, passes=2)], usage(40, 20)), "edge")
    totals.add(model.price("edge", usage(40, 20), edge_seconds=1.0), "edge")
    out = totals.snapshot()
    assert out["cloud_calls"] == 1 and out["cloud_passes"] == 2 and out["all_cloud_passes"] == 40
    assert out["passes_vs_all_cloud"] == 0.05
    assert out["cost_vs_all_cloud"] == pytest.approx(out["cost_usd"] / out["cloud_equivalent_usd"], rel=1e-4)
