"""The vLLM launcher: settings → vLLM's argv and CPU environment, the options vLLM lacks refused,
the not-installed and cannot-start errors, dry runs, and the process handling (exit status,
signal forwarding, vLLM's own error shown) through a stand-in interpreter that injects those
faults. Real vLLM is started in tests/integration/test_vllm_real.py."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from edgecloud.serving import vllm_launch
from edgecloud.serving.vllm import API_SERVER_MODULES, VLLMSettings, format_command, vllm_command, vllm_environment
from edgecloud.serving.vllm_launch import find_vllm, launch_vllm, vllm_sources
from edgecloud.errors import BackendUnavailableError, InvalidRequestError, ModelNotFoundError

HF_REPO = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct-q4"
PY = "/opt/vllm/bin/python"


def flag(argv: list[str], name: str) -> str:
    """The value after ``name`` (which must occur exactly once)."""
    assert argv.count(name) == 1, argv
    return argv[argv.index(name) + 1]


def command(settings: VLLMSettings, source: str = HF_REPO, **kwargs: object) -> list[str]:
    return vllm_command(settings, source, python=PY, **kwargs)  # type: ignore[arg-type]


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
    argv = command(VLLMSettings(HF_REPO, quant=quant, tensor_parallel_size=1))  # type: ignore[arg-type]
    assert argv[:5] == [PY, "-m", API_SERVER_MODULES[0], "--model", HF_REPO]
    assert argv[5:7] == expected
    other = {"--dtype", "--quantization"} - {expected[0]}
    assert not other & set(argv)


def test_scheduler_and_server_settings_become_flags() -> None:
    settings = VLLMSettings(
        HF_REPO, host="0.0.0.0", port=9001, max_batch=64, ctx=8192, tensor_parallel_size=2,
        gpu_memory_utilization=0.85, tokenizer=HF_REPO, served_model_name="coder", extra_args=["--seed", "7"],
    )
    argv = command(settings)
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert flag(argv, "--max-num-seqs") == "64"
    assert flag(argv, "--max-model-len") == "8192"
    assert flag(argv, "--gpu-memory-utilization") == "0.85"
    assert flag(argv, "--tokenizer") == HF_REPO
    assert flag(argv, "--served-model-name") == "coder"
    assert flag(argv, "--host") == "0.0.0.0"
    assert flag(argv, "--port") == "9001"
    assert argv[-2:] == ["--seed", "7"]
    assert "--api-key" not in argv and "--speculative-config" not in argv


def test_served_name_is_the_catalogue_name_not_the_checkpoint_path() -> None:
    argv = command(VLLMSettings(CLOUD_MODEL, tensor_parallel_size=1), source="/cache/hf/qwen-abc")
    assert flag(argv, "--model") == "/cache/hf/qwen-abc"
    assert flag(argv, "--served-model-name") == CLOUD_MODEL
    assert flag(command(VLLMSettings("/models/my-model.gguf", tensor_parallel_size=1)), "--served-model-name") == "my-model"


def test_speculation_maps_onto_the_speculative_config() -> None:
    ngram = json.loads(flag(command(VLLMSettings(HF_REPO, spec="ngram", spec_k_max=5, tensor_parallel_size=1)),
                            "--speculative-config"))
    assert ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == 5
    draft = json.loads(flag(command(VLLMSettings(HF_REPO, spec="draft", draft_model="small", tensor_parallel_size=1),
                                    draft_source="/cache/hf/small"), "--speculative-config"))
    assert draft == {"model": "/cache/hf/small", "num_speculative_tokens": 4}


@pytest.mark.parametrize(
    ("kwargs", "param", "says"),
    [
        ({"max_queue": 32}, "max_queue", "no bound on its waiting queue"),
        ({"spec": "auto"}, "spec", "--spec ngram"),
        ({"spec": "draft"}, "draft_model", "--draft-model"),
        ({"quant": "int4"}, "quant", "fp32"),
        ({"port": 0}, "port", "1-65535"),
        ({"ctx": 0}, "ctx", "at least 1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size", "at least 1"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization", "fraction"),
        ({"kv_offload_gib": 0}, "kv_offload", "above 0"),
        ({"kv_offload_gib": 2, "kv_offload_backend": "disk"}, "kv_offload_backend", "native, lmcache"),
    ],
)
def test_options_vllm_lacks_or_bad_values_are_refused_by_name(kwargs: dict[str, object], param: str, says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says) as info:
        VLLMSettings(HF_REPO, **kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


def test_kv_offload_maps_to_vllms_offloading_flags() -> None:
    argv = command(VLLMSettings(HF_REPO, kv_offload_gib=4, tensor_parallel_size=1))
    assert flag(argv, "--kv-offloading-backend") == "native" and flag(argv, "--kv-offloading-size") == "4"
    argv = command(VLLMSettings(HF_REPO, kv_offload_gib=1.5, kv_offload_backend="lmcache", tensor_parallel_size=1))
    assert flag(argv, "--kv-offloading-backend") == "lmcache" and flag(argv, "--kv-offloading-size") == "1.5"
    assert "--kv-offloading-size" not in command(VLLMSettings(HF_REPO, tensor_parallel_size=1))


def test_api_key_is_passed_but_never_printed() -> None:
    argv = command(VLLMSettings(HF_REPO, tensor_parallel_size=1, api_key="sk-secret"))
    assert flag(argv, "--api-key") == "sk-secret"
    shown = format_command(argv)
    assert "sk-secret" not in shown and "--api-key '***'" in shown


def test_tensor_parallel_default_is_every_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert flag(command(VLLMSettings(HF_REPO)), "--tensor-parallel-size") == "4"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert flag(command(VLLMSettings(HF_REPO)), "--tensor-parallel-size") == "1"


def test_tensor_parallel_default_divides_the_catalogue_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    # Qwen2.5-Coder-1.5B has 12 heads: on 8 GPUs vLLM would refuse TP 8, so the default is 6.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert flag(command(VLLMSettings(CLOUD_MODEL)), "--tensor-parallel-size") == "6"
    assert flag(command(VLLMSettings(CLOUD_MODEL, tensor_parallel_size=8)), "--tensor-parallel-size") == "8"


def test_cpu_environment_binds_every_core_unless_set() -> None:
    env = vllm_environment(VLLMSettings(HF_REPO), cpu=True, base={})
    cores = os.cpu_count() or 1
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == (f"0-{cores - 1}" if cores > 1 else "0")
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) >= 1
    mine = vllm_environment(VLLMSettings(HF_REPO, threads=1), cpu=True,
                            base={"VLLM_CPU_KVCACHE_SPACE": "3"})
    assert mine["VLLM_CPU_OMP_THREADS_BIND"] == "0" and mine["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert vllm_environment(VLLMSettings(HF_REPO, checks_plugin=False), cpu=False, base={"A": "1"}) == {"A": "1"}


def test_vllm_finds_the_checks_plugin_on_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM loads general plugins by entry point in each of its processes: the folder the launcher
    puts first on vLLM's PYTHONPATH (keeping the caller's) must name one, and it must load."""
    import importlib.metadata
    import sys

    env = vllm_environment(VLLMSettings(HF_REPO), cpu=False, base={"PYTHONPATH": "/elsewhere"})
    first, rest = env["PYTHONPATH"].split(os.pathsep)
    assert rest == "/elsewhere"
    monkeypatch.syspath_prepend(first)
    [plugin] = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.value.startswith("edgecloud")]
    register = plugin.load()
    assert callable(register) and sys.modules[plugin.module].__file__.startswith(first)
    assert "PYTHONPATH" not in vllm_environment(VLLMSettings(HF_REPO, checks_plugin=False), cpu=False, base={})


