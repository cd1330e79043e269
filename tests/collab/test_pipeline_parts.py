"""The parts of pipelined verified rounds: the check-cost fit, the block it picks, whether the
cloud shares this process's CPUs, the edge's line drafted ahead of the checks, and a draft that
ends at the first token the edge is unsure of."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgecloud.collab.rounds import DraftLine, RoundCost, shares_cpu


def test_the_cost_fit_finds_the_line_of_the_checks_it_saw() -> None:
    cost = RoundCost()
    for _ in range(30):
        for tokens in (2, 5, 9, 16):
            cost.observe(tokens, 0.05 + 0.02 * tokens)
    fixed, per_token = cost.line()
    assert fixed == pytest.approx(0.05, abs=0.01) and per_token == pytest.approx(0.02, abs=0.002)


def test_the_block_grows_with_acceptance() -> None:
    cost = RoundCost()
    for _ in range(20):
        for tokens in (2, 8, 16):
            cost.observe(tokens, 0.1 + 0.005 * tokens)
    low, high = cost.block(0.5, 1, 15), cost.block(0.95, 1, 15)
    assert 1 <= low < high <= 15
    assert cost.block(0.99, 4, 6) in (4, 5, 6)


def test_a_remote_cloud_never_shares_the_cpus() -> None:
    assert not shares_cpu("https://api.example.com/v1")
    assert not shares_cpu("http://10.0.0.7:8000/v1")


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")
def test_a_loopback_cloud_shares_them_unless_this_process_is_pinned() -> None:
    code = ("import json; from edgecloud.collab.rounds import shares_cpu; "
            "print(json.dumps([shares_cpu('http://127.0.0.1:8000/v1'), shares_cpu('http://localhost:8000/v1')]))")
    free = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert free == [True, True]
    pinned = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import os

    expected = (os.cpu_count() or 1) == 1  # one CPU: pinned to it is all of them
    assert json.loads(pinned.stdout) == [expected, expected]


def test_the_line_goes_on_where_it_holds_what_was_written(smollm2_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(smollm2_path), n_ctx=512) as edge:
        prompt = edge.tokenize_chat([{"role": "user", "content": "Count from one to ten."}])
        whole = edge.draft(prompt, 12)
        line = DraftLine(edge, prompt)
        line.extend(6)
        assert line.tokens == whole[:6]
        assert line.advance(whole[:3])  # written as drafted: the line goes on
        line.extend(9)
        assert line.tokens == whole[3:12]
        other = (whole[3] + 1) % 1000
        assert not line.advance([whole[3], other])  # the cloud wrote another token: drafted again
        assert line.tokens == [] and line.context == prompt + whole[:4] + [other]
        line.extend(2)
        line.close()  # (the line holds the edge's greedy stream open between checks)
        assert line.tokens == edge.draft(prompt + whole[:4] + [other], 2)


def test_a_draft_ends_after_the_first_token_below_the_floor(smollm2_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from edgecloud.edge.llamacpp import LlamaCppBackend

    with LlamaCppBackend(str(smollm2_path), n_ctx=512) as edge:
        prompt = edge.tokenize_chat([{"role": "user", "content": "Write a short poem about autumn leaves."}])
        line = list(edge.greedy(prompt, 15))
        tokens, probs = [t for t, _ in line], [p for _, p in line]
        assert edge.draft(prompt, 15) == tokens
        floor = sorted(probs)[len(probs) // 2]  # the median: some tokens fall below it, some do not
        first_below = next(i for i, p in enumerate(probs) if p < floor)
        assert edge.draft(prompt, 15, until_below=floor) == tokens[:first_below + 1]
        assert edge.draft(prompt, 15, until_below=1.01) == tokens[:1]  # every token is below: one a block
        assert edge.draft(prompt, 15, until_below=1.01, at_least=4) == tokens[:4]
        assert edge.draft(prompt, 15, until_below=0.0) == tokens

