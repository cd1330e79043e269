"""``edgecloud plan``: JSON output, table output, and errors as exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from edgecloud.cli.plan import plan_command

app = typer.Typer()
app.command("plan")(plan_command)
app.command("noop")(lambda: None)  # two commands, so "plan" stays a sub-command


def test_plan_json_for_a_catalogue_model_on_a_phone() -> None:
    result = CliRunner().invoke(app, ["plan", "--model", "qwen2.5-coder-1.5b-instruct-q4", "--device", "phone-8gb", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("fits", "reason", "weights_bytes", "kv_bytes", "compute_bytes", "overhead_bytes", "total_bytes",
                "budget_bytes", "max_context", "kv_cache_type", "n_ctx", "gpu_layers", "device", "model"):
        assert key in data
    assert data["fits"] is True and data["device"] == "phone-8gb"
    assert data["total_bytes"] <= data["budget_bytes"]
    assert 1 <= data["cpu"]["threads"] <= data["cpu"]["allowed"] <= data["cpu"]["logical"]


def test_plan_table_for_a_local_file(smollm2_path: Path) -> None:
    result = CliRunner().invoke(app, ["plan", "--model", str(smollm2_path), "--device", "laptop-16gb", "--ctx", "2048"])
    assert result.exit_code == 0, result.output
    assert "KV cache" in result.stdout and "2,048" in result.stdout


def test_plan_3b_on_a_phone_with_forced_cache_type() -> None:
    result = CliRunner().invoke(
        app, ["plan", "--model", "phi-3-mini-4k-instruct-q4", "--device", "phone-8gb", "--kv-cache-type", "f16", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kv_cache_type"] == "f16"


def test_plan_errors_exit_2_without_traceback() -> None:
    runner = CliRunner()
    for args in (["--model", "no-such-model"], ["--model", "smollm2-135m-instruct-q4", "--device", "toaster"],
                 ["--model", "smollm2-135m-instruct-q4", "--ctx", "0"]):
        result = runner.invoke(app, ["plan", *args, "--json"])
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        assert "error" in result.stderr


def test_plan_says_what_verified_mode_drafts_with_and_its_weights() -> None:
    runner = CliRunner()
    edge = runner.invoke(app, ["plan", "--model", "qwen2.5-coder-0.5b-instruct-q4", "--json"])
    assert edge.exit_code == 0, edge.output
    data = json.loads(edge.stdout)
    drafter = data["drafter"]  # the catalogue's faster file of the edge model, planned from its metadata
    alone = json.loads(runner.invoke(app, ["plan", "--model", drafter["model"], "--json"]).stdout)
    assert 0 < drafter["weights_bytes"] == alone["weights_bytes"] < data["weights_bytes"]
    one_file = runner.invoke(app, ["plan", "--model", "qwen2.5-coder-0.5b-instruct-q4", "--json"],
                             env={"EDGECLOUD_EDGE_DRAFT_MODEL": ""})
    assert "drafter" not in json.loads(one_file.stdout)
    small = json.loads(runner.invoke(app, ["plan", "--model", "smollm2-135m-instruct-q4", "--json"]).stdout)
    assert "drafter" not in small  # an edge model with no faster file drafts itself
