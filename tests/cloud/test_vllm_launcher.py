"""The vLLM launcher: settings → ``vllm serve`` argv, the not-installed error, dry runs, and
the process handling (exit status, signal forwarding) through a stand-in ``vllm`` script."""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from edgecloud.cloud import vllm
from edgecloud.cloud.vllm import VLLMSettings, format_command, launch_vllm, vllm_command
from edgecloud.errors import (
    BackendUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
)

HF_REPO = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct-q4"


def flag(argv: list[str], name: str) -> str:
    """The value after ``name`` (which must occur exactly once)."""
    assert argv.count(name) == 1, argv
    return argv[argv.index(name) + 1]


@pytest.fixture()
def no_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PATH without a ``vllm`` script; skips where the vllm package itself is installed."""
    if vllm._vllm_importable():
        pytest.skip("vllm is installed here")
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(vllm.sys, "executable", str(empty / "python"))


@pytest.mark.parametrize(
    ("quant", "expected"),
    [
        ("fp32", ["--dtype", "float32"]),
        ("bf16", ["--dtype", "bfloat16"]),
        ("fp8", ["--quantization", "fp8"]),
        ("auto", ["--dtype", "auto"]),
    ],
)
def test_each_quant_maps_to_its_vllm_flags(quant: str, expected: list[str]) -> None:
    argv = vllm_command(VLLMSettings(HF_REPO, quant=quant, tensor_parallel_size=1))  # type: ignore[arg-type]
    assert argv[:3] == ["vllm", "serve", HF_REPO]
    assert argv[3:5] == expected
    other = {"--dtype", "--quantization"} - {expected[0]}
    assert not other & set(argv)


def test_scheduler_and_server_settings_become_flags() -> None:
    settings = VLLMSettings(
        HF_REPO,
        host="0.0.0.0",
        port=9001,
        max_batch=64,
        ctx=8192,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.85,
        tokenizer=HF_REPO,
        served_model_name="coder",
        extra_args=["--seed", "7"],
    )
    argv = vllm_command(settings)
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert flag(argv, "--max-num-seqs") == "64"
    assert flag(argv, "--max-model-len") == "8192"
    assert flag(argv, "--gpu-memory-utilization") == "0.85"
    assert flag(argv, "--tokenizer") == HF_REPO
    assert flag(argv, "--served-model-name") == "coder"
    assert flag(argv, "--host") == "0.0.0.0"
    assert flag(argv, "--port") == "9001"
    assert argv[-2:] == ["--seed", "7"]
    assert "--api-key" not in argv


def test_unset_limits_leave_vllm_defaults() -> None:
    argv = vllm_command(VLLMSettings(HF_REPO, tensor_parallel_size=1))
    for name in ("--max-num-seqs", "--max-model-len", "--gpu-memory-utilization", "--tokenizer"):
        assert name not in argv
    assert flag(argv, "--served-model-name") == HF_REPO


def test_prefix_caching_is_on_unless_turned_off() -> None:
    assert "--enable-prefix-caching" in vllm_command(VLLMSettings(HF_REPO, tensor_parallel_size=1))
    off = vllm_command(VLLMSettings(HF_REPO, tensor_parallel_size=1, prefix_caching=False))
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off


def test_api_key_is_passed_but_never_printed() -> None:
    argv = vllm_command(VLLMSettings(HF_REPO, tensor_parallel_size=1, api_key="sk-secret"))
    assert flag(argv, "--api-key") == "sk-secret"
    shown = format_command(argv)
    assert "sk-secret" not in shown and "--api-key '***'" in shown


def test_tensor_parallel_default_is_every_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert flag(vllm_command(VLLMSettings(HF_REPO)), "--tensor-parallel-size") == "4"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert flag(vllm_command(VLLMSettings(HF_REPO)), "--tensor-parallel-size") == "1"


def test_tensor_parallel_default_divides_the_catalogue_heads(
    edgecloud_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Qwen2.5-Coder-1.5B has 12 heads: on 8 GPUs vLLM would refuse TP 8, so the default is 6.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    argv = vllm_command(VLLMSettings(CLOUD_MODEL), pull=False)
    assert flag(argv, "--tensor-parallel-size") == "6"
    explicit = vllm_command(VLLMSettings(CLOUD_MODEL, tensor_parallel_size=8), pull=False)
    assert flag(explicit, "--tensor-parallel-size") == "8"


def test_catalogue_name_resolves_to_its_gguf_file(smollm2_path: Path) -> None:
    argv = vllm_command(VLLMSettings("smollm2-135m-instruct-q4", tensor_parallel_size=1, quant="bf16"))
    assert argv[2] == str(smollm2_path)
    assert flag(argv, "--served-model-name") == "smollm2-135m-instruct-q4"


def test_unpulled_catalogue_model_shows_its_future_path_without_pulling(edgecloud_home: Path) -> None:
    argv = vllm_command(VLLMSettings(CLOUD_MODEL, tensor_parallel_size=1), pull=False)
    target = edgecloud_home / "models" / f"{CLOUD_MODEL}.gguf"
    assert argv[2] == str(target)
    assert not target.exists()


def test_local_paths_and_hub_ids(tmp_path: Path) -> None:
    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    argv = vllm_command(VLLMSettings(str(gguf), tensor_parallel_size=1))
    assert argv[2] == str(gguf.resolve())
    assert flag(argv, "--served-model-name") == "my-model"

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    assert vllm_command(VLLMSettings(str(checkpoint), tensor_parallel_size=1))[2] == str(checkpoint.resolve())
    hub = vllm_command(VLLMSettings(f"hf://{HF_REPO}", tensor_parallel_size=1))
    assert hub[2] == HF_REPO and flag(hub, "--served-model-name") == HF_REPO


def test_missing_models_are_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        vllm_command(VLLMSettings(str(tmp_path / "absent.gguf"), tensor_parallel_size=1))
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        vllm_command(VLLMSettings("no-such-model", tensor_parallel_size=1))


def test_fp8_on_a_gguf_file_says_to_use_the_hf_checkpoint(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(InvalidRequestError, match="original Hugging Face checkpoint") as info:
        vllm_command(VLLMSettings(str(gguf), quant="fp8", tensor_parallel_size=1))
    assert info.value.param == "quant"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"quant": "int4"}, "quant"),
        ({"port": 0}, "port"),
        ({"ctx": 0}, "ctx"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        VLLMSettings(HF_REPO, **kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


def test_not_installed_error_says_how_to_install_and_what_would_run(no_vllm: None) -> None:
    assert not vllm.vllm_available()
    settings = VLLMSettings(HF_REPO, tensor_parallel_size=2, api_key="sk-secret")
    with pytest.raises(BackendUnavailableError) as info:
        launch_vllm(settings)
    message = str(info.value)
    assert "pip install vllm" in message and "Linux" in message and "CUDA" in message
    assert f"vllm serve {HF_REPO} --dtype auto --tensor-parallel-size 2" in message
    assert "sk-secret" not in message


def test_dry_run_prints_the_command_and_starts_nothing(
    no_vllm: None, edgecloud_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert launch_vllm(VLLMSettings(CLOUD_MODEL, tensor_parallel_size=1, max_queue=32), dry_run=True) == 0
    out, err = capsys.readouterr()
    assert out.startswith("vllm serve ") and f"--served-model-name {CLOUD_MODEL}" in out
    assert "max_queue=32 is ignored" in err
    assert not (edgecloud_home / "models" / f"{CLOUD_MODEL}.gguf").exists()


# The process handling needs a process: a stand-in `vllm` script on PATH that records its argv
# and exits with a status that tells which path it took.
STAND_IN = """#!{python}
import os, signal, sys, time
signal.signal(signal.SIGINT, lambda *_: sys.exit(3))
with open({record!r}, "w") as fh:
    fh.write("\\n".join(sys.argv[1:]))
