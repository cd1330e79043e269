"""A slice of the edge-quantization benchmark (benchmarks/edge_quant.py) as CI runs it: the type
the catalogue's default edge model is made as is the one the committed measurements choose held
out by task family, and it is faster than the published file without drafting much worse."""

from __future__ import annotations

import json

from edgecloud.store import DEFAULT_DRAFT_MODEL, require_entry
from bench_scripts import load


def test_the_default_edge_type_is_the_one_chosen_held_out_by_family() -> None:
    bench = load("edge_quant")
    data = json.loads(bench.OUT.read_text())
    report = bench._report(data)  # recomputed from the committed speeds, agreements and grades
    shipped = require_entry(DEFAULT_DRAFT_MODEL).source.type
    assert {fold["chosen"] for fold in report["held_out"].values()} == {shipped}
    assert len(report["held_out"]) >= 8
    row, published = report["table"][shipped], report["table"]["published"]
    assert row["decode_ms_2t"] * bench.MIN_SPEEDUP <= published["decode_ms_2t"]
    assert row["decode_ms_1t"] < published["decode_ms_1t"] and row["mib"] < published["mib"]
    # on every held-out family its picks agree with the cloud's within a point of the published file's
    assert all(fold["published"] - fold["agree_with_cloud"] < 0.01 for fold in report["held_out"].values())
    # all-edge answers were graded for both files on the same tasks, at least 100 of them
    assert len(data["quality"]) >= 100 and all({"published", shipped} <= set(r) for r in data["quality"].values())
    assert shipped in report["all_edge_paired"]
