"""`edgecloud chat`: one-shot (answer on stdout, stats on stderr) and the REPL over a pipe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

EDGECLOUD = [sys.executable, "-m", "edgecloud"]


def test_one_shot_prints_only_the_answer(smollm2_path: Path) -> None:
    result = subprocess.run(
        [*EDGECLOUD, "chat", "--prompt", "Say hello.", "--model", str(smollm2_path),
         "--max-tokens", "16", "--temperature", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "an answer on stdout"
    assert "TTFT" not in result.stdout
    assert "TTFT" in result.stderr and "edge/llamacpp" in result.stderr


def test_one_shot_unknown_model_is_exit_2_without_traceback() -> None:
    result = subprocess.run(
        [*EDGECLOUD, "chat", "--prompt", "hi", "--model", "no-such-model"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "known models" in result.stderr
    assert "Traceback" not in result.stderr


def test_repl_commands_over_a_pipe(smollm2_path: Path) -> None:
    script = "/stats\nWhat is 2+2?\n/stats\n/reset\n/help\n/exit\n"
    result = subprocess.run(
        [*EDGECLOUD, "chat", "--model", str(smollm2_path), "--max-tokens", "12", "--temperature", "0"],
        input=script, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "no answer yet" in out
    assert "TTFT" in out and "tok/s" in out
    assert "conversation cleared" in out
    assert "/reset" in out  # the help line


def test_ctrl_c_stops_the_answer_not_the_program(smollm2_path: Path) -> None:
    proc = subprocess.Popen(
        # greedy: the 135M model's story falls into a loop and runs to the token limit, so the answer is
        # still streaming when the signal comes (sampled, it sometimes ended in 21 tokens, before it)
        [*EDGECLOUD, "chat", "--model", str(smollm2_path), "--max-tokens", "2000", "--temperature", "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # a terminal's Ctrl-C, also where the tests run in the background (which ignores SIGINT, and
        # a child inherits that)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("Write a very long story about a dragon.\n")
    proc.stdin.flush()
    # Wait until the answer has started streaming, then interrupt it.
    deadline = time.monotonic() + 120
    seen = ""
    while "ai›" not in seen and time.monotonic() < deadline:
        seen += proc.stdout.read(1)
    seen += proc.stdout.read(8)  # the answer's first words
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    proc.stdin.write("/stats\n/exit\n")
    proc.stdin.flush()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "(stopped)" in out
    assert "finish cancelled" in out


def test_repl_shows_what_the_cloud_wrote(smollm2_path: Path) -> None:
    from faults import ServeProcess

    with ServeProcess(str(smollm2_path)) as server:
        result = subprocess.run(
            [*EDGECLOUD, "chat", "--model", str(smollm2_path), "--max-tokens", "16", "--temperature", "0",
             "--cloud-url", server.url, "--cloud-model", smollm2_path.stem, "--cloud-key", server.api_key,
             "--collab", "token"],
            input="Name two colours.\n/stats\n/exit\n", capture_output=True, text=True, timeout=300,
            # the gate fires on every token: the cloud writes spans; colours forced on through the pipe
            env={**os.environ, "EDGECLOUD_COLLAB__GATE": "0", "FORCE_COLOR": "1", "COLUMNS": "200"},
        )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "\x1b[35m" in out  # the cloud's text, in magenta
    assert "tokens by the cloud" in out and "cloud calls" in out  # the answer's footer
    assert "answer tokens by the cloud" in out  # /stats


def test_unknown_collab_mode_is_exit_2(smollm2_path: Path) -> None:
    result = subprocess.run([*EDGECLOUD, "chat", "--prompt", "hi", "--model", str(smollm2_path), "--collab", "maybe"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "collab" in result.stderr and "Traceback" not in result.stderr


ROOT = Path(__file__).resolve().parents[2]


def test_tools_run_on_this_machine_and_their_results_go_back(qwen05_path: Path) -> None:
    result = subprocess.run(
        [*EDGECLOUD, "chat", "--model", str(qwen05_path), "--tools", str(ROOT / "examples/tools/tools.json"),
         "-t", "0", "--max-tokens", "60", "--prompt", "Use the calculator: what is 17 * 23 + 4?"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    calls = [line for line in result.stderr.splitlines() if line.startswith("→ calculate(")]
    assert calls, result.stderr[-2000:]
    # the example's calculator really ran: each result is its expression's value
    for line in calls:
        import json

        args, value = line.removeprefix("→ calculate(").rsplit(") = ", 1)
        if value.startswith("error:"):
            continue  # the model wrote something that is not arithmetic; the tool said so
        expression = json.loads(args)["expression"]
        assert float(value) == eval(expression, {"__builtins__": {}})  # noqa: S307 - the model's arithmetic, checked


def test_a_bad_tools_file_is_exit_2(tmp_path: Path, smollm2_path: Path) -> None:
    bad = tmp_path / "tools.json"
    bad.write_text('[{"type": "function", "function": {"name": "f"}}]')
    result = subprocess.run([*EDGECLOUD, "chat", "--prompt", "hi", "--model", str(smollm2_path), "--tools", str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "'run'" in result.stderr and "Traceback" not in result.stderr