if "--die" in sys.argv:
    os.kill(os.getpid(), signal.SIGKILL)
if "--wait" in sys.argv:
    time.sleep(30)
sys.exit(0)
"""


@pytest.fixture()
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Installs the stand-in; returns the file it records its argv in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.txt"
    script = bin_dir / "vllm"
    script.write_text(STAND_IN.format(python=sys.executable, record=str(record)))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(vllm.sys, "executable", str(tmp_path / "python"))
    return record


def test_launch_runs_vllm_serve_and_returns_its_status(stand_in: Path) -> None:
    assert launch_vllm(VLLMSettings(HF_REPO, tensor_parallel_size=1, port=8123)) == 0
    argv = stand_in.read_text().split("\n")
    assert argv[:2] == ["serve", HF_REPO] and flag(argv, "--port") == "8123"


def test_launch_reports_a_killed_vllm_as_128_plus_signal(stand_in: Path) -> None:
    status = launch_vllm(VLLMSettings(HF_REPO, tensor_parallel_size=1, extra_args=["--die"]))
    assert status == 128 + signal.SIGKILL


def test_sigint_is_forwarded_to_vllm(stand_in: Path) -> None:
    def interrupt_once_started() -> None:
        deadline = time.monotonic() + 10
        while not stand_in.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    status = launch_vllm(VLLMSettings(HF_REPO, tensor_parallel_size=1, extra_args=["--wait"]))
    assert status == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_module_entry_point_is_used_when_only_the_package_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "_vllm_executable", lambda: None)
    argv = vllm_command(VLLMSettings(HF_REPO, tensor_parallel_size=1))
    runnable = vllm._runnable(argv)
    assert runnable[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", HF_REPO]
    assert runnable[5:] == argv[3:]
