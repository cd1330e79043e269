"""Compute threads follow what the process may use: its CPU affinity and its cgroup's CPU quota."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgecloud.runtime.hardware import _cgroup_quota, cpu_budget


def test_the_affinity_mask_scales_the_physical_cores() -> None:
    assert cpu_budget(affinity={0}, quota=None, physical=8, logical=16).threads == 1
    assert cpu_budget(affinity=set(range(6)), quota=None, physical=8, logical=16).threads == 3
    assert cpu_budget(affinity=set(range(16)), quota=None, physical=8, logical=16).threads == 8


def test_the_quota_caps_the_threads_rounded_up() -> None:
    assert cpu_budget(affinity=set(range(16)), quota=1.5, physical=8, logical=16).threads == 2
    assert cpu_budget(affinity=set(range(16)), quota=0.2, physical=8, logical=16).threads == 1
    assert "quota" in cpu_budget(affinity=set(range(16)), quota=2.0, physical=8, logical=16).describe()


@pytest.mark.parametrize(("files", "expected"), [
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_cgroup_quota_files_v1_and_v2(tmp_path: Path, files: dict[str, str], expected: float | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _cgroup_quota(str(tmp_path)) == expected


@pytest.mark.skipif(shutil.which("taskset") is None or not sys.platform.startswith("linux"), reason="needs taskset")
def test_a_process_pinned_to_one_core_runs_one_thread() -> None:
    code = ("import json; from edgecloud.runtime.llama_cpp import physical_cores; "
            "from edgecloud.runtime.hardware import cpu_budget; b = cpu_budget(); "
            "print(json.dumps([physical_cores(), b.allowed]))")
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True, check=True)
    threads, allowed = json.loads(out.stdout)
    assert (threads, allowed) == (1, 1)