def test_sources_pass_repos_and_checkpoints_through(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    assert vllm_sources(VLLMSettings(str(checkpoint)), convert=False) == (str(checkpoint.resolve()), None)
    assert vllm_sources(VLLMSettings(f"hf://{HF_REPO}"), convert=False)[0] == HF_REPO
    assert vllm_sources(VLLMSettings(HF_REPO), convert=False)[0] == HF_REPO


def test_a_catalogue_model_is_named_by_its_future_checkpoint_without_pulling(edgecloud_home: Path) -> None:
    source, _ = vllm_sources(VLLMSettings(CLOUD_MODEL), convert=False)
    assert source.startswith(str(edgecloud_home / "hf" / CLOUD_MODEL))
    assert not (edgecloud_home / "models" / f"{CLOUD_MODEL}.gguf").exists()


def test_missing_models_are_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        vllm_sources(VLLMSettings(str(tmp_path / "absent.gguf")))
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        vllm_sources(VLLMSettings("no-such-model"))


def test_no_vllm_says_which_extra_to_install_and_what_would_run(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        launch_vllm(VLLMSettings(HF_REPO, tensor_parallel_size=2, api_key="sk-secret"), python=str(tmp_path / "python"))
    message = str(info.value)
    assert "edgecloud[vllm]" in message and "edgecloud[vllm-cpu]" in message and "--vllm-python" in message
    assert f"--model {HF_REPO} --dtype auto --tensor-parallel-size 2" in message
    assert "sk-secret" not in message


# A stand-in interpreter injects the faults: it answers the probe as a vLLM environment would
# (or one whose torchvision is broken), and as "vLLM" records its argv, then exits, dies,
# waits for a signal, or prints an error the way vLLM does before exiting.
STAND_IN = """#!{python}
import json, os, signal, sys, time
if sys.argv[1] == "-c":
    facts = {{"python": sys.argv[0], "version": "0.32.0", "distribution": "vllm-cpu",
             "module": "vllm.entrypoints.launchers.api_server.entry"}}
    if os.environ.get("STAND_IN_FEATURES"):
        facts["features"] = os.environ["STAND_IN_FEATURES"].split(",")
    if os.environ.get("STAND_IN_TORCHVISION"):
        facts["torchvision"] = "RuntimeError: operator torchvision::nms does not exist"
    print(json.dumps(facts))
    sys.exit(0)
signal.signal(signal.SIGINT, lambda *_: sys.exit(3))
with open({record!r}, "w") as fh:
    fh.write("\\n".join(sys.argv[1:]))
if "--die" in sys.argv:
    os.kill(os.getpid(), signal.SIGKILL)
if "--fail" in sys.argv:
    print("(EngineCore pid=1) ERROR 12-02 07:31:41 [core.py:1510] ValueError: no config.json in /x", file=sys.stderr)
    print("RuntimeError: Engine core initialization failed. See root cause above.", file=sys.stderr)
    sys.exit(1)
if "--wait" in sys.argv:
    time.sleep(30)
sys.exit(0)
"""


@pytest.fixture()
def stand_in(tmp_path: Path) -> tuple[str, Path]:
    """The stand-in interpreter and the file it records vLLM's argv in."""
    record = tmp_path / "argv.txt"
    script = tmp_path / "python"
    script.write_text(STAND_IN.format(python=sys.executable, record=str(record)))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), record


def test_probe_finds_the_cpu_build(stand_in: tuple[str, Path]) -> None:
    found = find_vllm(stand_in[0])
    assert found is not None and found.distribution == "vllm-cpu" and found.cpu and found.problem is None


def test_a_broken_torchvision_is_reported_with_the_fix(stand_in: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAND_IN_TORCHVISION", "1")
    with pytest.raises(BackendUnavailableError, match="pip uninstall -y torchvision torchaudio torchcodec"):
        launch_vllm(VLLMSettings(HF_REPO, tensor_parallel_size=1), python=stand_in[0])


def test_dry_run_prints_the_command_and_starts_nothing(stand_in: tuple[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert launch_vllm(VLLMSettings(HF_REPO, tensor_parallel_size=1), python=stand_in[0], dry_run=True) == 0
    out = capsys.readouterr().out
    assert f"-m vllm.entrypoints.launchers.api_server.entry --model {HF_REPO}" in out
    assert "VLLM_CPU_OMP_THREADS_BIND=" in out
    assert not stand_in[1].exists()


def test_launch_runs_the_server_module_and_returns_its_status(stand_in: tuple[str, Path]) -> None:
    assert launch_vllm(VLLMSettings(HF_REPO, tensor_parallel_size=1, port=8123), python=stand_in[0]) == 0
    argv = stand_in[1].read_text().split("\n")
    assert argv[:4] == ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model", HF_REPO]
    assert flag(argv, "--port") == "8123"


def test_vllms_own_error_is_shown_when_it_cannot_start(stand_in: tuple[str, Path],
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    status = launch_vllm(VLLMSettings(HF_REPO, tensor_parallel_size=1, extra_args=["--fail"]), python=stand_in[0])
    assert status == 1
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last == ("edgecloud: error: vLLM exited with status 1 before serving: "
                    "RuntimeError: Engine core initialization failed. See root cause above.")


def test_launch_reports_a_killed_vllm_as_128_plus_signal(stand_in: tuple[str, Path]) -> None:
    status = launch_vllm(VLLMSettings(HF_REPO, tensor_parallel_size=1, extra_args=["--die"]), python=stand_in[0])
    assert status == 128 + signal.SIGKILL


def test_sigint_is_forwarded_to_vllm(stand_in: tuple[str, Path]) -> None:
    record = stand_in[1]

    def interrupt_once_started() -> None:
        deadline = time.monotonic() + 20
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    threading.Thread(target=interrupt_once_started, daemon=True).start()
    status = launch_vllm(VLLMSettings(HF_REPO, tensor_parallel_size=1, extra_args=["--wait"]), python=stand_in[0])
    assert status == 3
    assert signal.getsignal(signal.SIGINT) == before  # the launcher's forwarding handler is gone again


def test_the_vllm_python_comes_from_the_environment(stand_in: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_launch.PYTHON_ENV, stand_in[0])
    found = find_vllm()
    assert found is not None and found.python == stand_in[0]


def test_a_checkout_venv_vllm_is_found_without_naming_it(stand_in: tuple[str, Path], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_launch.PYTHON_ENV, raising=False)
    if vllm_launch._probe(sys.executable) is not None:
        pytest.skip("this interpreter has vLLM itself, so it is the one found")
    venv = tmp_path / "project" / ".venv-vllm" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(stand_in[0])
    inside = tmp_path / "project" / "src" / "app"
    inside.mkdir(parents=True)
    monkeypatch.chdir(inside)
    found = find_vllm()
    assert found is not None and found.python == str(venv / "python")
    monkeypatch.chdir(tmp_path)  # above the project: not found there (the checkout's own may be)
    assert str(venv / "python") not in vllm_launch.checkout_vllm_pythons()


def test_disaggregation_is_refused_by_name_where_vllm_has_no_kv_connectors(stand_in: tuple[str, Path]) -> None:
    with pytest.raises(InvalidRequestError) as error:
        launch_vllm(VLLMSettings(HF_REPO, tensor_parallel_size=1), python=stand_in[0], disaggregate="prefill=1,decode=1")
    assert error.value.param == "disaggregate" and "KV connectors" in str(error.value)
    assert not stand_in[1].exists()


def test_a_disaggregated_dry_run_prints_each_instance_with_its_connector(stand_in: tuple[str, Path],
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STAND_IN_FEATURES", "kv_transfer")
    settings = VLLMSettings(HF_REPO, tensor_parallel_size=1, port=8700)
    assert launch_vllm(settings, python=stand_in[0], dry_run=True, disaggregate="prefill=1,decode=2") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" instance:")[0] for line in lines] == ["prefill", "decode", "decode"]
    assert [flag(line.split(), "--port") for line in lines] == ["8701", "8702", "8703"]
    assert all("ExampleConnector" in line and stand_in[0] in line for line in lines)
    assert not stand_in[1].exists()
    with pytest.raises(InvalidRequestError) as error:  # vLLM's connectors do not combine with speculation
        launch_vllm(VLLMSettings(HF_REPO, tensor_parallel_size=1, spec="ngram"), python=stand_in[0],
                    disaggregate="prefill=1,decode=1")
    assert error.value.param == "disaggregate"
